"""Context parallelism's graph operators: each is an ``nn.Module`` the pass inserts unbound and the runtime
binds to the cp group (:meth:`bind`), as :mod:`autotp.operators.collectives`' are.

- :class:`ShardSequence`: a whole input ``(b, s, ..)`` → this rank's head-tail chunk ``(b, s/cp, ..)``;
- :class:`LocalPositions`: ``arange(s/cp)`` (what the graph computes from the local length) → the global
  positions of this rank's tokens;
- :class:`PositionRows`: ``table[:s]`` (a rotary table read up to the length) → the rows of this rank's positions;
- :class:`RingSDPA`: ``scaled_dot_product_attention`` → ring attention over the group;
- :class:`GatherKeys`: a written-out attention's keys or values (the chunk's) → the whole sequence's, in
  sequence order (backward: the gradients summed over the group, each rank's part: a reduce-scatter);
- :class:`TokenMean`: a cross-entropy summed over local tokens → the mean over every counted token of the
  group (ignore_index respected): the local sum and count all-reduced;
- :class:`GatherSequence`: a chunked output → the whole one, in sequence order, gathered when first read
  (backward: this rank's part);
- :class:`ContextGrads`: the parameters as the graph reads them; backward, their gradients (each rank's covers
  its own tokens) summed over the group by one all-reduce of them all, flattened together.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autotp.operators.collectives import _Collective, _Leave, all_reduce
from autotp.operators.gathered import GatherOutput, gathered_on_use
from autotp.operators.ring_attention import in_sequence_order, local_positions, ring_attention, unshard_sequence
from autotp.operators.seq_ops import _AllGather, _SumGrads


class _ContextOp(_Collective):
    axis = "cp"

    def _cp_rank(self) -> tuple[int, int]:
        return dist.get_world_size(self.group), dist.get_rank(self.group)


class _ChunkOf(_ContextOp):
    """An op computing this rank's part of a value from that value alone (no communication, no random stream):
    a pipeline stage that reads its result computes it again from the graph's inputs rather than receive it
    (:func:`autotp.plan.pieces.recomputable` reads ``recomputable``)."""

    recomputable = True


class _AlongSequence(_ContextOp):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim  # the sequence's

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class ShardSequence(_AlongSequence, _ChunkOf):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return x
        cp, rank = self._cp_rank()
        return x.index_select(self.dim, local_positions(x.size(self.dim), cp, rank, x.device))


class LocalPositions(_ChunkOf):
    def forward(self, positions: torch.Tensor) -> torch.Tensor:  # arange(start, start + s/cp)
        if self.group is None:
            return positions
        cp, rank = self._cp_rank()
        start = positions[:1]  # (1,): the arange's start, kept as a tensor (no host read)
        return start + local_positions(positions.numel() * cp, cp, rank, positions.device).to(positions.dtype)


class PositionRows(_AlongSequence, _ChunkOf):
    """``table[:s]`` along ``dim`` (a rotary or position table read up to the length) → the rows of this
    rank's positions: ``length`` is the chunk's, s/cp."""

    def forward(self, table: torch.Tensor, length: int) -> torch.Tensor:
        if self.group is None:
            return table.narrow(self.dim, 0, length)
        cp, rank = self._cp_rank()
        return table.index_select(self.dim, local_positions(length * cp, cp, rank, table.device))


class RingSDPA(_ContextOp):
    def __init__(self, is_causal: bool, scale: float | None) -> None:
        super().__init__()
        self.is_causal, self.scale = is_causal, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal, scale=self.scale,
                                                  enable_gqa=q.size(1) != k.size(1))
        # (b, h, s/cp, d), laid out (b, s/cp, h, d) in memory as SDPA's result: the graph may view its transpose
        return ring_attention(q, k, v, self.group, is_causal=self.is_causal, scale=self.scale)


class GatherKeys(_AlongSequence):
    """Keys (``kᵀ`` as the scores' matmul reads it) or values of this rank's chunk along ``dim`` → the whole
    sequence's, in sequence order: an all-gather over the group (backward: the gradient of the whole summed
    over the group, this rank's part), then the head-tail chunks put back in place. Every rank then
    computes its query rows' scores over every key, exactly as one device does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return x
        dim = self.dim % x.dim()
        full = _AllGather.apply(x, dim, self.group)  # (.., s, ..): rank 0's chunk, then rank 1's, ...
        return in_sequence_order(full, dim, dist.get_world_size(self.group))


class TokenMean(_ContextOp):
    """A loss summed over this rank's tokens → the mean over every counted token of the group (targets equal
    to ``ignore_index`` not counted), as one device's ``reduction="mean"`` gives it."""

    def __init__(self, ignore_index: int) -> None:
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, total: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        count = (targets != self.ignore_index).sum().to(total.dtype)
        if self.group is None:
            return total / count
        # L = Σ_r S_r / Σ_r N_r: each rank's dL/dS_r is 1/N, so the sum is all-reduced forward only
        return _Leave.apply(total, self.group) / all_reduce(count, self.group)


class GatherSequence(GatherOutput):
    """A graph output carrying the sequence, handed back whole (in sequence order) and gathered over the cp
    group only when something reads it, as vocab-parallel logits are (:mod:`autotp.operators.gathered`):
    a step that only calls ``loss.backward()`` moves none of the (b, s, V) logits. Backward: the gradient of
    the whole tensor, the same on every rank, gives each rank its own tokens'."""

    axis = "cp"

    def __init__(self, dim: int) -> None:
        super().__init__(dim, 0, unshard=None, reslice=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return x
        cp, rank, dim = dist.get_world_size(self.group), self.rank, self.dim
        shape = list(x.shape)
        shape[dim] *= cp
        return gathered_on_use(x, torch.Size(shape), self.group, lambda parts: unshard_sequence(parts, dim),
                               lambda grad: grad.index_select(dim, local_positions(grad.size(dim), cp, rank,
                                                                                   grad.device)))


class ContextGrads(_ContextOp):
    def forward(self, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # with gradients off (evaluation, sampling) there is nothing to sum
        if self.group is None or not torch.is_grad_enabled():
            return params
        return _SumGrads.apply(self.group, *params)
