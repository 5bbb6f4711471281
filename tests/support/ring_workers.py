"""Rank functions for tests/runtime/test_ring_attention.py: ring attention against one device's SDPA."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ranks import CollectiveLog

from autotp.operators.ring_attention import ring_attention, shard_sequence, unshard_sequence

# (b, h_q, h_kv, s, d, is_causal, scale)
CASES = {
    "causal": (2, 4, 4, 32, 8, True, None),
    "full": (2, 4, 4, 32, 8, False, None),
    "gqa causal scaled": (1, 4, 2, 16, 8, True, 0.3),
    "mqa causal": (2, 4, 1, 16, 4, True, None),
}


def ring_case(name: str) -> dict:
    """Every rank holds its head-tail chunks of q, k, v; the ring's output and the gradients of q, k and v
    against the whole sequence's SDPA on one device (same seed on every rank), and the collectives."""
    b, hq, hkv, s, d, causal, scale = CASES[name]
    cp, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    torch.manual_seed(0)
    q = torch.randn(b, hq, s, d, requires_grad=True)
    k, v = (torch.randn(b, hkv, s, d, requires_grad=True) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=hq != hkv)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    local = [shard_sequence(t.detach(), 2, cp, rank).requires_grad_() for t in (q, k, v)]
    with CollectiveLog() as log:
        out = ring_attention(*local, group, is_causal=causal, scale=scale)
        forward = list(log.calls)
        out.backward(shard_sequence(grad, 2, cp, rank))
    # the whole output, put back in sequence order from every rank's part
    parts = [torch.empty_like(out) for _ in range(cp)]
    dist.all_gather(parts, out.detach().contiguous())
    errors = {"whole out": (unshard_sequence(parts, 2) - ref).abs().max().item(),
              "out": (out - shard_sequence(ref.detach(), 2, cp, rank)).abs().max().item()}
    for key, mine, full in zip(("dq", "dk", "dv"), local, (q, k, v)):
        errors[key] = (mine.grad - shard_sequence(full.grad, 2, cp, rank)).abs().max().item()
    return {"errors": errors, "forward": forward, "backward": log.calls[len(forward):]}


def ring_cases() -> dict[str, dict]:
    """Every case of :data:`CASES` in one launch."""
    return {name: ring_case(name) for name in CASES}
