"""Ring attention as one opaque op for ``torch.compile``: ``torch.ops.autotp.ring_attention`` and its backward.

Dynamo cannot trace torch's ring (``_templated_ring_attention``: a process group held in Python, the ring's
own options switched around the call, the kernels' results merged in a loop over ranks), and a graph break
around every attention cuts a compiled layer in two. As a custom op with a fake implementation and an
autograd formula the ring is one node of the compiled graph, forward and backward: dynamo and Inductor see
its shapes, never its inside, and run it as the eager code does (:func:`autotp.operators.ring_attention.ring_attention`
calls these under a compiler only; eager, the autograd Function runs, and a dispatch mode counting collectives
sees the ring's own).

The group travels by name (a custom op takes no ProcessGroup); shapes, per call and rank:
q ``(b, h, s/cp, d)``, k and v ``(b, h_kv, s/cp, d)`` → out ``(b, h, s/cp, d)`` laid out ``(b, s/cp, h, d)`` in
memory (as SDPA's result) and the log-sum-exp ``(b, h, s/cp)`` in fp32, kept for the backward.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor.experimental._context_parallel import _attention as _cp

aten = torch.ops.aten

SEQ_DIM = 2  # q, k, v are (b, h, s, d), as scaled_dot_product_attention takes them


def _kernels(q: torch.Tensor):
    if q.device.type == "cpu":
        return (aten._scaled_dot_product_flash_attention_for_cpu.default,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    if q.dtype in (torch.float16, torch.bfloat16):
        return aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_backward.default
    raise NotImplementedError(f"ring attention on {q.device.type} in {q.dtype}: only CPU (any dtype) and "
                              "fp16/bf16 accelerators (flash attention) have a kernel here")


@contextlib.contextmanager
def _balance(is_causal: bool):
    """torch's ring refuses load balancing without a causal mask; attention without one is the same for any
    order of the keys, so the head-tail chunks need no balancing there: the option is off for the call."""
    saved = _cp._cp_options.enable_load_balance
    _cp._cp_options.enable_load_balance = saved and is_causal
    try:
        yield
    finally:
        _cp._cp_options.enable_load_balance = saved


def ring_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                           is_causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's ring forward: (out ``(b, h, s/cp, d)`` laid out as SDPA lays out its result, ``(b, s/cp, h, d)``
    in memory, and the log-sum-exp ``(b, h, s/cp)`` its backward reads)."""
    fwd, _ = _kernels(q)
    with _balance(is_causal):
        out, lse, *_ = _cp._templated_ring_attention(group, SEQ_DIM, fwd, q, k, v, is_causal=is_causal,
                                                     dropout_p=0.0, scale=scale)
    # the model's ``y.transpose(1, 2).contiguous()`` then copies nothing, and this one tensor is both what
    # backward keeps and the output projection's input
    return out.transpose(1, 2).contiguous().transpose(1, 2), lse


def ring_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup, is_causal: bool,
                            scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's ring backward: (dq, dk, dv) of this rank's chunk."""
    _, bwd = _kernels(q)
    with _balance(is_causal):
        dq, dk, dv, *_ = _cp._templated_ring_attention_backward(
            group, SEQ_DIM, bwd, dout.contiguous(), "grad_out", q, k, v, out, lse, is_causal,
            dropout_p=0.0, scale=scale)
    return dq, dk, dv


def _sdpa_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` (b, h, s, d) laid out (b, s, h, d) in memory, as SDPA lays out its result."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@torch.library.custom_op("autotp::ring_attention", mutates_args=())
def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str, is_causal: bool,
                 scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = ring_attention_forward(q, k, v, _resolve_process_group(group), is_causal, scale)
    return out, lse.contiguous()


@ring_forward.register_fake
def _(q, k, v, group, is_causal, scale):
    b, h, s, _ = q.shape
    return _sdpa_layout(torch.empty_like(q)), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("autotp::ring_attention_backward", mutates_args=())
def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, group: str, is_causal: bool,
                  scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = ring_attention_backward(dout, q, k, v, out, lse, _resolve_process_group(group), is_causal, scale)
    # fresh tensors: the ring may hand back views of its own buffers (dk, dv), which a custom op must not return
    return tuple(g.clone(memory_format=torch.contiguous_format) for g in grads)


@ring_backward.register_fake
def _(dout, q, k, v, out, lse, group, is_causal, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        torch.empty_like(k, memory_format=torch.contiguous_format), \
        torch.empty_like(v, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output) -> None:
    q, k, v, group, is_causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.group, ctx.is_causal, ctx.scale = group, is_causal, scale


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.group, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None, None


ring_forward.register_autograd(_backward, setup_context=_setup)
