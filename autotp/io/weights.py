"""``autotp.load_weights``: fill a model's tensors from a checkpoint, each rank reading only its slices.

For a parallelized model each tensor is read as this rank holds it (:class:`~autotp.plan.plan.ParamShard`): the
rank's block of every segment of a fused projection (q|k|v stored as one tensor, cut per segment), along
the dim the graph analysis chose (GPT-2's Conv1D keeps W as [in, out], so its column dim is 1), kv blocks
held by several ranks read by each of them, the owned vocab rows followed by zero padding rows, tied
weights read once. A model that is not parallelized reads every tensor whole. The sources are in
:mod:`autotp.io.sources`.

Names are matched before anything is read: the checkpoint's keys as they are, or all under one top-level
prefix more or less than the model's (a Hugging Face base-model checkpoint, ``h.0...``, for
``transformer.h.0...``); a fused parameter may be stored one key per segment (``name.segment{i}``, as
autotp's checkpoints store it). Tied weights need one of their names. Any persistent tensor without a key,
or a key that names nothing in the model, fails with one :class:`~autotp.errors.CheckpointError` listing
both; so does a shape that differs. Keys a model declares it does not own are skipped: Hugging Face models
list them as patterns in ``_keys_to_ignore_on_load_unexpected`` (GPT-2's ``attn.bias`` masks, which
checkpoints on the Hub still hold). Non-persistent buffers keep the values the model's own code computed
(:mod:`autotp.io.empty`), unless the model was built wholly on meta and the checkpoint holds them.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autotp.io.checkpoint import tp_local_empty, write_tp_local
from autotp.io.empty import (allocate_meta, check_materialized, confine, mark_loaded, prefault, swap_tensors,
                             trim_heap)
from autotp.errors import CheckpointError, ShardingError
from autotp.plan.plan import ParamShard
from autotp.shard_spec import global_runs
from autotp.io.sources import CopyRange, Source, TensorInfo, open_source
from autotp.state import find_tp_state

__all__ = ["Loaded", "Target", "check_weights", "load_weights", "match"]

_SEGMENT = re.compile(r"^(.*)\.segment(\d+)$")


@dataclass
class Target:
    """One tensor of the model (tied names together) and how this rank holds it."""

    names: list[str]
    full: tuple[int, ...]
    cut: ParamShard | None = None  # how this rank's slice is cut; None: held whole
    fused: ParamShard | None = None  # the segments of a fused projection, when known
    persistent: bool = True
    key: str | tuple[str, ...] | None = None  # the checkpoint key, or one key per segment
    dim: int = 0  # the dim pieces are read along


@dataclass(frozen=True)
class Loaded:
    """What :func:`load_weights` did on this rank."""

    path: str
    kind: str  # "safetensors", "torch" or "dcp"
    tensors: int
    bytes_read: int  # bytes of the checkpoint slices this rank read
    seconds: float
    mapped: int = 0  # tensors left as views of the file's mapping (mmap=True)


def _targets(model: nn.Module) -> list[Target]:
    st = find_tp_state(model)
    shards = st.shards if st is not None else {}
    fused = {**st.segments, **shards} if st is not None else {}
    full = st.full if st is not None else {}
    persistent = set(model.state_dict(keep_vars=True))
    by_id: dict[int, Target] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(t) in by_id:
            by_id[id(t)].names.append(name)
            by_id[id(t)].persistent |= name in persistent
            continue
        shape = tuple(full[name].shape) if name in full else tuple(t.shape)
        by_id[id(t)] = Target([name], shape, shards.get(name), fused.get(name), name in persistent)
    return list(by_id.values())


def _renamings(model_names: list[str], keys: set[str]) -> list[Callable[[str], str]]:
    """Model name -> checkpoint key: as it is, or one top-level prefix less or more."""
    out: list[Callable[[str], str]] = [lambda n: n]
    for top in sorted({n.split(".", 1)[0] for n in model_names if "." in n}):
        out.append(lambda n, p=top + ".": n[len(p):] if n.startswith(p) else n)
    for top in sorted({k.split(".", 1)[0] for k in keys if "." in k}):
        out.append(lambda n, p=top + ".": p + n)
    return out


def _segment_keys(keys: set[str]) -> dict[str, tuple[str, ...]]:
    found: dict[str, dict[int, str]] = {}
    for k in keys:
        m = _SEGMENT.match(k)
        if m:
            found.setdefault(m.group(1), {})[int(m.group(2))] = k
    return {base: tuple(idx[i] for i in range(len(idx))) for base, idx in found.items() if set(idx) == set(range(len(idx)))}


def _resolve(targets: list[Target], keys: set[str], segs: dict[str, tuple[str, ...]],
             rename: Callable[[str], str]) -> dict[int, str | tuple[str, ...]]:
    found: dict[int, str | tuple[str, ...]] = {}
    for i, t in enumerate(targets):
        for name in t.names:
            k = rename(name)
            if k in keys:
                found[i] = k
                break
            if k in segs:
                found[i] = segs[k]
                break
    return found


def _names(items: list[str], limit: int = 8) -> str:
    more = f" (and {len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _ignored(model: nn.Module) -> tuple[str, ...]:
    """Patterns of checkpoint keys the model says it does not own (Hugging Face's declaration)."""
    found: list[str] = []
    for mod in model.modules():
        found += [p for p in getattr(mod, "_keys_to_ignore_on_load_unexpected", None) or () if isinstance(p, str)]
    return tuple(dict.fromkeys(found))


def match(targets: list[Target], info: dict[str, TensorInfo], where: str, ignore: tuple[str, ...] = ()) -> None:
    """Set each target's checkpoint key and read dim; one CheckpointError for every name or shape that does
    not fit. A key that names nothing in the model is not unexpected if it matches a pattern of ``ignore``
    (``re.search``, as Hugging Face applies them)."""
    keys = set(info)
    segs = _segment_keys(keys)
    names = [n for t in targets for n in t.names]
    best, rename = None, None
    for candidate in _renamings(names, keys):
        found = _resolve(targets, keys, segs, candidate)
        if best is None or len(found) > len(best):
            best, rename = found, candidate
    used: set[str] = set()
    for i, t in enumerate(targets):
        t.key = best.get(i)
        mapped = {rename(n) for n in t.names}
        used |= mapped | {k for m in mapped for k in segs.get(m, ())}
    missing = [t.names[0] for t in targets if t.key is None and t.persistent]
    unexpected = sorted(k for k in keys - used if not any(re.search(p, k) for p in ignore))
    if missing or unexpected:
        raise CheckpointError(
            f"{where} does not match the model: {len(missing)} missing"
            + (f" ({_names(missing)})" if missing else "") + f", {len(unexpected)} unexpected"
            + (f" ({_names(unexpected)})" if unexpected else ""),
            hint="the checkpoint was written for another model or config; names are matched as they are or "
                 "under one top-level prefix more or less")
    wrong = []
    for t in targets:
        if t.key is None:
            continue
        if isinstance(t.key, str):
            shape = info[t.key].shape
            t.dim = t.cut.dim if t.cut is not None else 0
        else:
            shape, t.dim = _concat([info[k].shape for k in t.key], t)
        if shape != t.full:
            wrong.append(f"{t.names[0]} is {shape} in the checkpoint, {t.full} in the model")
    if wrong:
        raise CheckpointError(f"{where} does not match the model: {_names(wrong, 4)}",
                              hint="the checkpoint was written for another model config")


def _concat(shapes: list[tuple[int, ...]], t: Target) -> tuple[tuple[int, ...], int]:
    """The shape of segments joined along the fused dim (the plan's, else the one the model's shape shows)."""
    if t.fused is not None:
        if len(shapes) != len(t.fused.segments) or \
                any(len(s) <= t.fused.dim or s[t.fused.dim] != g.size for s, g in zip(shapes, t.fused.segments)):
            return (len(shapes), *shapes[0]), 0  # segments other than the model's: reported as a mismatch
        dims = [t.fused.dim]
    else:
        dims = [d for d in range(len(t.full)) if sum(s[d] for s in shapes) == t.full[d]]
    for d in dims:
        if all(len(s) == len(t.full) and all(s[i] == t.full[i] for i in range(len(s)) if i != d) for s in shapes):
            shape = list(t.full)
            shape[d] = sum(s[d] for s in shapes)
            return tuple(shape), d
    return (len(shapes), *shapes[0]), 0  # reported as a mismatch


def _pieces(t: Target, local: torch.Tensor, tp: int, rank: int) -> list[CopyRange]:
    """This rank's ranges of the full tensor along ``t.dim`` and where each lands in ``local``."""
    cut = t.cut
    if cut is None:
        return [CopyRange(0, t.full[t.dim] if t.full else 0, local)]
    if cut.vocab is not None:  # owned rows, then zero padding rows
        owned = cut.vocab.owned(rank)
        local.narrow(cut.dim, owned, local.shape[cut.dim] - owned).zero_()
        return [CopyRange(cut.vocab.start(rank), owned, local.narrow(cut.dim, 0, owned))] if owned else []
    return [CopyRange(start, length, local.narrow(cut.dim, at, length))
            for start, length, at in global_runs(cut.segments, tp, rank)]


def _read(source: Source, t: Target, pieces: list[CopyRange], info: dict[str, TensorInfo]) -> None:
    if isinstance(t.key, str):
        source.read(t.key, t.dim, pieces)
        return
    lo = 0
    for key in t.key:  # one key per segment: route each range to the segments it covers
        size = info[key].shape[t.dim]
        mine = []
        for p in pieces:
            a, b = max(p.start, lo), min(p.start + p.length, lo + size)
            if a < b:
                mine.append(CopyRange(a - lo, b - a, p.out.narrow(t.dim, a - p.start, b - a)))
        if mine:
            source.read(key, t.dim, mine)
        lo += size


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    mod, _, leaf = name.rpartition(".")
    owner = model.get_submodule(mod)
    return owner._parameters[leaf] if leaf in owner._parameters else owner._buffers[leaf]


def _materialize_buffer(model: nn.Module, t: Target, device: torch.device) -> torch.Tensor:
    """A buffer of a model built wholly on meta, about to be read: allocated on ``device`` in every module."""
    old = _tensor(model, t.names[0])
    new = torch.empty(old.shape, dtype=old.dtype, device=device)
    swap_tensors(model, "buffers", lambda b: new if b is old else None)
    return new


def check_weights(model: nn.Module, path: Path | str) -> Source:
    """Open ``path`` and match its names and shapes against ``model`` (any device, meta included); the
    source, or the CheckpointError loading would raise. Reads no tensor data."""
    source = open_source(path)
    match(_targets(model), source.tensors(), str(path), _ignored(model))
    return source


def _exclusive(local: torch.Tensor) -> bool:
    """``local`` is a CPU tensor owning its whole storage, and no other tensor views it (such a view would
    go on reading the old storage once ``local`` is given the file's)."""
    if local.device.type != "cpu" or local.storage_offset() or local.untyped_storage().nbytes() != local.nbytes:
        return False
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count is not None and use_count(local.untyped_storage()._cdata) <= 2  # it and this call's wrapper


def _mapped(source: Source, t: Target, local: torch.Tensor, pieces: list[CopyRange],
            info: dict[str, TensorInfo]) -> torch.Tensor | None:
    """The checkpoint's mapped range that can become ``local`` itself: one piece covering all of it, stored
    as one run of bytes in ``local``'s dtype (checked first: a view handed out counts as read)."""
    if not isinstance(t.key, str) or len(pieces) != 1 or pieces[0].out.shape != local.shape \
            or info[t.key].dtype != local.dtype:
        return None
    view = source.view(t.key, t.dim, pieces[0])
    if view is None or view.dtype != local.dtype or view.shape != local.shape or not view.is_contiguous():
        return None
    return view


def load_weights(model: nn.Module, path: Path | str, *, device: torch.device | str | None = None,
                 mmap: bool = False) -> Loaded:
    """Fill ``model``'s parameters and persistent buffers from the checkpoint at ``path``, in place.

    ``path``: a Hugging Face checkpoint folder or file (safetensors, one file or sharded with
    ``model.safetensors.index.json``), an autotp or other torch.distributed.checkpoint folder, or a
    ``torch.save``'d state dict (memory-mapped). On a parallelized model each rank reads only its slices and
    no collective runs (under FSDP each rank reads its whole TP shard, one tensor at a time, and keeps its
    data-parallel piece); a model that is not parallelized reads whole tensors (``device``: where its meta
    tensors are allocated, default the CPU). Names and shapes are checked before any data is read.

    ``mmap=True`` (safetensors and torch files, on the CPU): a tensor whose slice is one run of bytes in
    the file, in its own dtype (a whole tensor, a column shard's rows), becomes a view of the file's
    private, copy-on-write mapping, as ``from_pretrained`` and ``torch.load(mmap=True)`` leave weights:
    nothing is copied, pages are read from the page cache on first use, and a write (an optimizer step)
    copies only the page it writes. The file is never written. It must not be rewritten in place while the
    model lives: pages not yet copied would then show the new bytes, or fault (SIGBUS) where the file
    shrank. autotp's own writers replace files by renaming, which is safe; ``safetensors.torch.save_file``
    onto the same path is not. Other slices (a row shard's columns, vocab padding, a dtype change) are
    copied as without it.
    """
    begin = time.perf_counter()
    st = find_tp_state(model)
    tp, rank = (st.tp, st.rank) if st is not None else (1, 0)
    where = st.device if st is not None else torch.device(device or "cpu")
    if st is None:
        allocate_meta(model, where)
    targets = _targets(model)
    source = open_source(path)
    info = source.tensors()
    match(targets, info, str(path), _ignored(model))
    trim_heap()  # before the shards' pages are touched: what planning freed is not carried into the peak
    loaded = mapped = 0
    wholes: list[tuple[DTensor, torch.Tensor]] = []
    with torch.no_grad():
        for t in targets:
            if t.key is None or st is not None and all(n in st.dropped for n in t.names):
                continue  # not in the checkpoint's scope, or another rank's pipeline stage
            local = _tensor(model, t.names[0])
            if not t.persistent and not local.is_meta:
                continue  # computed by the model's own code
            if local.is_meta:
                local = _materialize_buffer(model, t, where)
            if isinstance(local, DTensor):  # FSDP: this rank's TP shard read whole, its dp piece kept
                wholes.append((local, tp_local_empty(local)))
                local = wholes[-1][1]
            exclusive = mmap and _exclusive(local)  # before the pieces, which view it
            pieces = _pieces(t, local, tp, rank)
            if exclusive and (view := _mapped(source, t, local, pieces, info)) is not None:
                local.set_(view)  # the tensor's storage is now the file's mapping (same object, same names)
                confine(local)  # its faults map its own pages, not the neighbours' (other ranks' rows)
                loaded, mapped = loaded + 1, mapped + 1
                continue
            prefault(local)  # the pages it is about to fill, mapped in one call rather than one fault per page
            _read(source, t, pieces, info)
            loaded += 1
        source.finish()  # a DCP source reads everything asked for here
        for sharded, whole in wholes:
            write_tp_local(sharded, whole)
    mark_loaded(model)
    unloaded = tuple(n for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta)
    try:
        check_materialized(unloaded)
    except ShardingError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return Loaded(str(path), source.kind, loaded, source.bytes_read, time.perf_counter() - begin, mapped)
