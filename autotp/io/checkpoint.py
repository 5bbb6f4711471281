"""Checkpoints of a parallelized model.

- Consolidated: ``full_state_dict`` gathers every sharded parameter over the tensor-parallel group (one
  all-gather per parameter, on every rank) and returns it with the original names and un-padded shapes, so
  the unsharded model's ``load_state_dict`` accepts it. ``load_full_state_dict`` cuts each rank's slice out.
- Sharded (torch.distributed.checkpoint): ``sharded_state_dict`` views each rank's shards as DTensors in
  the unsharded model's coordinates (one key per segment of a fused parameter), so a checkpoint written at
  one tp loads at another (``load_checkpoint``) and into full tensors (``load_unsharded``).

Under FSDP a parameter (and each optimizer moment) is a DTensor over the (dp, tp) mesh, its TP shard cut
again over dp. FSDP's own state dict would name the different TP shards under one key, so the contract stays
autotp's: each rank's TP shard is gathered over its dp group (:func:`tp_local`) and written in the same
global per-segment layout; a load fills those gathered copies and :class:`WriteBack` copies each rank's
dp chunk back into FSDP's shards. So a checkpoint moves between FSDP, DDP and plain TP at any tp.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from autotp.io.ckpt_safety import METADATA, read_metadata, safe_load
from autotp.io.empty import mark_loaded
from autotp.errors import CheckpointError
from autotp.distributed.launch import RankContext
from autotp.plan.plan import ParamShard, Plan
from autotp.shard_spec import Segment
from autotp.operators.gathered import all_gather_flat
from autotp.state import tp_state


def reshard(model: torch.nn.Module) -> None:
    """Free whatever FSDP still holds gathered (the root's parameters after a forward that no backward
    followed), so that the module's parameters are FSDP's shards again, those the optimizer steps."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def tp_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor-parallel shard of ``t``: ``t`` itself, or for a DTensor over a (dp, ..., tp) mesh
    (FSDP's parameters and optimizer moments) its local tensor gathered over every dim but the last (tp)."""
    if not isinstance(t, DTensor):
        return t
    whole = [Replicate()] * (t.device_mesh.ndim - 1) + [t.placements[-1]]
    return t.redistribute(t.device_mesh, whole).to_local()


class WriteBack:
    """The gathered copies :func:`tp_local` made for a load, and the FSDP-sharded tensors they belong to:
    :meth:`apply` writes each rank's dp chunk of the loaded copy into its shard. One copy per tensor (ties)."""

    def __init__(self) -> None:
        self.pairs: dict[int, tuple[DTensor, torch.Tensor]] = {}

    def local(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, DTensor):
            return t
        if id(t) not in self.pairs:
            self.pairs[id(t)] = (t, tp_local(t.detach()))
        return self.pairs[id(t)][1]

    def apply(self) -> None:
        for t, local in self.pairs.values():
            write_tp_local(t, local)


def tp_local_shape(t: DTensor) -> torch.Size:
    """The shape of this rank's TP shard of FSDP-sharded ``t`` (its global view holds the TP shards side by
    side along a ``Shard`` on the last mesh dim)."""
    shape = list(t.shape)
    if t.placements[-1].is_shard():
        shape[t.placements[-1].dim] //= t.device_mesh.size(t.device_mesh.ndim - 1)
    return torch.Size(shape)


def tp_local_empty(t: DTensor) -> torch.Tensor:
    """An uninitialised tensor shaped like this rank's TP shard of FSDP-sharded ``t``."""
    return torch.empty(tp_local_shape(t), dtype=t.dtype, device=t.device)


def write_tp_local(t: DTensor, local: torch.Tensor) -> None:
    """Write this rank's whole TP shard ``local`` into FSDP-sharded ``t``: only its dp piece is kept (a local
    cut, no communication)."""
    whole = [Replicate()] * (t.device_mesh.ndim - 1) + [t.placements[-1]]
    full = DTensor.from_local(local, t.device_mesh, whole, run_check=False, shape=t.shape, stride=t.stride())
    with torch.no_grad():
        t.to_local().copy_(full.redistribute(t.device_mesh, t.placements).to_local())


def _shards_by_name(module: torch.nn.Module) -> dict[str, ParamShard]:
    """Every state-dict name of a sharded parameter -> its shard (tied names share one)."""
    return dict(tp_state(module).shards)


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict (CPU tensors) of ``module``; a collective: call it on every TP rank. Of a
    model cut into pipeline stages: this rank's stages' entries."""
    st = tp_state(module)
    shards = _shards_by_name(module)
    gathered: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    copies = WriteBack()  # under FSDP: each rank's TP shard, gathered over dp
    reshard(module)
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name in st.dropped:
            continue
        tensor = copies.local(tensor)
        shard = shards.get(name)
        if shard is None or st.tp == 1:
            out[name] = tensor.detach().cpu().clone()
            continue
        if id(tensor) not in gathered:
            local = tensor.detach().contiguous()
            buf = local.new_empty(st.tp * local.numel())
            all_gather_flat(buf, local.flatten(), group=st.group)
            gathered[id(tensor)] = shard.unshard(list(buf.view(st.tp, *local.shape).unbind(0)), st.tp).cpu()
        out[name] = gathered[id(tensor)]
    return out


def save_pretrained_full(self, save_directory, *args, **kwargs):
    """``save_pretrained`` of a parallelized model: the full, unsharded model (gathered on every rank of
    the group, a collective), written once by global rank 0 unless ``is_main_process`` says otherwise."""
    st = tp_state(self)
    if kwargs.get("state_dict") is None:
        kwargs["state_dict"] = full_state_dict(self)
    kwargs.setdefault("is_main_process", dist.get_rank() == 0)
    out = super(type(self), self).save_pretrained(save_directory, *args, **kwargs)
    dist.barrier(group=st.group)  # the files are complete when any rank returns
    return out


def load_full_state_dict(module: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Copy each rank's slice of an unsharded ``state_dict`` into ``module`` (no communication)."""
    st = tp_state(module)
    shards = _shards_by_name(module)
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise KeyError(f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, tensor in own.items():
            if name not in state_dict:
                continue
            full = state_dict[name].to(device=tensor.device, dtype=tensor.dtype)
            shard = shards.get(name)
            local = full if shard is None else shard.shard(full, st.tp, st.rank)
            if local.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(full.shape)} gives a local shard "
                                 f"{tuple(local.shape)}, the model holds {tuple(tensor.shape)} (tp={st.tp})")
            tensor.copy_(local)
    mark_loaded(module, set(state_dict))


def sharded_state_dict(tpm: torch.nn.Module, ctx: RankContext,
                       copies: WriteBack | None = None) -> dict[str, torch.Tensor]:
    """``tpm.state_dict()`` in global coordinates, for torch.distributed.checkpoint.

    Replicated tensors stay plain (DCP keeps one copy). A sharded parameter becomes one DTensor per
    segment (``name`` for one segment, ``name.segment{i}`` for fused ones), each a view of the local shard,
    so ``dcp.load`` writes straight into the parameters and a checkpoint can be resharded. Under FSDP the
    views are of each rank's gathered TP shard (``copies``, whose ``apply`` writes a load back).
    """
    copies = WriteBack() if copies is None else copies
    reshard(tpm)
    dropped = tp_state(tpm).dropped  # pipelined: the parameters of other ranks' stages, which they save
    state = {name: copies.local(t) for name, t in tpm.state_dict(keep_vars=True).items() if name not in dropped}
    by_id = {id(state[name]): shard for name, shard in checkpoint_shards(tpm).items() if name in state}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        shard = by_id.get(id(tensor))
        if shard is None:
            out[name] = tensor.detach()
        else:
            out.update(global_views(name, tensor.detach(), shard, ctx))
    return out


def checkpoint_shards(tpm: torch.nn.Module) -> dict[str, ParamShard]:
    """Every parameter name whose checkpoint entries are views: the sharded ones, and at tp 1 the fused ones
    (their segments are keys of their own at every tp)."""
    st = tp_state(tpm)
    return {**st.segments, **st.shards}


def global_views(name: str, local: torch.Tensor, shard: ParamShard, ctx: RankContext) -> dict[str, DTensor]:
    """``local`` (this rank's shard of a parameter, or any tensor of its shape: an optimizer moment) as views
    in the unsharded parameter's coordinates: ``{name: DTensor}``, or ``{name.segment{i}: DTensor}`` for a
    fused parameter. The views share ``local``'s memory, so a DCP load writes into it."""
    if shard.vocab is not None:
        # rank r owns torch.chunk's r-th block of the vocab rows; the rows after it are padding
        owned = local.narrow(shard.dim, 0, shard.vocab.owned(ctx.coords["tp"]))
        shape = list(shard.full_shape)
        shape[shard.dim] = shard.vocab.size
        return {name: _dtensor(owned, ctx.mesh, shard.dim, tuple(shape))}
    leaves = sum(len(seg.inner) or 1 for seg in shard.segments)
    out, offset, leaf = {}, 0, 0
    for seg in shard.segments:
        piece = local.narrow(shard.dim, offset, seg.local())
        offset += seg.local()
        if seg.inner:
            out.update(_group_views(name, piece, shard, seg, leaf, ctx))
            leaf += len(seg.inner)
            continue
        shape = list(shard.full_shape)
        shape[shard.dim] = seg.size
        key = name if leaves == 1 else f"{name}.segment{leaf}"
        out[key] = _dtensor(piece, _mesh(ctx, seg.parts), shard.dim, tuple(shape))
        leaf += 1
    return out


def _group_views(name: str, piece: torch.Tensor, shard: ParamShard, seg: Segment, leaf: int,
                 ctx: RankContext) -> dict[str, DTensor]:
    """A grouped segment (G groups of [q | k | v]) as one key per inner segment, each of global shape
    ``[G, inner size, ...]``: sharded over the groups, and over the ranks sharing a group where its heads are
    split (q), replicated there where they are not (k, v)."""
    d, copies = shard.dim, ctx.grid.tp // seg.parts
    grouped = piece.unflatten(d, (seg.groups // seg.parts, -1))  # (groups here, one group's local width, ...)
    out, start = {}, 0
    for i, sub in enumerate(seg.inner):
        view = grouped.narrow(d + 1, start, sub.local())
        start += sub.local()
        shape = list(shard.full_shape)
        shape[d:d + 1] = [seg.groups, sub.size]
        within = None if copies == 1 else Shard(d + 1) if sub.parts == copies else Replicate()
        out[f"{name}.segment{leaf + i}"] = _dtensor(view, _mesh(ctx, seg.parts), d, tuple(shape), within)
    return out


def _mesh(ctx: RankContext, parts: int) -> DeviceMesh:
    """The tp mesh, or for kv blocks held by tp/parts ranks each one that shards over the blocks and
    replicates over the copies."""
    return ctx.mesh if parts == ctx.grid.tp else ctx.block_mesh(parts)


def _dtensor(local: torch.Tensor, mesh, dim: int, shape: tuple[int, ...], within: Shard | Replicate | None = None) -> DTensor:
    """``local`` as its block of a tensor of ``shape``: replicated over pp, dp (and cp), sharded over the tp dims.

    On a (pp, dp, [cp,] tp_block, tp_copy) mesh the copies of a block are replicated too, unless ``within``
    says how they cut the block (a group's q heads split among the ranks sharing it).
    """
    by_dim = {"tp": Shard(dim), "tp_block": Shard(dim), "tp_copy": within or Replicate()}
    placements = [by_dim.get(name, Replicate()) for name in mesh.mesh_dim_names]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def load_unsharded(model: torch.nn.Module, plan: Plan | None, path: Path | str) -> None:
    """Load a :func:`save_checkpoint` checkpoint into a model holding full tensors (the unsharded model, or a
    tp-1 parallelized one), in one process, no group. Fused parameters were saved one key per segment; the
    segments are read from the checkpoint itself, so any tp's checkpoint loads (``plan`` is not needed)."""
    state = model.state_dict(keep_vars=True)
    metadata = read_metadata(path)
    meta = metadata.state_dict_metadata
    pieces: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if f"model.{name}" in meta or f"model.{name}.segment0" not in meta:
            pieces[name] = tensor.detach()
            continue
        i, offset = 0, 0
        while f"model.{name}.segment{i}" in meta:
            md = meta[f"model.{name}.segment{i}"]
            size = tuple(md.size) if isinstance(md, TensorStorageMetadata) else ()
            if len(size) == tensor.dim() + 1:  # a grouped segment: [G, inner size, ...] per inner segment
                i, offset = _load_group(name, tensor.detach(), meta, i, offset, pieces, path)
                continue
            dim = next((d for d, (a, b) in enumerate(zip(size, tensor.shape)) if a != b), None)
            if dim is None or len(size) != tensor.dim() or offset + size[dim] > tensor.shape[dim]:
                raise CheckpointError(f"{Path(path) / METADATA} does not match this model: segment {i} of "
                                      f"{name} is {size or 'not a tensor'}, the parameter is {tuple(tensor.shape)}")
            pieces[f"{name}.segment{i}"] = tensor.detach().narrow(dim, offset, size[dim])
            offset += size[dim]
            i += 1
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        safe_load({"model": pieces}, path, metadata=metadata, no_dist=True)


def _load_group(name: str, tensor: torch.Tensor, meta: dict, i: int, offset: int, pieces: dict,
                path: Path | str) -> tuple[int, int]:
    """The run of grouped keys from segment ``i`` on (same G, one extra dim), as views of ``tensor``."""
    sizes = []
    while True:
        md = meta.get(f"model.{name}.segment{i + len(sizes)}")
        if not isinstance(md, TensorStorageMetadata) or len(md.size) != tensor.dim() + 1:
            break
        sizes.append(tuple(md.size))
    dim = next((d for d in range(tensor.dim()) if sizes[0][d] != tensor.shape[d]), None)
    width = sum(s[dim + 1] for s in sizes) if dim is not None else 0
    if dim is None or any(s[:dim] != sizes[0][:dim] or s[dim] != sizes[0][dim] for s in sizes) \
            or offset + sizes[0][dim] * width > tensor.shape[dim]:
        raise CheckpointError(f"{Path(path) / METADATA} does not match this model: grouped segments {i}.. of {name} "
                              f"are {sizes}, the parameter is {tuple(tensor.shape)}")
    groups = tensor.narrow(dim, offset, sizes[0][dim] * width).unflatten(dim, (sizes[0][dim], width))
    start = 0
    for k, size in enumerate(sizes):
        pieces[f"{name}.segment{i + k}"] = groups.narrow(dim + 1, start, size[dim + 1])
        start += size[dim + 1]
    return i + len(sizes), offset + sizes[0][dim] * width


def save_checkpoint(tpm: torch.nn.Module, ctx: RankContext, path: Path | str) -> None:
    dcp.save({"model": sharded_state_dict(tpm, ctx)}, checkpoint_id=str(path))


def load_checkpoint(tpm: torch.nn.Module, ctx: RankContext, path: Path | str) -> None:
    """Load a :func:`save_checkpoint` checkpoint into ``tpm``'s parameters in place (see
    :mod:`autotp.io.ckpt_safety`: nothing in the files is unpickled as arbitrary objects)."""
    copies = WriteBack()
    safe_load({"model": sharded_state_dict(tpm, ctx, copies)}, path)
    copies.apply()
    mark_loaded(tpm)
