"""``autotp.save_weights``: write the full, unsharded model from its shards, one tensor at a time.

The writer is global rank 0. For each tensor its TP group gathers the shards to the writer (one
``gather`` per sharded tensor; replicated ones are already whole there), which cuts the vocab padding,
joins fused segments and kv blocks (:meth:`~autotp.plan.plan.ParamShard.unshard`) and writes it; no rank ever
holds the whole model. Ranks outside the writer's TP group (data-parallel replicas) only wait.

- ``format="safetensors"``: Hugging Face's layout, in the folder ``path``: ``model.safetensors`` when it
  all fits in ``max_shard_bytes``, else ``model-0000i-of-0000n.safetensors`` files of at most that size
  (a larger tensor gets a file of its own) and ``model.safetensors.index.json``. A safetensors file is
  written whole, so the writer holds at most one file's tensors. Tied weights are written once, under
  their first name (``from_pretrained`` and :func:`autotp.load_weights` tie them again).
- ``format="torch"``: one ``torch.save`` file holding every state-dict name (tied names share storage), as
  ``torch.load`` + ``load_state_dict`` expect. It is written with ``torch.serialization.skip_data`` (the
  layout, no bytes), then each tensor is copied into the file through a shared memory map, renewed every
  :data:`~autotp.io.sources.REMAP_BYTES` so that the written pages do not pile up in the writer's RSS.

Every file is written under a temporary name and renamed when complete (the index last), so a crash
leaves the previous export whole; old shard files the new index does not name are removed after it.
"""
from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from autotp.plan.plan import ParamShard
from autotp.io.sources import INDEX, REMAP_BYTES, SINGLE
from autotp.state import find_tp_state

__all__ = ["save_weights"]


@dataclass(frozen=True)
class _Entry:
    names: tuple[str, ...]  # state-dict names of one tensor (tied ones together)
    local: torch.Tensor
    shard: ParamShard | None
    shape: tuple[int, ...]  # full

    @property
    def nbytes(self) -> int:
        return self.local.element_size() * torch.Size(self.shape).numel()


def _entries(model: nn.Module) -> list[_Entry]:
    st = find_tp_state(model)
    shards = st.shards if st is not None and st.tp > 1 else {}
    groups: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    out = []
    for key, names in groups.items():
        shard = shards.get(names[0])
        shape = tuple(st.full[names[0]].shape) if shard is not None else tuple(tensors[key].shape)
        out.append(_Entry(tuple(names), tensors[key].detach(), shard, shape))
    return out


def _gather(e: _Entry, group: dist.ProcessGroup | None, writer: bool) -> torch.Tensor | None:
    """The full tensor on the writer (CPU), None elsewhere; a collective over ``group`` for a sharded one."""
    if e.shard is None:
        return e.local.cpu() if writer else None
    local = e.local.contiguous()
    tp = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(tp)] if writer else None
    dist.gather(local, parts, dst=dist.get_global_rank(group, 0), group=group)
    return e.shard.unshard(parts, tp).cpu() if writer else None


def _files(entries: list[_Entry], max_bytes: int) -> list[list[_Entry]]:
    files: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if files[-1] and size + e.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return files


def _replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def _write_safetensors(entries: list[_Entry], path: Path, group, writer: bool, max_bytes: int) -> None:
    from safetensors.torch import save_file

    files = _files(entries, max_bytes)
    n = len(files)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    if writer:
        path.mkdir(parents=True, exist_ok=True)
    for name, members in zip(names, files):
        tensors = {}
        for e in members:
            full = _gather(e, group, writer)
            if writer:
                tensors[e.names[0]] = full.contiguous()
        if writer:
            save_file(tensors, str(path / f".{name}.tmp"), metadata={"format": "pt"})
            _replace(path / f".{name}.tmp", path / name)
    if not writer:
        return
    if n > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                 "weight_map": {e.names[0]: name for name, members in zip(names, files) for e in members}}
        (path / f".{INDEX}.tmp").write_text(json.dumps(index, indent=2) + "\n")
        _replace(path / f".{INDEX}.tmp", path / INDEX)
    elif (path / INDEX).exists():
        (path / INDEX).unlink()
    for old in [*path.glob("model-*-of-*.safetensors"), path / SINGLE]:
        if old.name not in names and old.exists():
            old.unlink()


def _write_torch(entries: list[_Entry], path: Path, group, writer: bool) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    if writer:
        from torch._subclasses.fake_tensor import FakeTensorMode

        path.parent.mkdir(parents=True, exist_ok=True)
        with FakeTensorMode():  # shapes and dtypes only: the layout is written, not the bytes
            layout = {n: t for e in entries for t in [torch.empty(e.shape, dtype=e.local.dtype)] for n in e.names}
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(layout, tmp)
    mapped, mapped_bytes = None, 0
    for e in entries:
        full = _gather(e, group, writer)
        if not writer:
            continue
        if mapped is None:
            with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):  # writes go to the file
                mapped = torch.load(tmp, mmap=True, weights_only=True, map_location="cpu")
        mapped[e.names[0]].copy_(full)
        mapped_bytes += e.nbytes
        if mapped_bytes > REMAP_BYTES:
            mapped, mapped_bytes = None, 0
    if writer:
        del mapped
        _replace(tmp, path)


def save_weights(model: nn.Module, path: Path | str, *, format: str = "safetensors",
                 max_shard_bytes: int = 1 << 30) -> Path:
    """Write ``model``'s full weights to ``path`` (a folder for ``"safetensors"``, a file for ``"torch"``).

    On a parallelized model a collective: every rank calls it; global rank 0 writes (see the module doc).
    Returns ``path`` once the files are complete, on every rank.
    """
    if format not in ("safetensors", "torch"):
        raise ValueError(f"format must be 'safetensors' or 'torch', got {format!r}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    path = Path(path)
    st = find_tp_state(model)
    distributed = dist.is_available() and dist.is_initialized()
    group = st.group if st is not None else None
    writer = not distributed or dist.get_rank() == 0
    if distributed and st is not None and 0 not in dist.get_process_group_ranks(group):
        dist.barrier()  # another TP group's replica of the same weights: the writer's group writes
        return path
    entries = _entries(model)
    if format == "safetensors":
        _write_safetensors(entries, path, group, writer, max_shard_bytes)
    else:
        _write_torch(entries, path, group, writer)
    if distributed:
        dist.barrier()  # the files are complete when any rank returns
    return path
