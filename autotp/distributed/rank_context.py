"""A rank's side of a job: from the :class:`~autotp.distributed.job.RankJob` the launcher handed it to its
process group, its one ``DeviceMesh`` and the groups that come from it.

:func:`init_job` is where a rank starts: it initialises the default process group (the job's backend and
timeout) if the script has not, builds the job's :class:`~autotp.distributed.rank_grid.RankGrid` mesh once, and
keeps the :class:`RankContext` as this process's own, so that ``autotp.parallelize(model)`` without a group,
``autotp.pipeline``, ``broadcast_batch`` and the integrations find the same groups (:func:`current_context`
and its kin): the tp group's size is the job's tp, never parsed again, and no group is looked up in torch's
registry of live groups. ``autotp shard``'s ranks get the job as their function's argument; a script under
``autotp run`` reads it from ``AUTOTP_JOB`` (:func:`init_from_env`, or the first :func:`current_context`).
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
from autotp.distributed.rank_grid import MESH_CP, MESH_DP, MESH_PP, MESH_TP, RankGrid
from autotp.errors import LaunchError, ProcessGroupError

__all__ = ["RankContext", "cp_from_env", "current_context", "current_cp_group", "current_dp_group", "current_job",
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
    # the default process group the mesh was made on: its groups live as long as that one
    world: dist.ProcessGroup | None = field(default=None, repr=False, compare=False)

    @property
    def grid(self) -> RankGrid:
        return self.job.grid

    @property
    def coords(self) -> dict[str, int]:
        return self.grid.coords(self.rank)

    @property
    def live(self) -> bool:
        """Whether the process group this context was made on is still the process's default one (a job that
        destroyed it and made another, as a test does, gets a new context)."""
        return dist.is_initialized() and self.world is not None and dist.group.WORLD is self.world

    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(MESH_TP)

    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(MESH_DP)

    def cp_group(self) -> dist.ProcessGroup | None:
        """The context-parallel group; None without context parallelism."""
        return self.mesh.get_group(MESH_CP) if self.grid.cp > 1 else None

    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(MESH_PP)

    def block_mesh(self, parts: int) -> DeviceMesh:
        """The (pp, dp, [cp,] tp_block, tp_copy) mesh of blocks held by ``tp/parts`` ranks each (kv heads fewer
        than tp): sharded over ``parts`` blocks, replicated over their copies. Made once per job and kept here,
        since making one creates process groups on every rank."""
        if parts not in self.meshes:
            g = self.grid
            cp = ((g.cp,), (MESH_CP,)) if g.cp > 1 else ((), ())
            self.meshes[parts] = init_device_mesh(self.device.type, (g.pp, g.dp, *cp[0], parts, g.tp // parts),
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


@dataclass
class _ThisProcess:
    """The rank context :func:`init_job` made for this process: one value per process, as torch keeps the
    process's default group, valid while that group lives (:attr:`RankContext.live`). Not a cache: the job's
    mesh is made once because making one creates process groups on every rank (a collective), and every later
    caller must reach the same groups, not a second set of them."""

    context: RankContext | None = None


_THIS_PROCESS = _ThisProcess()


def _kept() -> RankContext | None:
    ctx = _THIS_PROCESS.context
    return ctx if ctx is not None and ctx.live else None


def init_job(job: RankJob) -> RankContext:
    """This rank's context for the ``job`` its launcher handed it (``autotp shard``'s argument, ``autotp run``'s
    ``AUTOTP_JOB``): the process group (made here with the job's backend and timeout unless the script made
    one), and the job's mesh, made here once and kept as this process's own (a second call returns it).
    Collective the first time: every rank of the job must call it, in the same order relative to other group
    creation."""
    kept = _kept()
    if kept is not None:
        if kept.job != job:
            raise LaunchError(f"this process's ranks were set up for the job {kept.job.sizes}, and were handed "
                              f"another: {job.sizes}", fields=("job",))
        return kept
    _THIS_PROCESS.context = _make_context(job)
    return _THIS_PROCESS.context


def _make_context(job: RankJob) -> RankContext:
    """The process group (unless the script made one) and the job's mesh, made now; collective."""
    _init_process_group(job.backend, job.timeout)
    backend = dist.get_backend()
    bind_from_env(backend)  # before the mesh's groups: their gloo threads inherit the binding (once per process)
    world = dist.get_world_size()
    if world != job.grid.world_size:
        raise LaunchError(f"the process group has {world} ranks, and the job {job.sizes} expects "
                          f"{job.grid.world_size}", fields=("world_size",))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return RankContext(job=job, mesh=job.grid.device_mesh(device.type), rank=dist.get_rank(), backend=backend,
                       device=device, world=dist.group.WORLD)


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
        grid = RankGrid.build(dist.get_world_size(), tp, pp=pp, dp=dp, cp=cp)
    except (TypeError, ValueError) as exc:
        raise LaunchError(str(exc)) from exc
    # the job's backend names the device its mesh lives on (a script's own group may be "cpu:gloo,cuda:nccl")
    return _make_context(RankJob(grid, "nccl" if "nccl" in dist.get_backend() else "gloo"))


def init_from_env(environ: Mapping[str, str] | None = None) -> RankContext:
    """:func:`init_job` with the job ``autotp run`` put in ``AUTOTP_JOB``."""
    job = job_from_env(environ)
    if job is None:
        raise ProcessGroupError(f"{ENV_JOB} is not set, so this process was not started by `autotp run`",
                                hint="start it with `autotp run SCRIPT --tp N [--dp N]`, or call "
                                     "autotp.distributed.launch.init_distributed(tp=N) yourself")
    return init_job(job)


def current_context(environ: Mapping[str, str] | None = None) -> RankContext | None:
    """This process's rank context: the one :func:`init_job` kept (``autotp shard``'s ranks, a script's
    :func:`init_from_env`), else, under ``autotp run``, the job in ``AUTOTP_JOB`` made into one now (collective:
    every rank must reach this call, as every rank reaches ``parallelize``); None outside a job."""
    kept = _kept()
    if kept is not None:
        return kept
    job = job_from_env(environ)
    return None if job is None else init_job(job)


def current_job(environ: Mapping[str, str] | None = None) -> RankJob | None:
    """The job this process runs: its kept context's, else the one ``autotp run`` (or ``autotp launch``'s
    function ranks) handed it; None outside one. Makes no group."""
    kept = _kept()
    return kept.job if kept is not None else job_from_env(environ)


def current_tp_group(environ: Mapping[str, str] | None = None) -> dist.ProcessGroup | None:
    """The job's TP group (its mesh's tp dim) under autotp's launchers; None outside a job. Collective when the
    job's mesh is not made yet (:func:`current_context`)."""
    ctx = current_context(environ)
    return None if ctx is None else ctx.tp_group()


def cp_from_env(environ: Mapping[str, str] | None = None) -> int:
    """The context-parallel size of the job (``--cp``); 1 without one or outside a job."""
    job = current_job(environ)
    return 1 if job is None else job.grid.cp


def current_cp_group(environ: Mapping[str, str] | None = None) -> dist.ProcessGroup | None:
    """The job's context-parallel group under ``--cp``; None without one. Collective."""
    if cp_from_env(environ) == 1:
        return None
    ctx = current_context(environ)
    return None if ctx is None else ctx.cp_group()


def current_dp_group(environ: Mapping[str, str] | None = None) -> dist.ProcessGroup | None:
    """The job's data-parallel group; None outside a job, before any process group, or when dp is 1.
    Collective when the job's mesh is not made yet: every rank must reach this call."""
    job = current_job(environ)
    if job is None or not dist.is_initialized() or job.grid.dp == 1:
        return None
    ctx = current_context(environ)
    return None if ctx is None else ctx.dp_group()


def fsdp_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """The FSDP replica groups ``--fsdp [--hsdp R]`` asked for (1: plain FSDP); None: no FSDP."""
    job = current_job(environ)
    return None if job is None else job.fsdp


def current_mesh(environ: Mapping[str, str] | None = None) -> DeviceMesh | None:
    """The job's (pp, dp, [cp,] tp) device mesh under autotp's launchers; None outside a job. Collective when
    it is not made yet: every rank must reach this call."""
    ctx = current_context(environ)
    return None if ctx is None else ctx.mesh
