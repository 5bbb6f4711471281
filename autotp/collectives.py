"""Megatron's conjugate operators as autograd functions over torch's functional collectives.

``f`` (:class:`EnterTP`) sits on the input of a column-parallel matmul: identity forward, all-reduce of
dL/dX backward. ``g`` (:class:`LeaveTP`) sits on the output of a row-parallel matmul: all-reduce forward,
identity backward. A statistic over a sharded dim (:class:`StatAllReduce`, :class:`ShardedNorm`) is
all-reduced both ways: its value is the sum of the ranks' parts, and its gradient, used by every rank's
slice, is the sum of theirs. All are graph modules with a ``group`` bound at run time; unbound (no process
group, or a group of one) they are the identity, so passes can insert them without knowing the rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup, op: str = "sum") -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x, op, group))


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.contiguous(), ctx.group), None


class _Leave(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _Stat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, scale: float) -> torch.Tensor:
        ctx.group, ctx.scale = group, scale
        return all_reduce(x.contiguous(), group) * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.contiguous(), ctx.group) * ctx.scale, None, None


class _Collective(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.group: dist.ProcessGroup | None = None

    def bind(self, group: dist.ProcessGroup | None) -> None:
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None


class EnterTP(_Collective):
    """f: identity forward, all-reduce (sum) backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else _Enter.apply(x, self.group)


class LeaveTP(_Collective):
    """g: all-reduce (sum) forward, identity backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else _Leave.apply(x, self.group)


class StatAllReduce(_Collective):
    """A partial statistic (each rank's mean or sum over its slice of a sharded dim), completed: ``scale``
    times the sum over ranks, forward and backward."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else _Stat.apply(x, self.group, self.scale)


class ShardedNorm(_Collective):
    """``rms_norm`` / ``layer_norm`` over the last ``ndim`` dims, one of them sharded: the local slice's
    moments, completed by one all-reduce of the b·s statistics (layer_norm: mean and mean of squares
    stacked in one), then the local slice normalised with the local weight and bias."""

    def __init__(self, kind: str, ndim: int, eps: float | None, scale: float) -> None:
        super().__init__()
        self.kind, self.ndim, self.eps, self.scale = kind, ndim, eps, scale

    def stat(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else _Stat.apply(x, self.group, self.scale)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        dims = tuple(range(-self.ndim, 0))
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        if self.kind == "rms_norm":
            y = x * torch.rsqrt(self.stat(x.pow(2).mean(dims, keepdim=True)) + eps)  # (b, s, 1)
        else:
            m = self.stat(torch.stack([x.mean(dims, keepdim=True), x.pow(2).mean(dims, keepdim=True)]))
            y = (x - m[0]) * torch.rsqrt(m[1] - m[0] * m[0] + eps)
        if weight is not None:
            y = y * weight
        return y if bias is None else y + bias


def bind_collectives(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    for m in module.modules():
        if isinstance(m, _Collective):
            m.bind(group)
