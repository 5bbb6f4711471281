"""Attention spellings from public single-device files that used to stay whole, in small LMs like
tests/support/pattern_models.py's (width 64, 4 query heads of 16, vocab 96, 2 layers, SwiGLU MLPs); every model
is ``(idx, targets) -> (logits, loss)``; tests/analysis/test_attention_gaps.py runs them.

- ``where_other``, ``where_self``: the causal mask applied by ``torch.where`` with a Python scalar,
  ``torch.where(mask, scores, -inf)`` (``where.ScalarOther``) and ``torch.where(~mask, finfo.min, scores)``
  (``where.ScalarSelf``);
- ``fold_from_q``, ``fold_from_counts``: grouped-query attention (2 kv heads) with the heads folded under the
  batch, ``(b·heads, s, d)``, the kv heads folded by a size computed at run time from another tensor's shape
  (``qf.shape[0] // n_rep``; ``q.size(0) * q.size(1) // (heads // kv_heads)``) and repeated by
  ``repeat_interleave`` over the folded dim;
- ``palm_swiglu``, ``mqa_slices``: a parallel block (attention and feed-forward side by side) whose one fused
  projection is ``q | k | v | ff`` with k and v a single shared head: lucidrains' PaLM (``split`` of unequal
  sizes, ff chunked into SwiGLU's halves, rotary by ``rotate_half`` on q and the one k head, scores by matmul)
  and Falcon-style offset slices with a GELU feed-forward and ``scaled_dot_product_attention``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import HD, NH, H, LMWith, build_with, rope_tables

NKV = 2  # kv heads of the grouped-query spellings
FF = 128  # the parallel blocks' feed-forward width


class WhereAttention(nn.Module):
    """q, k, v, o projections; the scores masked by ``torch.where`` with a Python scalar on one side."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, NH, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        att = q @ k.transpose(-2, -1) / math.sqrt(HD)  # (b, nh, s, s)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        if self.kind == "where_other":
            att = torch.where(mask, att, float("-inf"))
        else:
            att = torch.where(~mask, torch.finfo(att.dtype).min, att)
        return self.o((att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, H))


class FoldedGQA(nn.Module):
    """Grouped-query attention by batched matmuls over heads folded under the batch (GPT-2 / BLOOM style),
    the kv heads folded to a size computed at run time, then repeated to the query heads."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q = nn.Linear(H, NH * HD, bias=False)
        self.k, self.v = nn.Linear(H, NKV * HD, bias=False), nn.Linear(H, NKV * HD, bias=False)
        self.o = nn.Linear(H, H, bias=False)
        self.heads, self.kv_heads = NH, NKV
        self.n_rep = NH // NKV

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, HD).transpose(1, 2)
        k, v = (p(x).view(b, s, self.kv_heads, HD).transpose(1, 2) for p in (self.k, self.v))
        qf = q.reshape(b * self.heads, s, HD)
        if self.kind == "fold_from_q":  # q's folded size over the group: floordiv(4·b, 2) in the graph
            n = qf.shape[0] // self.n_rep
        else:  # from q's batch and head count: floordiv(b·4, 2)
            n = q.size(0) * q.size(1) // (self.heads // self.kv_heads)
        kf, vf = (t.reshape(n, s, HD).repeat_interleave(self.n_rep, dim=0) for t in (k, v))  # (b·heads, s, d)
        causal = torch.full((s, s), float("-inf"), device=x.device).triu(1)
        p = torch.softmax(torch.bmm(qf, kf.transpose(1, 2)) / math.sqrt(HD) + causal, -1)
        y = torch.bmm(p, vf).view(b, self.heads, s, HD)
        return self.o(y.transpose(1, 2).reshape(b, s, H))


class ParallelMQA(nn.Module):
    """A parallel block's one fused projection ``q | k | v | ff`` with k and v a single shared head
    (multi-query), attention and feed-forward side by side: lucidrains' PaLM (``split`` of unequal sizes, a
    SwiGLU whose two halves are ``chunk``-ed from ff, rotary on q and the one k head) and Falcon-style offset
    slices with a GELU feed-forward."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.ff = FF * (2 if kind == "palm_swiglu" else 1)
        self.fused = nn.Linear(H, NH * HD + 2 * HD + self.ff, bias=False)
        self.attn_out, self.ff_out = nn.Linear(H, H, bias=False), nn.Linear(FF, H, bias=False)
        cos, sin = rope_tables(HD)  # (s, HD / 2), each half rotated by rotate_half
        self.register_buffer("cos", torch.cat((cos, cos), -1), persistent=False)
        self.register_buffer("sin", torch.cat((sin, sin), -1), persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        f = self.fused(x)
        if self.kind == "palm_swiglu":
            q, k, v, ff = f.split((NH * HD, HD, HD, self.ff), dim=-1)
            a, gate = ff.chunk(2, dim=-1)
            ff = F.silu(gate) * a
            q = q.view(b, s, NH, HD).transpose(1, 2)  # (b, nh, s, d); k and v stay (b, s, d)
            cos, sin = self.cos[:s], self.sin[:s]
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            att = (q * HD ** -0.5) @ k.unsqueeze(1).transpose(-2, -1)  # (b, nh, s, s)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            y = att.masked_fill(mask, float("-inf")).softmax(-1) @ v.unsqueeze(1)
        else:
            q, k, v, ff = f[..., :NH * HD], f[..., NH * HD:NH * HD + HD], f[..., NH * HD + HD:NH * HD + 2 * HD], \
                f[..., NH * HD + 2 * HD:]
            ff = F.gelu(ff)
            q = q.view(b, s, NH, HD).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k[:, None], v[:, None], is_causal=True)
        return self.attn_out(y.transpose(1, 2).reshape(b, s, H)) + self.ff_out(ff)


def _rotate_half(t):
    t1, t2 = t.chunk(2, dim=-1)
    return torch.cat((-t2, t1), dim=-1)


WHERE = ("where_other", "where_self")
FOLDS = ("fold_from_q", "fold_from_counts")
PARALLEL = ("palm_swiglu", "mqa_slices")  # two rows of one fused column: their runs are extended ones
KINDS = (*WHERE, *FOLDS)


def _attention(kind: str) -> nn.Module:
    return WhereAttention(kind) if kind in WHERE else FoldedGQA(kind) if kind in FOLDS else ParallelMQA(kind)


def build(kind: str):
    torch.manual_seed(0)
    return build_with(LMWith(kind, _attention))
