"""How one tensor is split across the tensor-parallel group, and how to cut a rank's slice.

A sharded dimension is a sequence of contiguous *segments* (one for a plain projection; q, k, v for a
fused one). Every segment is cut into ``parts`` equal blocks. ``parts`` is the tp size, or less when the
segment has fewer heads than ranks (grouped-query kv heads): then rank r holds block ``r // (tp // parts)``
and each block is replicated on ``tp // parts`` ranks, as Megatron does.

A *grouped* segment (``inner`` set) is G equal groups laid out alike, each the concatenation of the inner
segments (Falcon's fused ``[n_kv, q heads of the group | k | v, d]``). Its blocks are whole groups; when the
groups are fewer than the ranks, each group is held by ``tp // parts`` ranks that cut its inner segments
among themselves (its q heads split, its k and v head on each of them).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Segment:
    size: int  # global length along the sharded dim
    parts: int  # distinct blocks; == tp unless heads are replicated
    inner: tuple[Segment, ...] = ()  # a grouped segment: one group's layout, cut among the ranks sharing it

    @property
    def groups(self) -> int:
        return self.size // sum(i.size for i in self.inner) if self.inner else 1

    def local(self) -> int:
        if self.inner:
            return self.groups // self.parts * sum(i.local() for i in self.inner)
        return self.size // self.parts

    @classmethod
    def from_dict(cls, d: dict) -> Segment:
        return cls(d["size"], d["parts"], tuple(cls.from_dict(i) for i in d.get("inner", ())))


@dataclass(frozen=True)
class Sharding:
    """Sharding of one activation or weight: which dim, which segments.

    ``inner`` is ``(dim, parts)`` of a broadcast (expanded) dim that carries the rest of the split when the
    segments have fewer parts than tp: repeat_kv's ``n_rep`` dim when kv heads are replicated.
    ``outer``: the dim is ``[k, segments]`` flattened with ``k`` whole on every rank: heads folded under the
    batch (``[b·heads, s, d]``, as baddbmm-style attention writes it); its local size is ``k·local``.
    """

    dim: int
    segments: tuple[Segment, ...]
    inner: tuple[int, int] | None = None
    outer: bool = False
    # a grouped layout viewed [.., groups, per-group width, d]: the per-group dim and its inner segments (in
    # units of that dim), until slices read the q heads, k and v apart
    group: tuple[int, tuple[Segment, ...]] | None = None

    @property
    def local_size(self) -> int:
        return sum(s.local() for s in self.segments)

    def moved(self, dim: int, inner_dim: int | None = None) -> Sharding:
        inner = None if self.inner is None else (inner_dim if inner_dim is not None else self.inner[0], self.inner[1])
        return replace(self, dim=dim, inner=inner)

    def single(self) -> Segment | None:
        return self.segments[0] if len(self.segments) == 1 else None

    def ratio(self) -> int | None:
        """full / local size of the dim when every rank holds the same fraction of it, else None."""
        full = sum(s.size for s in self.segments)
        return full // self.local_size if full % self.local_size == 0 and \
            all(s.size * self.local_size == s.local() * full for s in self.segments) else None


def strided(s: Sharding, full: int) -> Sharding:
    """A parameter's cut for an ``outer`` sharding of its dim of size ``full``: ``[k, segments]`` with the k
    blocks whole on every rank is a grouped segment of k groups held by every rank (parts 1), each group cut by
    its inner segments. The query projection of grouped-query attention whose kv heads are repeated head-minor
    (query head h reads kv head h % n_kv): rank r holds, in every one of the n_rep groups, the query heads of
    its own kv heads; the output projection's rows likewise."""
    if not s.outer:
        return s
    return Sharding(s.dim, (Segment(full, 1, s.segments),))


def block_index(parts: int, tp: int, rank: int) -> int:
    """Which of a segment's ``parts`` blocks rank ``rank`` of ``tp`` holds."""
    return rank // (tp // parts)


def local_indices(segments: tuple[Segment, ...], tp: int, rank: int) -> torch.Tensor:
    """Global indices, along the sharded dim, of the elements rank ``rank`` holds (in local order)."""
    idx, offset = [], 0
    for seg in segments:
        b = block_index(seg.parts, tp, rank)
        if seg.inner:  # whole groups, or one group cut among the tp // parts ranks that share it
            width, copies = seg.size // seg.groups, tp // seg.parts
            per_block = seg.groups // seg.parts
            inner = local_indices(seg.inner, copies, rank % copies)
            idx += [offset + (b * per_block + g) * width + inner for g in range(per_block)]
        else:
            start = offset + b * seg.local()
            idx.append(torch.arange(start, start + seg.local()))
        offset += seg.size
    return torch.cat(idx)


def global_runs(segments: tuple[Segment, ...], tp: int, rank: int) -> list[tuple[int, int, int]]:
    """Rank ``rank``'s slice as contiguous runs ``(global start, length, local start)``, in local order."""
    idx = local_indices(segments, tp, rank).tolist()
    runs: list[tuple[int, int, int]] = []
    for at, i in enumerate(idx):
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, runs[-1][2])
        else:
            runs.append((i, 1, at))
    return runs


@dataclass(frozen=True)
class LocalRun:
    """A run of a rank's local slice that is one block of one (inner) segment: ``copies`` ranks hold it."""

    start: int  # along the local dim
    length: int
    copies: int
    leaf: int  # which (inner) segment, numbered in layout order across the segments


def local_runs(segments: tuple[Segment, ...], tp: int) -> list[LocalRun]:
    """The blocks of a rank's local slice in local order, and how many ranks hold each (the same on every
    rank). Norms count a block held by several ranks once; their gradients are summed over those ranks."""
    out: list[LocalRun] = []
    start = leaf = 0
    for seg in segments:
        if seg.inner:
            copies = tp // seg.parts
            for _ in range(seg.groups // seg.parts):
                for i, sub in enumerate(local_runs(seg.inner, copies)):
                    out.append(LocalRun(start, sub.length, sub.copies, leaf + i))
                    start += sub.length
            leaf += len(seg.inner)
        else:
            out.append(LocalRun(start, seg.local(), tp // seg.parts, leaf))
            start += seg.local()
            leaf += 1
    return out


def shard_tensor(full: torch.Tensor, dim: int, segments: tuple[Segment, ...], tp: int, rank: int,
                 outer: bool = False) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` (a fresh contiguous tensor); ``outer``: see :class:`Sharding`."""
    if outer:
        width = sum(s.size for s in segments)
        local = shard_tensor(full.unflatten(dim, (-1, width)), dim + 1, segments, tp, rank)
        return local.flatten(dim, dim + 1)
    if sum(s.size for s in segments) != full.shape[dim]:
        raise ValueError(f"segments {segments} do not cover dim {dim} of size {full.shape[dim]}")
    if len(segments) == 1 and not segments[0].inner:
        seg = segments[0]
        return full.narrow(dim, block_index(seg.parts, tp, rank) * seg.local(), seg.local()).clone()
    return full.index_select(dim, local_indices(segments, tp, rank).to(full.device)).contiguous()


def unshard_tensor(shards: list[torch.Tensor], dim: int, segments: tuple[Segment, ...], tp: int) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: rebuild the full tensor from every rank's slice."""
    shape = list(shards[0].shape)
    shape[dim] = sum(s.size for s in segments)
    full = shards[0].new_empty(shape)
    for rank, shard in enumerate(shards):
        full.index_copy_(dim, local_indices(segments, tp, rank).to(full.device), shard)
    return full


@dataclass(frozen=True)
class VocabRows:
    """Vocab-parallel rows: rank r owns ids [r·per_rank, min(size, (r+1)·per_rank)) in ``local`` rows.

    ``per_rank = ceil(size / tp)``; rows past the owned ones are padding (the last rank's, and any
    rounding of ``local`` up to a multiple for fast GEMMs). The owned ranges are exactly torch.chunk's,
    so the logits a rank holds are its shard of a DTensor ``Shard(-1)`` of the unpadded vocabulary.

    ``classes``: the model crops its logits to the first ``classes`` of its ``size`` rows (a head padded to a
    multiple of 64, ``lm_head(x)[..., :vocab_size]``). The rows past it are real parameters, stored and
    stepped like the others; only the logits (:meth:`logits`) treat them as padding. None: every row is a class.
    """

    size: int
    per_rank: int
    local: int
    classes: int | None = None  # a default, so that plans written before it read back

    @classmethod
    def make(cls, size: int, tp: int, multiple: int = 1) -> VocabRows:
        if multiple < 1:
            raise ValueError(f"vocab padding multiple must be >= 1, got {multiple}")
        per_rank = -(-size // tp)
        return cls(size, per_rank, -(-per_rank // multiple) * multiple)

    def start(self, rank: int) -> int:
        return min(rank * self.per_rank, self.size)

    def owned(self, rank: int) -> int:
        return max(0, min(self.size, (rank + 1) * self.per_rank) - self.start(rank))

    def padded(self, tp: int) -> int:
        return self.local * tp

    def logits(self) -> VocabRows:
        """The rows of the logits' classes: the same rows per rank, with the cropped rows as padding.
        (size 128 cropped to 100 at tp 2: rank 0 owns classes [0, 64), rank 1 [64, 100) and 28 padding.)"""
        return self if self.classes is None else VocabRows(self.classes, self.per_rank, self.local)


def vocab_shard(full: torch.Tensor, dim: int, rows: VocabRows, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a vocab-parallel tensor, zero-padded to ``rows.local``."""
    owned = full.narrow(dim, rows.start(rank), rows.owned(rank))
    pad = list(full.shape)
    pad[dim] = rows.local - rows.owned(rank)
    return torch.cat([owned, full.new_zeros(pad)], dim=dim)


def vocab_unshard(shards: list[torch.Tensor], dim: int, rows: VocabRows) -> torch.Tensor:
    return torch.cat([s.narrow(dim, 0, rows.owned(r)) for r, s in enumerate(shards)], dim=dim)
