"""An island's call at run time: the user's block run eagerly on this rank's slices (:mod:`autotp.plan.islands`).

The graph's ``autotp::island`` node becomes a call of :class:`IslandCall`, which runs the block's own forward
on the node's flat inputs. With its experts cut, every rank runs the same routing on the same tokens and each
expert gives this rank's partial sum; then:

* each output that is the experts' sum is all-reduced once (forward; backward identity): Megatron's g;
* each output independent of them (a load-balancing loss) is every rank's already; backward passes 1/tp of
  its gradient to each rank, so the sums below count it once;
* backward, the gradients of the block's inputs and of its whole parameters (the router) are all-reduced:
  Megatron's f, one all-reduce per input and per whole parameter.

Exact: summed over the ranks, each rank's gradient of the block is the block's own (its outputs are the sums
of each rank's). An island left whole runs the block unchanged on every rank, with no collective.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module

from autotp.operators.collectives import _Enter, all_reduce

__all__ = ["IslandCall"]


class _Sum(torch.autograd.Function):
    """All-reduce forward (out of place: the block may have saved its output), identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _Share(torch.autograd.Function):
    """Identity forward; backward each rank takes 1/tp of the gradient (the f sums after count it once)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: int) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad / ctx.tp, None


class IslandCall(nn.Module):
    """The call of ``block`` (held, not registered: its parameters stay the model's). ``run``: the block called
    on the node's flat inputs, its flat outputs; ``outputs``: per flat output "sum" or "same" (empty: the
    block runs whole); ``whole``: its parameters held whole, by name inside it."""

    def __init__(self, block: nn.Module, run: Callable[[list[torch.Tensor]], list[torch.Tensor]],
                 outputs: tuple[str, ...], whole: tuple[str, ...]) -> None:
        super().__init__()
        self.__dict__["block"] = block
        self.__dict__["run"] = run
        self.outputs, self.whole = outputs, whole
        self.group: dist.ProcessGroup | None = None
        self.tp = 1

    def bind(self, group: dist.ProcessGroup | None) -> None:
        tp = dist.get_world_size(group) if group is not None else 1
        self.group, self.tp = (group, tp) if tp > 1 and self.outputs else (None, 1)

    def forward(self, *flat: torch.Tensor) -> list[torch.Tensor]:
        block, group = self.__dict__["block"], self.group
        if group is not None:  # f: each rank's gradient of the inputs is its experts' share
            flat = tuple(_Enter.apply(t, group) if t.requires_grad else t for t in flat)
        swap = contextlib.nullcontext()
        if group is not None and torch.is_grad_enabled():  # f on the router's (and any whole) parameters
            own = dict(block.named_parameters())
            swap = _reparametrize_module(block, {n: _Enter.apply(own[n], group) for n in self.whole if n in own})
        with swap:
            tensors = self.__dict__["run"](list(flat))
        if group is None:
            return tensors
        return [_Sum.apply(t, group) if kind == "sum" else
                _Share.apply(t, self.tp) if t.requires_grad else t for t, kind in zip(tensors, self.outputs)]
