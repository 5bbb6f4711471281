"""Weights read in ways other than one ``nn.Linear`` / ``nn.Embedding`` each, as public model files write them,
in small LMs like tests/support/pattern_models.py's (width 64, 4 heads of 16, vocab 96, 2 layers). Every model
is ``(idx, targets) -> (logits, loss)``.

A stacked MLP: the gate and up projections are one ``(2, 64, 128)`` parameter.
- ``stacked_einsum``: ``h = einsum("bsd,kdf->kbsf", x, w)``, then ``silu(h[0]) * h[1]``;
- ``stacked_einsum_unbind``: ``einsum("bsd,kdf->bskf", x, w).unbind(-2)``;
- ``stacked_index``: ``silu(x @ w[0]) * (x @ w[1])``;
- ``stacked_index_linear``: a ``(2, 128, 64)`` weight read as ``F.linear(x, w[0])``, ``F.linear(x, w[1])``.

A token embedding that is a raw ``nn.Parameter`` E (96, 64), the head tied to it:
- ``index_param``: ``E[idx]``, head ``x @ E.T``;
- ``index_select``: ``E.index_select(0, idx.flatten()).view(b, s, 64)``, head ``F.linear(x, E)``.

A masked-LM-style head on the causal model, tied to the embedding and read after a dense layer and a norm:
- ``mlm_head``: ``F.linear(layer_norm(gelu(dense(x))), emb.weight, bias)`` (BERT's transform + tied decoder);
- ``mlm_decoder``: a decoder ``nn.Linear`` whose weight is the embedding's, after ``dense`` + RMSNorm.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, V, Attention, RMSNorm, SwiGLU
from tiny_lm import Residual, lm_build

F_ = 128  # the MLP's width
STACKED = ("stacked_einsum", "stacked_einsum_unbind", "stacked_index", "stacked_index_linear")
INDEXED = ("index_param", "index_select")
MLM = ("mlm_head", "mlm_decoder")
KINDS = (*STACKED, *INDEXED, *MLM)


class StackedMLP(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        shape = (2, F_, H) if kind == "stacked_index_linear" else (2, H, F_)
        self.w_in = nn.Parameter(torch.randn(shape) * H ** -0.5)
        self.down = nn.Linear(F_, H, bias=False)

    def forward(self, x):
        w = self.w_in
        if self.kind == "stacked_einsum":
            h = torch.einsum("bsd,kdf->kbsf", x, w)
            g, u = h[0], h[1]
        elif self.kind == "stacked_einsum_unbind":
            g, u = torch.einsum("bsd,kdf->bskf", x, w).unbind(-2)
        elif self.kind == "stacked_index":
            g, u = x @ w[0], x @ w[1]
        else:
            g, u = F.linear(x, w[0]), F.linear(x, w[1])
        return self.down(F.silu(g) * u)


def Block(kind: str) -> Residual:
    """Plain attention then the MLP (stacked weights, or a SwiGLU), each on a pre-norm residual branch."""
    return Residual(attn=lambda: Attention("plain"), mlp=lambda: StackedMLP(kind) if kind in STACKED else SwiGLU())


class LM(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        if kind in INDEXED:
            self.wte = nn.Parameter(torch.randn(V, H) * 0.02)
        else:
            self.emb = nn.Embedding(V, H)
            if kind in MLM:  # a table that is also the head, initialised as BERT's (std 0.02)
                nn.init.normal_(self.emb.weight, std=0.02)
        self.blocks = nn.ModuleList([Block(kind) for _ in range(2)])
        self.norm = RMSNorm(H)
        if kind in MLM:
            self.dense = nn.Linear(H, H)
            self.head_norm = nn.LayerNorm(H) if kind == "mlm_head" else RMSNorm(H)
            if kind == "mlm_head":
                self.bias = nn.Parameter(torch.zeros(V))
            else:
                self.decoder = nn.Linear(H, V)
                self.decoder.weight = self.emb.weight
        elif kind not in INDEXED:
            self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx, targets):
        if self.kind == "index_param":
            x = self.wte[idx]
        elif self.kind == "index_select":
            x = self.wte.index_select(0, idx.flatten()).view(*idx.shape, H)
        else:
            x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        if self.kind == "index_param":
            logits = x @ self.wte.T
        elif self.kind == "index_select":
            logits = F.linear(x, self.wte)
        elif self.kind == "mlm_head":
            logits = F.linear(self.head_norm(F.gelu(self.dense(x))), self.emb.weight, self.bias)
        elif self.kind == "mlm_decoder":
            logits = self.decoder(self.head_norm(F.gelu(self.dense(x))))
        else:
            logits = self.head(x)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(kind: str):
    return lm_build(lambda: LM(kind))
