"""Checkpoints of a parallelized model.

- Consolidated: ``full_state_dict`` gathers every sharded parameter over the tensor-parallel group (one
  all-gather per parameter, on every rank) and returns it with the original names and un-padded shapes, so
  the unsharded model's ``load_state_dict`` accepts it. ``load_full_state_dict`` cuts each rank's slice out.
- Sharded (torch.distributed.checkpoint): ``sharded_state_dict`` views each rank's shards as DTensors in
  the unsharded model's coordinates (one key per segment of a fused parameter), so a checkpoint written at
  one tp loads at another (``load_checkpoint``) and into full tensors (``load_unsharded``).
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autotp.launch import RankContext
from autotp.plan import ParamShard, Plan
from autotp.gathered import all_gather_flat
from autotp.runtime import tp_state


def _shards_by_name(module: torch.nn.Module) -> dict[str, ParamShard]:
    """Every state-dict name of a sharded parameter -> its shard (tied names share one)."""
    return dict(tp_state(module).shards)


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict (CPU tensors) of ``module``; a collective: call it on every TP rank."""
    st = tp_state(module)
    shards = _shards_by_name(module)
    gathered: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
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


def sharded_state_dict(tpm: torch.nn.Module, ctx: RankContext) -> dict[str, torch.Tensor]:
    """``tpm.state_dict()`` in global coordinates, for torch.distributed.checkpoint.

    Replicated tensors stay plain (DCP keeps one copy). A sharded parameter becomes one DTensor per
    segment (``name`` for one segment, ``name.segment{i}`` for fused ones), each a view of the local shard,
    so ``dcp.load`` writes straight into the parameters and a checkpoint can be resharded.
    """
    state = tpm.state_dict(keep_vars=True)
    by_id = {id(state[name]): shard for name, shard in tp_state(tpm).shards.items() if name in state}
    layout, meshes = ctx.layout, {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        shard = by_id.get(id(tensor))
        if shard is None:
            out[name] = tensor.detach()
            continue
        if shard.vocab is not None:
            # rank r owns torch.chunk's r-th block of the vocab rows; the rows after it are padding
            owned = tensor.detach().narrow(shard.dim, 0, shard.vocab.owned(ctx.coords["tp"]))
            shape = list(shard.full_shape)
            shape[shard.dim] = shard.vocab.size
            out[name] = _dtensor(owned, ctx.mesh, shard.dim, tuple(shape))
            continue
        offset = 0
        for i, seg in enumerate(shard.segments):
            if seg.parts not in meshes:
                # kv blocks held by tp/parts ranks each: shard over the blocks, replicate over the copies
                meshes[seg.parts] = ctx.mesh if seg.parts == layout.tp else init_device_mesh(
                    ctx.device.type, (layout.pp, layout.dp, seg.parts, layout.tp // seg.parts),
                    mesh_dim_names=("pp", "dp", "tp_block", "tp_copy"))
            piece = tensor.detach().narrow(shard.dim, offset, seg.local())
            shape = list(shard.full_shape)
            shape[shard.dim] = seg.size
            key = name if len(shard.segments) == 1 else f"{name}.segment{i}"
            out[key] = _dtensor(piece, meshes[seg.parts], shard.dim, tuple(shape))
            offset += seg.local()
    return out


def _dtensor(local: torch.Tensor, mesh, dim: int, shape: tuple[int, ...]) -> DTensor:
    """``local`` as its block of a tensor of ``shape``: replicated over pp and dp, sharded over the tp dims.

    On a (pp, dp, tp_block, tp_copy) mesh the copies of a block are replicated too.
    """
    placements = [Replicate(), Replicate(), Shard(dim)] + [Replicate()] * (mesh.ndim - 3)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def load_unsharded(model: torch.nn.Module, plan: Plan | None, path: Path | str) -> None:
    """Load a :func:`save_checkpoint` checkpoint into a model holding full tensors (the unsharded model, or a
    tp-1 parallelized one), in one process, no group. Fused parameters were saved one key per segment; the
    segments are read from the checkpoint itself, so any tp's checkpoint loads (``plan`` is not needed)."""
    state = model.state_dict(keep_vars=True)
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    pieces: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if f"model.{name}" in meta or f"model.{name}.segment0" not in meta:
            pieces[name] = tensor.detach()
            continue
        i, offset = 0, 0
        while f"model.{name}.segment{i}" in meta:
            size = tuple(meta[f"model.{name}.segment{i}"].size)
            dim = next(d for d, (a, b) in enumerate(zip(size, tensor.shape)) if a != b)
            pieces[f"{name}.segment{i}"] = tensor.detach().narrow(dim, offset, size[dim])
            offset += size[dim]
            i += 1
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({"model": pieces}, checkpoint_id=str(path), no_dist=True)


def save_checkpoint(tpm: torch.nn.Module, ctx: RankContext, path: Path | str) -> None:
    dcp.save({"model": sharded_state_dict(tpm, ctx)}, checkpoint_id=str(path))


def load_checkpoint(tpm: torch.nn.Module, ctx: RankContext, path: Path | str) -> None:
    """Load a :func:`save_checkpoint` checkpoint into ``tpm``'s parameters in place."""
    dcp.load({"model": sharded_state_dict(tpm, ctx)}, checkpoint_id=str(path))
