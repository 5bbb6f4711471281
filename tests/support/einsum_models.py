"""Attention written with einsum, as public GPT files write it (lucidrains' x-transformers and PaLM, minGPT
variants): small LMs like tests/support/pattern_models.py's (width 64, 4 heads of 16, seq 12, 2 layers); every model
is ``(idx, targets) -> (logits, loss)``. The head reshapes are spelled as einops' ``rearrange`` exports them
(views and permutes).

- ``named``: ``einsum('b h i d, b h j d -> b h i j', q, k)`` and ``einsum('b h i j, b h j d -> b h i d', attn, v)``;
- ``ellipsis``: ``'... i d, ... j d -> ... i j'`` and ``'... i j, ... j d -> ... i d'``;
- ``heads_after_seq``: q, k, v kept as (b, n, h, d): ``'bihd,bjhd->bhij'``, ``'bhij,bjhd->bihd'``;
- ``mqa``: one key/value head for all query heads (PaLM), its size-1 head dim dropped
  (``rearrange(kv, 'b n 1 d -> b n d')``): ``'bhid,bjd->bhij'``, ``'bhij,bjd->bhid'``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from pattern_models import HD, NH, H, LMWith, build_with

KINDS = ("named", "ellipsis", "heads_after_seq", "mqa")


class Attention(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.to_q = nn.Linear(H, H, bias=False)
        self.to_kv = nn.Linear(H, 2 * (HD if kind == "mqa" else H), bias=False)
        self.to_out = nn.Linear(H, H, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        q = self.to_q(x).view(b, n, NH, HD)  # rearrange(q, 'b n (h d) -> b n h d')
        k, v = self.to_kv(x).chunk(2, dim=-1)
        kind = self.kind
        if kind == "mqa":
            k, v = (t.view(b, n, 1, HD).squeeze(2) for t in (k, v))  # 'b n (1 d) -> b n 1 d -> b n d'
            q = q.permute(0, 2, 1, 3)  # 'b n h d -> b h n d'
            sim = torch.einsum("bhid,bjd->bhij", q, k) / math.sqrt(HD)
            attn = sim.masked_fill(~mask, float("-inf")).softmax(-1)
            out = torch.einsum("bhij,bjd->bhid", attn, v).permute(0, 2, 1, 3)
        elif kind == "heads_after_seq":
            k, v = (t.view(b, n, NH, HD) for t in (k, v))
            sim = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(HD)
            attn = sim.masked_fill(~mask, float("-inf")).softmax(-1)
            out = torch.einsum("bhij,bjhd->bihd", attn, v)
        else:
            k, v = (t.view(b, n, NH, HD) for t in (k, v))
            q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))  # 'b n h d -> b h n d'
            if kind == "named":
                sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) / math.sqrt(HD)
            else:
                sim = torch.einsum("... i d, ... j d -> ... i j", q, k) / math.sqrt(HD)
            attn = sim.masked_fill(~mask, float("-inf")).softmax(-1)
            out = torch.einsum("b h i j, b h j d -> b h i d" if kind == "named" else "... i j, ... j d -> ... i d",
                               attn, v).permute(0, 2, 1, 3)
        return self.to_out(out.reshape(b, n, H))  # 'b n h d -> b n (h d)'


def build(kind: str):
    torch.manual_seed(0)
    return build_with(LMWith(kind, Attention))
