"""A rank's side of a job: from the :class:`~autotp.distributed.job.RankJob` the launcher handed it to its
process group, its one ``DeviceMesh`` and the groups that come from it.

:func:`init_job` is where a rank starts: it initialises the default process group (the job's backend and
timeout) if the script has not, builds the job's :class:`~autotp.distributed.layout.RankLayout` mesh once, and
keeps the :class:`RankContext` as this process's own, so that ``autotp.parallelize(model)`` without a group,
``autotp.pipeline``, ``broadcast_batch`` and the integrations find the same groups (:func:`current_tp_group`
and its kin): the tp group's size is the job's tp, never parsed again. ``autotp shard``'s ranks get the job as
their function's argument; a script under ``autotp run`` reads it from ``AUTOTP_JOB`` (:func:`init_from_env`).
:func:`init_distributed` builds a context from sizes given in code, and keeps it to its caller.
"""
from __future__ import annotations

import atexit
import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autotp.distributed.cpu_binding import bind_from_env
from autotp.distributed.job import ENV_JOB, RankJob, choose_backend, job_from_env
from autotp.distributed.layout import MESH_CP, MESH_DP, MESH_PP, MESH_TP, RankLayout
from autotp.errors import LaunchError, ProcessGroupError

__all__ = ["RankContext", "cp_from_env", "current_cp_group", "current_dp_group", "current_job",
           "current_mesh", "current_tp_group", "fsdp_from_env", "init_distributed", "init_from_env", "init_job"]


@dataclass(frozen=True)
class RankContext:
    """This rank's place in the job: the job, the DeviceMesh that owns its groups, its global rank."""

    job: RankJob
    mesh: DeviceMesh
    rank: int
    backend: str  # the process group's own (a script may have made an nccl group under a gloo job)
    device: torch.device
    meshes: dict[int, DeviceMesh] = field(default_factory=dict, repr=False, compare=False)  # see block_mesh

    @property
    def layout(self) -> RankLayout:
        return self.job.layout

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(MESH_TP)

    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(MESH_DP)

    def cp_group(self) -> dist.ProcessGroup | None:
        """The context-parallel group; None without context parallelism."""
        return self.mesh.get_group(MESH_CP) if self.layout.cp > 1 else None

    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(MESH_PP)

    def block_mesh(self, parts: int) -> DeviceMesh:
        """The (pp, dp, [cp,] tp_block, tp_copy) mesh of blocks held by ``tp/parts`` ranks each (kv heads fewer
        than tp): sharded over ``parts`` blocks, replicated over their copies. Made once per job and kept here,
        since making one creates process groups on every rank."""
        if parts not in self.meshes:
            lay = self.layout
            cp = ((lay.cp,), (MESH_CP,)) if lay.cp > 1 else ((), ())
            self.meshes[parts] = init_device_mesh(self.device.type, (lay.pp, lay.dp, *cp[0], parts, lay.tp // parts),
                                                  mesh_dim_names=(MESH_PP, MESH_DP, *cp[1], "tp_block", "tp_copy"))
        return self.meshes[parts]


def _init_process_group(backend: str, timeout: float | None) -> None:
    """The default process group (env://, as the launcher sets it), unless the script made its own."""
    if dist.is_initialized():
        return
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout)} if timeout is not None else {}
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart not in ("", "0") and "MASTER_ADDR" in os.environ:
        # after a restart (--max-restarts) the store may still hold the failed attempt's keys (gloo's peer
        # addresses among them); a prefix per attempt keeps the new ranks from connecting to dead ones
        store, rank, world = next(dist.rendezvous("env://", **kwargs))
        dist.init_process_group(backend, store=dist.PrefixStore(f"autotp/attempt-{restart}", store),
                                rank=rank, world_size=world, **kwargs)
    else:
        dist.init_process_group(backend, **kwargs)
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    # the group made for a script that never made one (`autotp run` + parallelize): torch leaves it alive at
    # exit, and gloo's threads outliving the interpreter can abort the rank after its last line ran
    # ("terminate called without an active exception"), failing a job that succeeded
    if dist.is_initialized():
        dist.destroy_process_group()


def init_job(job: RankJob) -> RankContext:
    """This rank's context for the ``job`` its launcher handed it (``autotp shard``'s argument, ``autotp run``'s
    ``AUTOTP_JOB``): the process group (made here with the job's backend and timeout unless the script made
    one), and the job's mesh, made here. Collective: every rank of the job must call it, in the same order
    relative to other group creation."""
    _init_process_group(job.backend, job.timeout)
    backend = dist.get_backend()
    bind_from_env(backend)  # before the mesh's groups: their gloo threads inherit the binding (once per process)
    world = dist.get_world_size()
    if world != job.layout.world_size:
        raise LaunchError(f"the process group has {world} ranks, and the job {job.sizes} expects "
                          f"{job.layout.world_size}", fields=("world_size",))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return RankContext(job=job, mesh=job.layout.device_mesh(device.type), rank=dist.get_rank(), backend=backend,
                       device=device)


def init_distributed(tp: int, dp: int | None = None, pp: int = 1, backend: str | None = None,
                     cp: int = 1) -> RankContext:
    """Initialise the default process group (env://, as the launcher sets it) if needed; build the mesh of
    ``tp × cp × dp × pp`` ranks (dp: the world's rest when None). The context is the caller's: parallelize
    takes its groups when given them (``tp_group=ctx.tp_group()``, ``mesh=ctx.mesh``).

    Collective: every rank of the job must call it, in the same order relative to other group creation.
    """
    if not dist.is_initialized():
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        launched = job_from_env()  # a launched function's ranks keep the launcher's --timeout
        _init_process_group(backend or choose_backend(local_world), None if launched is None else launched.timeout)
    try:
        layout = RankLayout.build(dist.get_world_size(), tp, pp=pp, dp=dp, cp=cp)
    except (TypeError, ValueError) as exc:
        raise LaunchError(str(exc)) from exc
    # the job's backend names the device its mesh lives on (a script's own group may be "cpu:gloo,cuda:nccl")
    return init_job(RankJob(layout, "nccl" if "nccl" in dist.get_backend() else "gloo"))


def init_from_env(environ: Mapping[str, str] | None = None) -> RankContext:
    """:func:`init_job` with the job ``autotp run`` put in ``AUTOTP_JOB``."""
    job = job_from_env(environ)
    if job is None:
        raise ProcessGroupError(f"{ENV_JOB} is not set, so this process was not started by `autotp run`",
                                hint="start it with `autotp run SCRIPT --tp N [--dp N]`, or call "
                                     "autotp.distributed.launch.init_distributed(tp=N) yourself")
    return init_job(job)


def _mesh_group(job: RankJob, dim: str) -> dist.ProcessGroup | None:
    """This rank's group along ``dim`` of the job's mesh when this process has made it already (the script's
    :func:`init_from_env`, or an earlier lookup), found in torch's registry of live groups by the ranks the job's
    layout puts there (the mesh's own first); None when there is none yet."""
    lay, me = job.layout, dist.get_rank()
    ranks = next(g for g in getattr(lay, f"{dim}_groups") if me in g)  # the layout's tp_groups, cp_groups, ...
    return _existing_group(ranks, dim)


def _existing_group(ranks: list[int], dim: str = MESH_TP) -> dist.ProcessGroup | None:
    # torch's own registry of live groups (private, hence the getattr guards and the callers' fallback); a
    # DeviceMesh names its groups mesh_<dim>, and those are preferred to another group of the same ranks
    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_group_ranks", None) or {}
    matches = [pg for pg, members in registry.items() if sorted(members) == ranks]
    preferred = [pg for pg in matches if getattr(pg, "group_desc", "") == f"mesh_{dim}"]
    return (preferred or matches or [None])[0]


def _job_group(dim: str, environ: Mapping[str, str] | None) -> dist.ProcessGroup | None:
    """The job's group along ``dim``: the mesh's made already, else the job's mesh made now (collective); None
    outside a job."""
    job = job_from_env(environ)
    if job is None:
        return None
    if dist.is_initialized():  # the script made its own group, or the mesh: bind as init_job would have
        bind_from_env(dist.get_backend(), os.environ if environ is None else environ)
        world = dist.get_world_size()
        if world != job.layout.world_size:
            raise LaunchError(f"the process group has {world} ranks, and the job {job.sizes} expects "
                              f"{job.layout.world_size}", fields=("world_size",))
        found = _mesh_group(job, dim)
        if found is not None:
            return found
    return init_job(job).mesh.get_group(dim)


def current_job(environ: Mapping[str, str] | None = None) -> RankJob | None:
    """The job ``autotp run`` (or ``autotp launch``'s function ranks) handed this process; None outside one."""
    return job_from_env(environ)


def current_tp_group(environ: Mapping[str, str] | None = None) -> dist.ProcessGroup | None:
    """The job's TP group (its mesh's tp dim) under ``autotp run``; None outside a job.

    Reuses the mesh :func:`init_from_env` made; when there is none yet it makes the job's mesh, which is
    collective: every rank must reach this call (as every rank reaches ``parallelize``)."""
    return _job_group(MESH_TP, environ)


def cp_from_env(environ: Mapping[str, str] | None = None) -> int:
    """The context-parallel size of the job (``autotp run --cp``); 1 without one or outside a job."""
    job = current_job(environ)
    return 1 if job is None else job.layout.cp


def current_cp_group(environ: Mapping[str, str] | None = None) -> dist.ProcessGroup | None:
    """The job's context-parallel group under ``autotp run --cp``; None without one. Collective."""
    return None if cp_from_env(environ) == 1 else _job_group(MESH_CP, environ)


def current_dp_group(environ: Mapping[str, str] | None = None) -> dist.ProcessGroup | None:
    """The job's data-parallel group; None outside a job, before any process group, or when dp is 1.
    Collective when the job's mesh is not made yet: every rank must reach this call."""
    job = current_job(environ)
    if job is None or not dist.is_initialized() or job.layout.dp == 1:
        return None
    return _job_group(MESH_DP, environ)


def fsdp_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """The FSDP replica groups ``autotp run --fsdp [--hsdp R]`` asked for (1: plain FSDP); None: no FSDP."""
    job = current_job(environ)
    return None if job is None else job.fsdp


def current_mesh(environ: Mapping[str, str] | None = None) -> DeviceMesh | None:
    """The job's (pp, dp, [cp,] tp) device mesh under ``autotp run``; None outside a job. Collective (it makes
    the mesh's groups): every rank must reach this call."""
    job = current_job(environ)
    return None if job is None else init_job(job).mesh
