"""LM heads tied to the token embedding by a matmul with its weight, no head module at all, in the spellings
public GPT files use. Small LMs like tests/support/pattern_models.py's (width 64, 4 heads of 16, seq 12, 2 layers);
every model is ``(idx, targets) -> (logits, loss)``.

- ``t_method``: ``x @ self.tok_emb.weight.t()``;
- ``T_property``: ``x @ self.tok_emb.weight.T`` (exports as ``numpy_T``);
- ``einsum``: ``torch.einsum('bnd,vd->bnv', x, self.tok_emb.weight)``;
- ``linear``: ``F.linear(x, self.tok_emb.weight)``;
- ``matmul_transpose``: ``torch.matmul(x, self.tok_emb.weight.transpose(0, 1))``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, S, Block, RMSNorm
from tiny_lm import lm_build

V = 96
KINDS = ("t_method", "T_property", "einsum", "linear", "matmul_transpose")


class TiedLM(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.tok_emb = nn.Embedding(V, H)
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        self.blocks = nn.ModuleList(Block("plain") for _ in range(2))
        self.norm = RMSNorm(H)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        x = self.tok_emb(idx)
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        w = self.tok_emb.weight  # (V, h)
        if self.kind == "t_method":
            logits = x @ w.t()
        elif self.kind == "T_property":
            logits = x @ w.T
        elif self.kind == "einsum":
            logits = torch.einsum("bnd,vd->bnv", x, w)
        elif self.kind == "linear":
            logits = F.linear(x, w)
        else:
            logits = torch.matmul(x, w.transpose(0, 1))
        return logits, F.cross_entropy(logits.view(-1, V), targets.view(-1))


def build(kind: str):
    return lm_build(lambda: TiedLM(kind), s=S, vocab=V)
