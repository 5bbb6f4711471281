"""Sharded data parallelism (FSDP2) over the data-parallel ranks: its settings and its meshes.

With ``fsdp``, every parameter's tensor-parallel shard is sharded again over its data-parallel group
(ZeRO-3, through ``torch.distributed.fsdp.fully_shard``): a rank keeps 1/(t·d) of the training state and
gathers one block's parameters at a time. HSDP (``replicas`` > 1) shards within groups of d / replicas
ranks and replicates across them, as one does across nodes: the gathers stay inside a node and only the
gradients' all-reduce crosses.

FSDP2 sees the tensor-parallel shards as DTensors over the ``tp`` dim of the same device mesh as its
data-parallel dim(s), so the two compose the way torchtitan composes them: FSDP shards dim 0 of each
rank's local shard, and a gradient norm over the parameters spans both dims.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from autotp.combinations import refused
from autotp.errors import ProcessGroupError, ShardingError

DP_DIMS = ("dp",)
HSDP_DIMS = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class FSDPConfig:
    """How ``autotp.parallelize(model, fsdp=...)`` shards over the data-parallel ranks.

    ``reshard_after_forward``: free each block's gathered parameters after its forward and gather them again
    for its backward (less memory, one more all-gather per block); False keeps them until the backward.
    None (the default) chooses as torchtitan does: True for ``parallelize``, False for pipeline stages (each
    stage one unit, gathered once per step instead of once per micro-batch's forward and backward).
    ``prefetch``: gather the next unit's parameters while this one runs (forward), the previous one's while
    this one's backward runs (False: no explicit prefetching; FSDP2 still prefetches one unit in backward
    by itself). ``param_dtype``/``reduce_dtype``: FSDP's mixed precision (e.g. bf16 compute
    with fp32 gradient reduction; the sharded master weights stay in their own dtype). ``replicas``: HSDP
    with this many replica groups (1: plain FSDP). ``offload``: keep the sharded state on the CPU
    (``CPUOffloadPolicy``).
    """

    reshard_after_forward: bool | None = None
    prefetch: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    replicas: int = 1
    offload: bool = False

    def resharded(self, pipelined: bool) -> bool:
        """Whether a unit's parameters are freed after its forward (``reshard_after_forward`` resolved)."""
        return (not pipelined) if self.reshard_after_forward is None else self.reshard_after_forward

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"fsdp replicas must be an integer >= 1, got {self.replicas!r}")


def fsdp_meshes(mesh: DeviceMesh, config: FSDPConfig) -> tuple[DeviceMesh, DeviceMesh]:
    """(the data-parallel mesh FSDP shards over, the tensor-parallel mesh) of ``mesh``, a device mesh with a
    ``tp`` dim and a ``dp`` dim (or ``dp_replicate`` and ``dp_shard``). For HSDP a ``dp`` dim is unflattened
    into (``dp_replicate``, ``dp_shard``) of sizes (replicas, dp / replicas)."""
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        raise ProcessGroupError(f"the device mesh for fsdp needs a 'tp' dim; it has {names}",
                                hint="e.g. init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))")
    if "cp" in names and mesh["cp"].size() > 1:
        return _with_context(mesh, config), mesh["tp"]
    if all(n in names for n in HSDP_DIMS):
        return _joined(mesh, HSDP_DIMS), mesh["tp"]
    if "dp" not in names:
        raise ProcessGroupError(f"the device mesh for fsdp needs a 'dp' dim (or 'dp_replicate' and 'dp_shard'); "
                                f"it has {names}")
    dp = mesh["dp"].size()
    if config.replicas == 1:
        return _joined(mesh, ("dp",)), mesh["tp"]
    _check_replicas(config, dp, 1)
    split = mesh._unflatten(names.index("dp"), (config.replicas, dp // config.replicas), HSDP_DIMS)
    return _joined(split, HSDP_DIMS), split["tp"]


def _with_context(mesh: DeviceMesh, config: FSDPConfig) -> DeviceMesh:
    """With context parallelism FSDP shards over the dp and cp ranks together (a cp rank holds the same
    parameters as its group, torchtitan's ``dp_shard_cp``): the two dims flattened into one, ``dp_cp``, and with
    the tp dim into one more for the gradient norm's single all-reduce. With HSDP (``replicas`` > 1) the mesh
    is (``dp_replicate``, ``dp_shard_cp``)."""
    names = mesh.mesh_dim_names or ()
    if "dp" not in names:
        raise ProcessGroupError(f"fsdp with context parallelism needs a mesh with 'dp', 'cp' and 'tp' dims; it has "
                                f"{names}", hint="e.g. init_device_mesh(device, (dp, cp, tp), "
                                                 "mesh_dim_names=('dp', 'cp', 'tp'))")
    dp = mesh["dp"].size()
    _check_replicas(config, dp, mesh["cp"].size())
    shard = mesh[("dp", "cp")]._flatten("dp_cp")
    if mesh["tp"].size() > 1:
        mesh[("dp", "cp", "tp")]._flatten()
    if config.replicas == 1:
        return shard
    # HSDP (torchtitan's dp_replicate × dp_shard_cp): FSDP shards over dp/replicas · cp ranks and all-reduces
    # over the replicas; dp_cp's rank i·cp + j (dp i, cp j) is replica i // (dp / replicas), shard
    # (i % (dp / replicas))·cp + j
    return shard._unflatten(0, (config.replicas, dp // config.replicas * mesh["cp"].size()),
                            ("dp_replicate", "dp_shard_cp"))


def _check_replicas(config: FSDPConfig, dp: int, cp: int) -> None:
    """HSDP's replica groups against the mesh's dp (and cp) sizes, by the rule the launcher asks
    (:func:`autotp.combinations.refused`): a ShardingError naming them. Plain FSDP over a mesh of one dp × cp
    rank is left to run (a user's mesh; the launcher refuses such a job)."""
    if config.replicas == 1:
        return
    reason = refused(fsdp=True, dp=dp, context_parallel=cp, hsdp=config.replicas)
    if reason is not None:
        raise ShardingError(f"the device mesh: {reason.message}", hint=reason.hint)


def _joined(mesh: DeviceMesh, dp_dims: tuple[str, ...]) -> DeviceMesh:
    """``mesh[dp_dims]``, with the data-parallel and tensor-parallel dims also flattened into one: a sum over
    all of them (the gradient norm of ``clip_grad_norm_``: Partial over dp and tp) is then one all-reduce of
    the whole group, as Megatron's, not one per dim (DTensor merges them only where that flattened mesh
    exists)."""
    if mesh.size() > 1 and all(mesh[d].size() > 1 for d in (*dp_dims, "tp")):
        mesh[(*dp_dims, "tp")]._flatten()
    return mesh[dp_dims]

