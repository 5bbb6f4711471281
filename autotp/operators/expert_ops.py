"""Runtime operators of expert parallelism (see :mod:`autotp.analysis.experts`).

Rank r of a group of t holds experts ``[r·n, (r+1)·n)`` of every expert parameter (``n = E/t``, its local
dim 0). Each operator reads the routing the graph computed (an expert index, per-slot ids, or a grouped GEMM's
offsets), which is the same on every rank, and gives what this rank's experts contribute: their values where
they are this rank's, zeros (and no work) where they live on another. Unbound (no group, or a group of one)
each is the operation it replaces.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autotp.operators.collectives import _Collective


class _Experts(_Collective):
    def owned(self, n: int) -> tuple[int, int]:
        """This rank's experts: ``[start, start + n)``."""
        return (0, n) if self.group is None else (dist.get_rank(self.group) * n, n)

    def local(self, expert: int, n: int) -> int | None:
        """Where ``expert`` is in this rank's block of ``n``; None when it is another rank's."""
        start, _ = self.owned(n)
        return expert - start if start <= expert < start + n else None


class ExpertSelect(_Experts):
    """``W[e]`` of this rank's block ``W``: the expert, or a zero-strided zero matrix of its shape (no memory)
    where expert ``e`` lives on another rank."""

    def __init__(self, expert: int) -> None:
        super().__init__()
        self.expert = expert

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        at = self.local(self.expert, w.shape[0])
        return w[at] if at is not None else w.new_zeros(()).expand(w.shape[1:])


class ExpertRows(_Experts):
    """The rows expert ``e`` computes on: all of ``x``, or none where it lives on another rank."""

    def __init__(self, expert: int, count: int) -> None:
        super().__init__()
        self.expert, self.count = expert, count

    def mine(self) -> bool:
        tp = 1 if self.group is None else dist.get_world_size(self.group)
        return self.local(self.expert, self.count // tp) is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.mine() else x[:0]


class ExpertOut(ExpertRows):
    """Expert ``e``'s output ``y``, or zeros with ``rows``' row count where it ran on no rows."""

    def forward(self, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return y if self.mine() else y.new_zeros((rows.shape[0], *y.shape[1:]))


class ExpertIndex(_Experts):
    """``W[ids]``: this rank's experts' rows, zeros for the slots routed to another rank's."""

    def forward(self, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        start, n = self.owned(w.shape[0])
        if self.group is None:
            return w[ids]
        local = ids - start
        mine = (local >= 0) & (local < n)
        picked = w[local.clamp(0, n - 1)]
        return torch.where(mine.view(*mine.shape, *[1] * (w.dim() - 1)), picked, picked.new_zeros(()))


class ExpertGrouped(_Experts):
    """A grouped GEMM ``(x [S, K] sorted by expert, W [E, K, N], offs [E] cumulative row ends) -> [S, N]``
    over this rank's experts: their rows multiplied by their weights, the other rows zeros."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *rest, **kwargs) -> torch.Tensor:
        if self.group is None:
            return self.op(x, w, offs, *rest, **kwargs)
        start, n = self.owned(w.shape[0])
        ends = offs[start:start + n]
        first = int(offs[start - 1]) if start else 0  # this rank's experts' rows are [first, last)
        last = int(ends[-1])
        y = self.op(x[first:last], w, ends - first, *rest, **kwargs)
        return F.pad(y, (0, 0, first, x.shape[0] - last))
