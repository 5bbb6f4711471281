"""Grouped-query attention whose kv heads are repeated head-minor, in small LMs like
tests/support/pattern_models.py's (width 64, vocab 96, 2 layers, SwiGLU MLPs): 8 query heads of 8 and 4 kv
heads, each kv head repeated *after* the others (``k.repeat(1, 1, n_rep, 1)``, ``torch.cat([k] * n_rep)``,
``k[:, None].expand(b, n_rep, n_kv, s, d)``), so query head ``h`` reads kv head ``h % n_kv`` rather than
``h // n_rep`` (Hugging Face's ``repeat_kv``). Every model is ``(idx, targets) -> (logits, loss)``;
tests/analysis/test_strided_gqa.py runs them.

- ``minor_repeat``: rotary applied in a helper library's ``(b, s, heads, d)`` layout (flash-attn's
  ``apply_rotary_emb`` takes it so), the kv heads tiled by ``repeat`` in that layout, then
  ``scaled_dot_product_attention``;
- ``minor_expand``: ``(b, heads, s, d)``, the kv heads expanded under a new leading repeat dim and merged,
  scores by matmul and a causal mask;
- ``minor_cat``: ``torch.cat([k] * n_rep, dim=1)`` of ``(b, kv heads, s, d)``, rotary by ``rotate_half``;
- ``minor_tile``: another helper library's layout, flash-attn's ``apply_rotary_emb(..., interleaved=True)``
  on ``(b, s, heads, d)``: rotary on interleaved pairs (``t[..., ::2]``, ``t[..., 1::2]``, ``stack`` and
  ``flatten``), the kv heads tiled by ``torch.tile`` in that layout, the scores and output by ``einsum`` over
  ``(b, s, heads, d)`` with a causal ``masked_fill``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, LMWith, build_with, rope_tables

NQ, NKV, HD = 8, 4, 8  # query heads, kv heads, head dim
N_REP = NQ // NKV


def _rotate_half(t):
    t1, t2 = t.chunk(2, dim=-1)
    return torch.cat((-t2, t1), dim=-1)


class MinorGQA(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q, self.o = nn.Linear(H, NQ * HD, bias=False), nn.Linear(NQ * HD, H, bias=False)
        self.k, self.v = nn.Linear(H, NKV * HD, bias=False), nn.Linear(H, NKV * HD, bias=False)
        cos, sin = rope_tables(HD)  # (s, d / 2)
        self.register_buffer("cos", torch.cat((cos, cos), -1), persistent=False)
        self.register_buffer("sin", torch.cat((sin, sin), -1), persistent=False)
        self.register_buffer("cos_pairs", cos, persistent=False)  # one angle per interleaved pair
        self.register_buffer("sin_pairs", sin, persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, NQ, HD)
        k, v = self.k(x).view(b, s, NKV, HD), self.v(x).view(b, s, NKV, HD)
        if self.kind == "minor_repeat":  # (b, s, heads, d): the tables broadcast over the heads
            cos, sin = self.cos[:s, None], self.sin[:s, None]
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            k, v = k.repeat(1, 1, N_REP, 1), v.repeat(1, 1, N_REP, 1)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
            return self.o(y.transpose(1, 2).reshape(b, s, NQ * HD))
        if self.kind == "minor_tile":  # (b, s, heads, d) throughout
            q, k = _rotate_pairs(q, self.cos_pairs[:s], self.sin_pairs[:s]), \
                _rotate_pairs(k, self.cos_pairs[:s], self.sin_pairs[:s])
            k, v = torch.tile(k, (1, 1, N_REP, 1)), torch.tile(v, (1, 1, N_REP, 1))  # head h reads kv head h % n_kv
            att = torch.einsum("bqhd,bkhd->bhqk", q, k) * HD ** -0.5
            future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            y = torch.einsum("bhqk,bkhd->bqhd", att.masked_fill(future, float("-inf")).softmax(-1), v)
            return self.o(y.reshape(b, s, NQ * HD))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, heads, s, d)
        cos, sin = self.cos[:s], self.sin[:s]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if self.kind == "minor_expand":
            k, v = (t[:, None].expand(b, N_REP, NKV, s, HD).reshape(b, NQ, s, HD) for t in (k, v))
        else:  # minor_cat
            k, v = torch.cat([k] * N_REP, dim=1), torch.cat([v] * N_REP, dim=1)
        att = q @ k.transpose(-2, -1) / math.sqrt(HD)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, s, NQ * HD))


def _rotate_pairs(t, cos, sin):
    """Rotary on interleaved pairs ``(t[2i], t[2i+1])`` of ``t (b, s, heads, d)``; ``cos``, ``sin`` ``(s, d / 2)``."""
    cos, sin = cos[:, None], sin[:, None]  # over the heads
    even, odd = t[..., ::2], t[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


KINDS = ("minor_repeat", "minor_expand", "minor_cat", "minor_tile")


def build(kind: str):
    torch.manual_seed(0)
    return build_with(LMWith(kind, MinorGQA))
