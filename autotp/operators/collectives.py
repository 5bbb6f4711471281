"""Megatron's conjugate operators as autograd functions over torch's functional collectives.

``f`` (:class:`EnterTP`) sits on the input of a column-parallel matmul: identity forward, all-reduce of
dL/dX backward. ``g`` (:class:`LeaveTP`) sits on the output of a row-parallel matmul: all-reduce forward,
identity backward. A statistic over a sharded dim (:class:`StatAllReduce`, :class:`ShardedNorm`) is
all-reduced both ways: its value is the sum of the ranks' parts, and its gradient, used by every rank's
slice, is the sum of theirs. All are graph modules with a ``group`` bound at run time; unbound (no process
group, or a group of one) they are the identity, so passes can insert them without knowing the rank.
"""
from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn
import torch.nn.functional as F

from autotp.operators.amp import amp_bwd, amp_fwd, matmul_input


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


_yield = getattr(os, "sched_yield", lambda: None)
# how long a collective's wait is polled before it sleeps: long enough for every collective of peers in step,
# with more ranks than cores too (8 ranks on 2 cores: a peer may get its core only after several 4 ms ticks);
# 5 ms doubled the 8-rank every-dimension command's time (138 s against 71 s polled 100 ms or without end)
SPIN_S = 0.1


def finish(work: dist.Work | None, x: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Wait for an eager c10d collective on ``x``. On CPU (gloo) the caller polls, yielding its core between
    polls, instead of sleeping until gloo's worker thread wakes it: on a loaded machine that wake-up waits
    for the scheduler (0.5 ms on average, up to a 4 ms tick, per ``perf sched`` on 2 cores), longer than
    a 512 KiB all-reduce itself. On an accelerator ``wait()`` only orders streams and returns at once.
    For all-reduces and all-gathers only: gloo's reduce-scatter work completes inside ``wait()``. Only gloo's
    work is polled: another backend's (torch's fake one) may report completion only once waited on.

    The polling stops after :data:`SPIN_S`: a peer that is still capturing, loading or compiling (seconds)
    is waited for asleep. Polled that long, with more ranks than cores, the waiting rank took the core its
    peer needed: a two-node job on one 2-core host stalled past a minute about one run in ten."""
    if work is None:
        return
    if x.device.type == "cpu" and dist.get_backend(group) == "gloo":
        until = time.perf_counter() + SPIN_S
        while not work.is_completed() and time.perf_counter() < until:
            _yield()
    work.wait()


def _sync(x: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
    finish(dist.all_reduce(x, op=op, group=group, async_op=True), x, group)


def define_ops() -> None:
    """Define ``torch.ops.autotp.all_reduce`` (once per process, before anything is compiled): the all-reduce
    a compiled graph runs on CPU. Inductor keeps it whole, one polled c10d all-reduce (:func:`finish`); the
    functional collective's ``wait_tensor`` would sleep until gloo wakes it (measured on 2 cores: the
    compiled step 7-12 ms slower with sleeping waits, more than its reordering gains there)."""
    if hasattr(torch.ops.autotp, "all_reduce"):
        return

    @torch.library.custom_op("autotp::all_reduce", mutates_args=())
    def _polled(x: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
        return all_reduce(x, c10d._resolve_process_group(group_name), op)  # runs eagerly: the polled path

    @_polled.register_fake
    def _(x: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)


def _traced_all_reduce(x: torch.Tensor, group: dist.ProcessGroup, op: str) -> torch.Tensor:
    if x.device.type == "cpu":
        return torch.ops.autotp.all_reduce(x, op, group.group_name)
    return funcol.wait_tensor(funcol.all_reduce(x, op, group))


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup, op: str = "sum") -> torch.Tensor:
    """``op`` of ``x`` over ``group``, as a new tensor (:func:`all_reduce_each` of one)."""
    return all_reduce_each([(x, op)], group)[0]


def all_reduce_each(xs: list[tuple[torch.Tensor, str]], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Independent all-reduces ``(x, op)`` as new tensors. Eager: plain c10d all-reduces in place on copies,
    with none of the functional collective's wrapping per call, in flight together (gloo runs them on its
    worker threads at once, so the caller waits about one latency instead of one per tensor; each is still
    its own collective). Under torch.compile, one by one: the functional collective (Inductor schedules
    it), or on CPU ``torch.ops.autotp.all_reduce`` (:func:`define_ops`)."""
    if torch.compiler.is_compiling():
        return [_traced_all_reduce(x, group, op) for x, op in xs]
    outs = [x.clone(memory_format=torch.contiguous_format) for x, _ in xs]
    works = [dist.all_reduce(out, op=_OPS[op], group=group, async_op=True) for out, (_, op) in zip(outs, xs)]
    for work, out in zip(works, outs):
        finish(work, out, group)
    return outs


class _Enter(torch.autograd.Function):
    @staticmethod
    @amp_fwd
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    @amp_bwd
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.contiguous(), ctx.group), None


class _Leave(torch.autograd.Function):
    @staticmethod
    @amp_fwd
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        if torch.compiler.is_compiling() or not x.is_contiguous():
            return all_reduce(x, group)
        # the row matmul's output, read by nothing else and saved by no backward: summed where it lies
        ctx.mark_dirty(x)
        _sync(x, group)
        return x

    @staticmethod
    @amp_bwd
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _Stat(torch.autograd.Function):
    @staticmethod
    @amp_fwd
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, scale: float) -> torch.Tensor:
        ctx.group, ctx.scale = group, scale
        return all_reduce(x.contiguous(), group) * scale

    @staticmethod
    @amp_bwd
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.contiguous(), ctx.group) * ctx.scale, None, None


class _Collective(nn.Module):
    axis = "tp"  # the group it is bound to: the tensor-parallel one (context parallelism's: "cp")

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


def _column(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, orientation: str) -> torch.Tensor:
    """One column matmul as the graph wrote it: ``linear`` for W stored [out, in], ``addmm``/``matmul`` for
    W stored [in, out] (GPT-2's Conv1D)."""
    if orientation == "out_in":
        return F.linear(x, w, b)
    return torch.addmm(b, x, w) if b is not None else torch.matmul(x, w)


def column_input_grad(grads, ws, orientations: tuple[str, ...]) -> torch.Tensor:
    """dX = Σ dYᵢ·Wᵢ over the column matmuls that read X (those whose output took a gradient)."""
    dx = None
    for g, w, o in zip(grads, ws, orientations):
        if g is None:
            continue
        part = g @ (w if o == "out_in" else w.t())  # (.., out) @ (out, in)
        dx = part if dx is None else dx.add_(part)
    return dx


def column_param_grads(x: torch.Tensor, grads, orientations: tuple[str, ...], bias: list[bool],
                       needs: tuple[bool, ...]) -> list[torch.Tensor | None]:
    """(dWᵢ, dbᵢ) of each column matmul, flat; ``needs``: needs_input_grad of (W₀, b₀, W₁, b₁, ..)."""
    x2 = x.reshape(-1, x.shape[-1])  # (b·s, in)
    out: list[torch.Tensor | None] = []
    for i, (g, o) in enumerate(zip(grads, orientations)):
        if g is None:  # an output no gradient reached: its weight gets none, as unfused it would
            out += [None, None]
            continue
        g2 = g.reshape(-1, g.shape[-1])  # (b·s, out)
        out.append((g2.t() @ x2 if o == "out_in" else x2.t() @ g2) if needs[2 * i] else None)
        out.append(g2.sum(0) if bias[i] and needs[2 * i + 1] else None)
    return out


class _Columns(torch.autograd.Function):
    """f fused with the column matmuls that read ``x``. Backward: dX = Σ dYᵢ·Wᵢ is all-reduced
    asynchronously while the weight gradients are computed, then waited for (Megatron's overlap of the
    input-gradient all-reduce with the weight-gradient GEMMs)."""

    @staticmethod
    @amp_fwd(cast="low")
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, orientations: tuple[str, ...], *wb: torch.Tensor):
        ws, bs = wb[0::2], wb[1::2]
        ctx.group, ctx.orientations, ctx.bias = group, orientations, [b is not None for b in bs]
        # an output no gradient reaches stays None in backward (DeepSeek-V4's pooled keys, whose projection a
        # sequence shorter than one window reads only for its dtype): its weight's gradient is None, not zeros
        # that an optimizer would step on
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, *ws)
        return tuple(_column(x, w, b, o) for w, b, o in zip(ws, bs, orientations))

    @staticmethod
    @amp_bwd
    def backward(ctx, *grads: torch.Tensor):
        x, *ws = ctx.saved_tensors
        dx = work = None
        if ctx.needs_input_grad[0] and any(g is not None for g in grads):
            dx = column_input_grad(grads, ws, ctx.orientations)
            work = dist.all_reduce(dx, group=ctx.group, async_op=True)
        out = column_param_grads(x, grads, ctx.orientations, ctx.bias, ctx.needs_input_grad[3:])
        finish(work, dx, ctx.group)
        return (dx, None, None, *out)


class ColumnGroup(EnterTP):
    """f and the column matmuls that share its input, as one module: ``(x, W₀, b₀, W₁, b₁, ..) -> (y₀, y₁,
    ..)``. Eager, the input gradient's all-reduce overlaps the weight gradients; under torch.compile it
    is f then the matmuls, for Inductor to schedule."""

    def __init__(self, orientations: tuple[str, ...]) -> None:
        super().__init__()
        self.orientations = tuple(orientations)

    def forward(self, x: torch.Tensor, *wb: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        if self.group is not None and not torch.compiler.is_compiling():
            return _Columns.apply(x, self.group, self.orientations, *wb)
        if self.group is not None:
            x = _Enter.apply(matmul_input(x), self.group)
        return tuple(_column(x, w, b, o) for w, b, o in zip(wb[0::2], wb[1::2], self.orientations))


class StatAllReduce(_Collective):
    """A partial statistic (each rank's mean or sum over its slice of a sharded dim), completed: ``scale``
    times the sum over ranks, forward and backward."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else _Stat.apply(x, self.group, self.scale)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Statistics of a half-precision tensor are computed in float32 (as the fused norm kernels accumulate,
    and as autocast runs norms on CUDA)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class ShardedNorm(_Collective):
    """``rms_norm`` / ``layer_norm`` over the last ``ndim`` dims, one of them sharded: the local slice's
    moments, completed by one all-reduce of the b·s statistics (layer_norm: mean and mean of squares
    stacked in one), then the local slice normalised with the local weight and bias. ``dtype``: the
    output's, as the replaced op gave it (under autocast, its policy's), else the input's."""

    def __init__(self, kind: str, ndim: int, eps: float | None, scale: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.kind, self.ndim, self.eps, self.scale, self.dtype = kind, ndim, eps, scale, dtype

    def stat(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else _Stat.apply(x, self.group, self.scale)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        dims = tuple(range(-self.ndim, 0))
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        out, x = self.dtype or x.dtype, _wide(x)
        if self.kind == "rms_norm":
            y = x * torch.rsqrt(self.stat(x.pow(2).mean(dims, keepdim=True)) + eps)  # (b, s, 1)
        else:
            m = self.stat(torch.stack([x.mean(dims, keepdim=True), x.pow(2).mean(dims, keepdim=True)]))
            y = (x - m[0]) * torch.rsqrt(m[1] - m[0] * m[0] + eps)
        if weight is not None:
            y = y * weight
        return (y if bias is None else y + bias).to(out)


class ShardedReduction(_Collective):
    """A reduction over dims one of which is sharded, completed by one all-reduce of the ranks' partial sums:
    ``var`` / ``std`` (sums of x and x² stacked, 2·b·s elements; the count of reduced elements is the
    local one times the ranks each block is split over) or a p-norm (the sum of |x|^p). ``scale`` multiplies
    the sum over ranks so that blocks held by several ranks count once."""

    def __init__(self, kind: str, dims: list[int] | None, keepdim: bool, param: float, scale: float,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.kind, self.dims, self.keepdim, self.param, self.scale = kind, dims, keepdim, param, scale
        self.dtype = dtype  # the output's, as the replaced op gave it

    def stat(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else _Stat.apply(x, self.group, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = tuple(range(x.dim())) if self.dims is None else tuple(self.dims)
        out, x = self.dtype or x.dtype, _wide(x)
        if self.kind == "norm":
            p = self.param
            total = self.stat((x * x if p == 2 else x.abs().pow(p)).sum(dims, keepdim=self.keepdim))
            return (total.sqrt() if p == 2 else total.pow(1.0 / p)).to(out)
        sums = self.stat(torch.stack([x.sum(dims, keepdim=self.keepdim), (x * x).sum(dims, keepdim=self.keepdim)]))
        n = math.prod(x.shape[d] for d in dims)
        if self.group is not None:
            n = round(n * dist.get_world_size(self.group) * self.scale)
        mean = sums[0] / n
        var = (sums[1] / n - mean * mean) * (n / (n - self.param))  # (b, s): E[x²] - E[x]², corrected
        return (var.sqrt() if self.kind == "std" else var).to(out)


def bind_collectives(module: nn.Module, group: dist.ProcessGroup | None, axis: str = "tp") -> None:
    """Bind every collective of ``module`` over ``axis`` ("tp", or "cp" for context parallelism) to ``group``."""
    for m in module.modules():
        if isinstance(m, _Collective) and m.axis == axis:
            m.bind(group)
