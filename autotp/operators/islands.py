"""An island's call at run time: the user's block run eagerly on this rank's slices (:mod:`autotp.plan.islands`).

The graph's ``autotp::island`` node becomes a call of :class:`IslandCall`, which runs the block's own forward
on the node's flat inputs. With its experts cut, every rank runs the same routing on the same tokens and each
expert gives this rank's partial sum; then:

* each output that is the experts' sum is all-reduced once (forward; backward identity): Megatron's g;
* each output independent of them (a load-balancing loss) is every rank's already; backward passes 1/tp of
  its gradient to each rank, so the sums below count it once;
* backward, the gradients of the block's inputs and of its whole parameters (the router) are all-reduced
  together, flattened into one bucket (one per dtype): Megatron's f, one all-reduce for the block, as
  Megatron has one for each column→row pair's input (the router's gradient rides along with the input's;
  Megatron sums a replicated weight's partial gradients after the backward, here they are ready together).

Exact: summed over the ranks, each rank's gradient of the block is the block's own (its outputs are the sums
of each rank's). An island left whole runs the block unchanged on every rank, with no collective.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.utils.stateless import _reparametrize_module

from autotp.operators.collectives import all_reduce

__all__ = ["IslandCall"]


class _Sum(torch.autograd.Function):
    """All-reduce forward (out of place: the block may have saved its output), identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _EnterAll(torch.autograd.Function):
    """Megatron's f on every tensor entering the island (its inputs, the parameters it keeps whole): identity
    forward; backward their gradients summed over the group in one all-reduce per dtype, flattened together
    (autograd calls this once, when the block's backward has made all of them). A tensor whose gradient is
    None (unused) takes zeros in the bucket, so every rank's bucket is the same size, and gets None back."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.metas = [(x.shape, x.dtype, x.device) for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        out: list[torch.Tensor | None] = [None] * len(grads)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (_, dtype, _) in enumerate(ctx.metas):
            by_dtype.setdefault(dtype, []).append(i)
        for dtype, idx in by_dtype.items():
            parts = [grads[i].reshape(-1) if grads[i] is not None else
                     torch.zeros(ctx.metas[i][0].numel(), dtype=dtype, device=ctx.metas[i][2]) for i in idx]
            summed = all_reduce(torch.cat(parts), ctx.group)  # (Σ numel,): one bucket
            for i, piece in zip(idx, summed.split([p.numel() for p in parts])):
                if grads[i] is not None:
                    out[i] = piece.view(ctx.metas[i][0])
        return (None, *out)


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
        own = dict(block.named_parameters())
        # inside an FSDP unit the block holds FSDP's DTensors (gathered over dp, this rank's TP shards): it
        # runs on their local tensors, as the graph's pieces do (autotp.operators.pieces)
        params = {n: p.to_local() if isinstance(p, DTensor) else p for n, p in own.items()}
        swapped = {n: t for n, t in params.items() if t is not own[n]}
        if group is not None and torch.is_grad_enabled():
            # f on the inputs (each rank's gradient of them is its experts' share) and on the router's (and any
            # whole) parameters, in one all-reduce backward
            entering = [i for i, t in enumerate(flat) if t.requires_grad]
            names = [n for n in self.whole if n in params and params[n].requires_grad]
            if entering or names:
                made = _EnterAll.apply(group, *(flat[i] for i in entering), *(params[n] for n in names))
                flat = list(flat)
                for i, t in zip(entering, made):
                    flat[i] = t
                swapped.update(zip(names, made[len(entering):]))
        swap = _reparametrize_module(block, swapped) if swapped else contextlib.nullcontext()
        with swap:
            tensors = self.__dict__["run"](list(flat))
        if group is None:
            return tensors
        return [_Sum.apply(t, group) if kind == "sum" else
                _Share.apply(t, self.tp) if t.requires_grad else t for t, kind in zip(tensors, self.outputs)]
