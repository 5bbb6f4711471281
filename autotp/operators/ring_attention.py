"""Context parallelism's runtime pieces: ring attention and the load-balanced sequence chunks.

With context parallelism (cp) every rank of a cp group holds 1/cp of the sequence. Every op but attention
is per-token and runs on the local chunk unchanged; attention needs every key and value of the sequence,
so they travel around the group (ring attention, Liu et al. 2023), and each rank merges its partial
results by their log-sum-exp. Both directions are torch's own (``torch.distributed.tensor.experimental
._context_parallel``: ``_templated_ring_attention`` and its backward, the engine behind
``context_parallel``); what this module adds is the attention kernel torch's dispatcher has no handler
for, the CPU one (``_scaled_dot_product_flash_attention_for_cpu`` and its backward, exact in fp32), and
an autograd function around the pair.

Causal load balance (torch's ``_HeadTailLoadBalancer``): the sequence is cut into 2·cp chunks and rank r
holds chunks r and 2·cp−1−r, so every rank does the same share of a causal attention's work. The
positions a rank holds come from the same balancer (:func:`local_positions`), so rotary tables, learned
position embeddings and labels are indexed consistently with the ring's causal masking.

Communication per attention call and rank (torch's default rotation, one all-gather of K and V):
forward ``2·b·h_kv·s·d·(cp−1)/cp`` elements received; backward the same again, plus the K and V
gradients passed around the ring (``cp`` all-to-alls of ``2·b·h_kv·(s/cp)·d``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel import _attention as _cp
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

from autotp.operators.ring_op import ring_attention_backward, ring_attention_forward, ring_forward


def load_balanced() -> bool:
    """Whether torch's ring attention expects head-tail chunks (its ``enable_load_balance`` option)."""
    return _cp._cp_options.enable_load_balance


def local_positions(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global positions (``(s/cp,)``, int64) of the tokens rank ``rank`` of ``cp`` holds: chunks r and
    2·cp−1−r of 2·cp when load-balanced, else the r-th contiguous slice."""
    if seq_len % (2 * cp if load_balanced() else cp):
        raise ValueError(f"context parallelism at cp {cp} needs a sequence length divisible by "
                         f"{2 * cp if load_balanced() else cp}; got {seq_len}")
    if not load_balanced():
        per = seq_len // cp
        return torch.arange(rank * per, (rank + 1) * per, device=device)
    order = _HeadTailLoadBalancer(seq_len, cp, device)._generate_indices().view(cp, -1)  # (cp, s/cp)
    return order[rank].long()


def shard_sequence(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """The part of ``x`` (whole along ``dim``, the sequence) that rank ``rank`` of ``cp`` holds."""
    return x.index_select(dim, local_positions(x.size(dim), cp, rank, x.device))


def unshard_sequence(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole tensor from every rank's part (``parts[r]`` from rank r), in sequence order."""
    return in_sequence_order(torch.cat(parts, dim=dim), dim, len(parts))


def in_sequence_order(joined: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """Every rank's part joined along ``dim`` in rank order (an all-gather's result) → sequence order."""
    order = torch.cat([local_positions(joined.size(dim), cp, r, joined.device) for r in range(cp)])
    return joined.index_select(dim, torch.argsort(order))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, is_causal, scale):
        out, lse = ring_attention_forward(q, k, v, group, is_causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.is_causal, ctx.scale = group, is_causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, ctx.group, ctx.is_causal, ctx.scale)
        return dq, dk, dv, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, *,
                   is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, is_causal=..., scale=...)`` of the whole sequence, for this
    rank's chunk of queries: q, k, v ``(b, h, s/cp, d)`` are this rank's chunks (:func:`shard_sequence`
    along dim 2); returns ``(b, h, s/cp, d)``. k and v may have fewer heads than q (GQA, MQA, as
    ``enable_gqa``): the CPU kernel reads them as they are, so only their own heads travel; on an
    accelerator they are repeated to q's heads first."""
    if q.size(1) % k.size(1) or k.shape != v.shape:
        raise ValueError(f"ring attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: the "
                         "query heads must be a multiple of the kv heads, and k and v alike")
    if q.size(1) != k.size(1) and q.device.type != "cpu":
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)  # (b, h, s/cp, d)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    if torch.compiler.is_compiling():  # one opaque op of the compiled graph (autotp/operators/ring_op.py)
        return ring_forward(q, k, v, group.group_name, is_causal, scale)[0]
    return _RingAttention.apply(q, k, v, group, is_causal, scale)
