"""Attention that passes ops autotp's own table does not list, which torch's DTensor rules place: small LMs
like tests/support/pattern_models.py's (width 64, 4 heads of 16, seq 12, 2 layers); every model is
``(idx, targets) -> (logits, loss)``. Each op works along the sequence or key dim of per-head tensors
``(b, h, n, d)``, so it stays local when the heads are sharded.

- ``cumsum_fn`` / ``cumsum_method``: a running mean of the values added to the output (``torch.cumsum(v,
  dim=-2)`` / ``v.cumsum(2)``): aten.cumsum;
- ``roll_shift`` / ``pad_shift``: keys shifted by one position (``torch.roll(k, 1, dims=2)`` / RWKV's token
  shift ``F.pad(k, (0, 0, 1, -1))``): aten.roll, aten.constant_pad_nd;
- ``topk_scatter``: top-k sparse attention, the kept scores scattered into a ``full_like`` of -inf:
  aten.topk, aten.scatter, aten.full_like;
- ``sort_median``: the scores centred on each row's median, found by sorting: aten.sort.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import HD, NH, H, LMWith, build_with

KINDS = ("cumsum_fn", "cumsum_method", "roll_shift", "pad_shift", "topk_scatter", "sort_median")


class Attention(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.proj = nn.Linear(H, H, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split(H, dim=-1)
        q, k, v = (t.view(b, n, NH, HD).transpose(1, 2) for t in (q, k, v))  # (b, h, n, d)
        kind = self.kind
        if kind == "roll_shift":
            k = torch.roll(k, shifts=1, dims=2)
        elif kind == "pad_shift":
            k = F.pad(k, (0, 0, 1, -1))  # one position later along n, zeros in front
        scores = q @ k.transpose(-2, -1) / math.sqrt(HD)  # (b, h, n, n)
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        if kind == "sort_median":
            scores = scores - scores.sort(dim=-1).values[..., n // 2: n // 2 + 1]
        scores = scores.masked_fill(~mask, float("-inf"))
        if kind == "topk_scatter":
            top, at = scores.topk(4, dim=-1)
            scores = torch.full_like(scores, float("-inf")).scatter(-1, at, top)
        y = scores.softmax(-1) @ v  # (b, h, n, d)
        if kind == "cumsum_fn":
            counts = torch.arange(1, n + 1, device=x.device, dtype=x.dtype).view(n, 1)
            y = y + torch.cumsum(v, dim=-2) / counts
        elif kind == "cumsum_method":
            y = y + v.cumsum(2) / n
        return self.proj(y.transpose(1, 2).reshape(b, n, H))


def build(kind: str):
    torch.manual_seed(0)
    return build_with(LMWith(kind, Attention))
