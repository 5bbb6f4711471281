"""The process groups of context parallelism: which ranks share a sequence, and which share its tensor shards.

Megatron's order puts tp innermost, then cp, then dp: the ranks of a cp group are tp apart, and a tp group
lies inside one cp rank. A mesh the caller built names its dims; under ``autotp run --cp`` the job's mesh
(its :class:`~autotp.distributed.rank_context.RankContext`) has them; otherwise the world is cut into groups
of cp consecutive ranks (tp 1), the rest of the world data-parallel.
"""
from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autotp.distributed.rank_context import RankContext
from autotp.errors import ProcessGroupError


class ContextGroups(NamedTuple):
    tp: dist.ProcessGroup
    cp: dist.ProcessGroup
    # the data-parallel group of a world cut into cp groups here (None: the caller's mesh or the job says, or
    # one replica)
    dp: dist.ProcessGroup | None = None


def context_mesh(mesh: DeviceMesh | None, tp_group: dist.ProcessGroup | None, cp: int,
                 ctx: RankContext | None = None) -> ContextGroups:
    """The (tp, cp[, dp]) groups for ``cp`` context-parallel ranks: ``mesh``'s dims, else the job's mesh (``ctx``
    under autotp's launchers with ``--cp``), else the world cut into groups of ``cp`` consecutive ranks; collective
    (it may build the groups)."""
    if mesh is not None:
        names = mesh.mesh_dim_names or ()
        if "cp" not in names:
            raise ProcessGroupError(f"context_parallel={cp} needs a mesh with a 'cp' dim, and this one has "
                                    f"{', '.join(names) or 'no names'}",
                                    hint="build it with init_device_mesh(device, (dp, cp, tp), "
                                         "mesh_dim_names=('dp', 'cp', 'tp'))")
        size = mesh.get_group("cp").size()
        if size != cp:
            raise ProcessGroupError(f"context_parallel={cp}, and the mesh's cp dim has {size} ranks")
        tp = mesh.get_group("tp") if "tp" in names else None
        return ContextGroups(tp if tp is not None else _alone(), mesh.get_group("cp"))
    if ctx is not None and ctx.grid.cp > 1:  # under `autotp run --cp`: the job's mesh
        if ctx.grid.cp != cp:
            raise ProcessGroupError(f"context_parallel={cp}, and `--cp {ctx.grid.cp}` laid out the ranks "
                                    f"({ctx.job.sizes})",
                                    hint="pass no context_parallel (the launcher's), or the same number")
        return ContextGroups(tp_group or ctx.tp_group(), ctx.cp_group())
    if tp_group is not None:
        raise ProcessGroupError(f"context_parallel={cp} with a tp_group: pass a mesh with 'cp' and 'tp' dims "
                                "instead, so that both groups are known")
    if not (dist.is_available() and dist.is_initialized()):
        raise ProcessGroupError(f"context_parallel={cp} needs a process group, and none is initialised",
                                hint="call torch.distributed.init_process_group first (under torchrun)")
    world = dist.get_world_size()
    if world % cp:
        raise ProcessGroupError(f"context_parallel={cp} does not divide the world size {world}",
                                hint=f"start a multiple of {cp} ranks, or use a cp that divides {world}")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    made = init_device_mesh(device, (world // cp, cp, 1), mesh_dim_names=("dp", "cp", "tp"))
    # dp: the ranks holding the same chunk of other replicas' sequences ([r % cp, r % cp + cp, ...])
    return ContextGroups(made.get_group("tp"), made.get_group("cp"), made.get_group("dp") if world > cp else None)


def _alone() -> dist.ProcessGroup:
    """A group of this rank alone (tp 1); collective: every rank makes every one."""
    mine = None
    for r in range(dist.get_world_size()):
        g = dist.new_group([r])
        if r == dist.get_rank():
            mine = g
    return mine
