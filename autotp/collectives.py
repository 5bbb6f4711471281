"""Megatron's conjugate operators as autograd functions over torch's functional collectives.

``f`` (:class:`EnterTP`) sits on the input of a column-parallel matmul: identity forward, all-reduce of
dL/dX backward. ``g`` (:class:`LeaveTP`) sits on the output of a row-parallel matmul: all-reduce forward,
identity backward. Both are graph modules with a ``group`` bound at run time; unbound (no process group,
or a group of one) they are the identity, so passes can insert them without knowing the rank.
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


def bind_collectives(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    for m in module.modules():
        if isinstance(m, _Collective):
            m.bind(group)
