"""Context parallelism's graph operators: each is an ``nn.Module`` the pass inserts unbound and the runtime
binds to the cp group (:meth:`bind`), as :mod:`autotp.operators.collectives`' are.

- :class:`ShardSequence`: a whole input ``(b, s, ..)`` → this rank's head-tail chunk ``(b, s/cp, ..)``;
- :class:`LocalPositions`: ``arange(s/cp)`` (what the graph computes from the local length) → the global
  positions of this rank's tokens;
- :class:`RingSDPA`: ``scaled_dot_product_attention`` → ring attention over the group;
- :class:`TokenMeanLoss`: a cross-entropy's mean over local tokens → the mean over every counted token of
  the group (ignore_index respected): the local sum and count all-reduced;
- :class:`GatherSequence`: a chunked output → the whole one, in sequence order (backward: this rank's part).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autotp.operators.collectives import _Collective, _Leave, all_reduce
from autotp.operators.ring_attention import local_positions, ring_attention, unshard_sequence


class _ContextOp(_Collective):
    def _cp_rank(self) -> tuple[int, int]:
        return dist.get_world_size(self.group), dist.get_rank(self.group)


class ShardSequence(_ContextOp):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return x
        cp, rank = self._cp_rank()
        return x.index_select(self.dim, local_positions(x.size(self.dim), cp, rank, x.device))


class LocalPositions(_ContextOp):
    def forward(self, positions: torch.Tensor) -> torch.Tensor:  # arange(start, start + s/cp)
        if self.group is None:
            return positions
        cp, rank = self._cp_rank()
        start = positions[:1]  # (1,): the arange's start, kept as a tensor (no host read)
        return start + local_positions(positions.numel() * cp, cp, rank, positions.device).to(positions.dtype)


class RingSDPA(_ContextOp):
    def __init__(self, is_causal: bool, scale: float | None) -> None:
        super().__init__()
        self.is_causal, self.scale = is_causal, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal, scale=self.scale,
                                                  enable_gqa=q.size(1) != k.size(1))
        out = ring_attention(q, k, v, self.group, is_causal=self.is_causal, scale=self.scale)  # (b, h, s/cp, d)
        # laid out as SDPA lays out its result, (b, s, h, d) in memory: the graph may view its transpose
        return out.transpose(1, 2).contiguous().transpose(1, 2)


class TokenMeanLoss(_ContextOp):
    """``cross_entropy(logits, targets, ignore_index=..., reduction="mean")`` (unweighted) over the group's
    tokens."""

    def __init__(self, ignore_index: int, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        kw = dict(ignore_index=self.ignore_index, label_smoothing=self.label_smoothing)
        if self.group is None:
            return F.cross_entropy(logits, targets, **kw)
        total = F.cross_entropy(logits, targets, reduction="sum", **kw)  # () over this rank's tokens
        count = (targets != self.ignore_index).sum().to(total.dtype)
        # L = Σ_r S_r / Σ_r N_r: each rank's dL/dS_r is 1/N, so the sum is all-reduced forward only
        return _Leave.apply(total, self.group) / all_reduce(count, self.group)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return unshard_sequence(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.index_select(ctx.dim, local_positions(grad.size(ctx.dim), cp, rank, grad.device)), None, None


class GatherSequence(_ContextOp):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else _Gather.apply(x, self.dim, self.group)
