"""Attention spellings from public single-device files that used to stay whole, in small LMs like
tests/support/pattern_models.py's (width 64, 4 query heads of 16, vocab 96, 2 layers, SwiGLU MLPs); every model
is ``(idx, targets) -> (logits, loss)``; tests/test_attention_gaps.py runs them.

- ``where_other``, ``where_self``: the causal mask applied by ``torch.where`` with a Python scalar,
  ``torch.where(mask, scores, -inf)`` (``where.ScalarOther``) and ``torch.where(~mask, finfo.min, scores)``
  (``where.ScalarSelf``);
- ``fold_from_q``, ``fold_from_counts``: grouped-query attention (2 kv heads) with the heads folded under the
  batch, ``(b·heads, s, d)``, the kv heads folded by a size computed at run time from another tensor's shape
  (``qf.shape[0] // n_rep``; ``q.size(0) * q.size(1) // (heads // kv_heads)``) and repeated by
  ``repeat_interleave`` over the folded dim.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from pattern_models import HD, NH, H, LMWith, build_with

NKV = 2  # kv heads of the grouped-query spellings


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


WHERE = ("where_other", "where_self")
FOLDS = ("fold_from_q", "fold_from_counts")
KINDS = (*WHERE, *FOLDS)


def _attention(kind: str) -> nn.Module:
    return WhereAttention(kind) if kind in WHERE else FoldedGQA(kind)


def build(kind: str):
    torch.manual_seed(0)
    return build_with(LMWith(kind, _attention))
