"""Megatron's sequence-parallel operators as autograd functions over c10d (eager) and torch's functional
collectives (under ``torch.compile``).

With sequence parallelism the code between column→row pairs (norms, dropout, residual adds) holds each
rank's ``s/t`` slice of the sequence:

- :class:`ReduceScatterSeq` replaces ``g`` after a row-parallel matmul (and after a vocab-parallel
  embedding): reduce-scatter along the sequence forward, all-gather of the gradient backward;
- :class:`AllGatherSeq` replaces ``f`` before column-parallel matmuls: all-gather forward, reduce-scatter
  of the (partial) input gradient backward. :class:`SeqColumnGroup` is it fused with the column matmuls:
  only the local slice is kept for backward and gathered again there, overlapped with the input
  gradient's GEMM, whose reduce-scatter then overlaps the weight gradients (Megatron's scheme);
- :class:`GatherSeq` hands a sequence-sharded value to an op that needs the whole sequence (replicated
  from there on): all-gather forward, this rank's slice of the (replicated) gradient backward;
- :class:`SliceSeq` is the converse, a replicated value (position embeddings) meeting sequence-sharded
  ones: this rank's slice forward, all-gather of the gradient backward;
- :class:`SumGrads`: parameters applied to sequence slices (norm weights, row biases) get each rank's
  partial gradient; one all-reduce of all of them, flattened together, sums them.

The sequence dim of a ``(b, s, h)`` activation is rarely dim 0, where c10d's reduce-scatter and all-gather
cut: it is moved first (a copy unless the dims before it have size 1, e.g. b = 1) and back.
Unbound (no group, or a group of one) every operator is the identity.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from autotp.operators.amp import amp_bwd, amp_fwd, matmul_input
from autotp.operators.collectives import (_Collective, _column, all_reduce, column_input_grad, column_param_grads,
                                         finish)
from autotp.errors import ShardingError

# torch >= 2.10 names them *_single; older releases only have the *_tensor spellings
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _check(x: torch.Tensor, dim: int, tp: int) -> None:
    if x.shape[dim] % tp:
        raise ShardingError(f"sequence parallelism: a sequence of {x.shape[dim]} (dim {dim} of a "
                            f"{tuple(x.shape)} activation) is not divisible by tp={tp}",
                            hint=f"use sequence lengths divisible by {tp}, or sequence_parallel=False")


def gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup, async_op: bool = False):
    """All-gather of ``x`` along ``dim``: (.., s/t, ..) -> (.., s, ..). With ``async_op``: (result, work),
    the result valid after ``finish(work, ...)``."""
    tp = dist.get_world_size(group)
    if torch.compiler.is_compiling():
        return funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), dim, group))
    lead = x.movedim(dim, 0).contiguous()  # (s/t, ..): c10d gathers along dim 0
    out = lead.new_empty((lead.shape[0] * tp, *lead.shape[1:]))
    work = _all_gather(out, lead, group=group, async_op=True)
    full = out.movedim(0, dim)
    if async_op:
        return full, work
    finish(work, out, group)
    return full


def reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup, async_op: bool = False):
    """Sum over ranks, this rank's slice along ``dim``: (.., s, ..) -> (.., s/t, ..). With ``async_op``:
    (result, work), the result valid after ``work.wait()`` (gloo's reduce-scatter work reports completion
    only from ``wait()``: it cannot be polled)."""
    tp = dist.get_world_size(group)
    _check(x, dim, tp)
    if torch.compiler.is_compiling():
        return funcol.wait_tensor(funcol.reduce_scatter_tensor(x.contiguous(), "sum", dim, group))
    lead = x.movedim(dim, 0).contiguous()  # (s, ..)
    out = lead.new_empty((lead.shape[0] // tp, *lead.shape[1:]))
    work = _reduce_scatter(out, lead, group=group, async_op=async_op)
    local = out.movedim(0, dim)
    return (local, work) if async_op else local


def local_slice(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (no communication)."""
    tp = dist.get_world_size(group)
    _check(x, dim, tp)
    n = x.shape[dim] // tp
    return x.narrow(dim, dist.get_rank(group) * n, n)


def _conjugate(name: str, forward_op: Callable[..., torch.Tensor], backward_op: Callable[..., torch.Tensor],
               contiguous_grad: bool = True) -> type[torch.autograd.Function]:
    """An autograd Function ``(x, dim, group)`` that runs the collective ``forward_op(x, dim, group)`` and, on
    the gradient, its conjugate ``backward_op(grad, dim, group)``, both along ``dim``. Outputs are made
    contiguous (the gradient too unless ``contiguous_grad`` is off: it is then handed on as the collective
    leaves it)."""

    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return forward_op(x, dim, group).contiguous()

    def backward(ctx, grad: torch.Tensor):
        out = backward_op(grad, ctx.dim, ctx.group)
        return (out.contiguous() if contiguous_grad else out), None, None

    # built by Function's metaclass under ``name``, so that autograd's node is ``{name}Backward``
    return type(torch.autograd.Function)(name, (torch.autograd.Function,), {
        "forward": staticmethod(amp_fwd(forward)), "backward": staticmethod(amp_bwd(backward)),
        "__module__": __name__, "__qualname__": name})


_ReduceScatter = _conjugate("_ReduceScatter", reduce_scatter, gather, contiguous_grad=False)
_AllGather = _conjugate("_AllGather", gather, reduce_scatter)
# everything after the gather is replicated: its gradient is whole on every rank, so backward takes this rank's slice
_Gather = _conjugate("_Gather", gather, local_slice)
_Slice = _conjugate("_Slice", local_slice, gather)


class _SeqOp(_Collective):
    fn: type[torch.autograd.Function]

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else self.fn.apply(x, self.dim, self.group)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class ReduceScatterSeq(_SeqOp):
    """g with sequence parallelism: reduce-scatter along the sequence forward, all-gather backward."""

    fn = _ReduceScatter


class AllGatherSeq(_SeqOp):
    """f with sequence parallelism: all-gather along the sequence forward, reduce-scatter backward."""

    fn = _AllGather


class GatherSeq(_SeqOp):
    """A sequence-sharded value for an op that needs the whole sequence: all-gather forward, this rank's
    slice of the replicated gradient backward."""

    fn = _Gather


class SliceSeq(_SeqOp):
    """A replicated value meeting sequence-sharded ones: this rank's slice forward, all-gather backward."""

    fn = _Slice


class _SeqColumns(torch.autograd.Function):
    """All-gather of the local input slice fused with the column matmuls that read it.

    Forward keeps only the local slice (b, s/t, h) for backward. Backward gathers it again while dX = Σ dYᵢ·Wᵢ
    is computed, then reduce-scatters dX while the weight gradients are computed (Megatron's overlap)."""

    @staticmethod
    @amp_fwd(cast="low")
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int, flatten: bool, orientations: tuple[str, ...],
                *wb: torch.Tensor):
        ws, bs = wb[0::2], wb[1::2]
        ctx.group, ctx.dim, ctx.flatten, ctx.orientations = group, dim, flatten, orientations
        ctx.bias = [b is not None for b in bs]
        ctx.save_for_backward(x, *ws)
        full = gather(x, dim, group)  # (b, s, h)
        xin = full.reshape(-1, full.shape[-1]) if flatten else full  # (b·s, h) when the columns read it flat
        return tuple(_column(xin, w, b, o) for w, b, o in zip(ws, bs, orientations))

    @staticmethod
    @amp_bwd
    def backward(ctx, *grads: torch.Tensor):
        x, *ws = ctx.saved_tensors
        full, gathering = gather(x, ctx.dim, ctx.group, async_op=True)
        dx = column_input_grad(grads, ws, ctx.orientations) if ctx.needs_input_grad[0] else None
        finish(gathering, full, ctx.group)
        local = work = None
        if dx is not None:
            shape = list(x.shape)
            shape[ctx.dim] *= dist.get_world_size(ctx.group)
            local, work = reduce_scatter(dx.reshape(shape), ctx.dim, ctx.group, async_op=True)
        out = column_param_grads(full, grads, ctx.orientations, ctx.bias, ctx.needs_input_grad[5:])
        if work is not None:
            work.wait()
            local = local.contiguous()
        return (local, None, None, None, None, *out)


class SeqColumnGroup(_Collective):
    """The all-gather before column matmuls fused with them: ``(x, W₀, b₀, W₁, b₁, ..) -> (y₀, y₁, ..)``
    with x this rank's sequence slice. ``flatten``: the columns read the gathered input as (b·s, h) (GPT-2's
    Conv1D). Under torch.compile: the all-gather then the matmuls, for Inductor to schedule."""

    def __init__(self, orientations: tuple[str, ...], dim: int, flatten: bool) -> None:
        super().__init__()
        self.orientations, self.dim, self.flatten = tuple(orientations), dim, flatten

    def forward(self, x: torch.Tensor, *wb: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        if self.group is not None and not torch.compiler.is_compiling():
            return _SeqColumns.apply(x, self.group, self.dim, self.flatten, self.orientations, *wb)
        if self.group is not None:
            x = _AllGather.apply(matmul_input(x), self.dim, self.group)
        if self.flatten:
            x = x.reshape(-1, x.shape[-1])
        return tuple(_column(x, w, b, o) for w, b, o in zip(wb[0::2], wb[1::2], self.orientations))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, flatten={self.flatten}"


class _SumGrads(torch.autograd.Function):
    @staticmethod
    @amp_fwd
    def forward(ctx, group: dist.ProcessGroup, *xs: torch.Tensor):
        ctx.group = group
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    @amp_bwd
    def backward(ctx, *grads: torch.Tensor):
        out: list[torch.Tensor | None] = [None] * len(grads)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads):
            if ctx.needs_input_grad[1 + i]:
                by_dtype.setdefault(g.dtype, []).append(i)
        for idx in by_dtype.values():  # one all-reduce per dtype (one in all for a model in one dtype)
            flat = all_reduce(torch.cat([grads[i].reshape(-1) for i in idx]), ctx.group)
            for i, part in zip(idx, flat.split([grads[i].numel() for i in idx])):
                out[i] = part.view_as(grads[i])
        return (None, *out)


class SumGrads(_Collective):
    """Parameters applied to sequence slices: identity forward; backward, their partial gradients summed over
    the group by one all-reduce of them all, flattened together (Megatron's all-reduce of sequence-parallel
    parameters' gradients)."""

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # with gradients off (evaluation, sampling) there is nothing to sum, and nothing for dynamo to trace
        if self.group is None or not torch.is_grad_enabled():
            return xs
        return _SumGrads.apply(self.group, *xs)
