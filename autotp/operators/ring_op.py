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

import torch
from torch.distributed.distributed_c10d import _resolve_process_group


def _sdpa_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` (b, h, s, d) laid out (b, s, h, d) in memory, as SDPA lays out its result."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@torch.library.custom_op("autotp::ring_attention", mutates_args=())
def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str, is_causal: bool,
                 scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    from autotp.operators.ring_attention import ring_attention_forward

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
    from autotp.operators.ring_attention import ring_attention_backward

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
