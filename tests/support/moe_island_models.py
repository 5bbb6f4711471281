"""Small GPTs whose mixture-of-experts layer is the reference data-dependent loop over ``nn.ModuleList``
experts, in the spellings public model files use: ``if mask.any()`` with ``torch.nonzero`` and
``index_add_`` (SwiGLU experts), ``torch.where(mask)`` with ``out[tok] += ...`` (SwiGLU experts), and a
boolean-mask selection skipped with ``continue`` whose layer also returns a load-balancing loss (GELU
``nn.Sequential`` experts). Every model is ``(idx, targets=None) -> (logits, loss)``: 2 blocks, width 32,
4 heads, 4 experts, top-2."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

V, H, NH, S, E, K, I = 64, 32, 4, 8, 4, 2, 48
HD = H // NH


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.style = style
        self.gate = nn.Linear(H, E, bias=False)
        if style == "bool_mask":
            self.experts = nn.ModuleList([nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(),
                                                        nn.Linear(4 * H, H, bias=False)) for _ in range(E)])
        else:
            self.experts = nn.ModuleList([SwiGLU() for _ in range(E)])

    def forward(self, x: torch.Tensor):
        b, s, h = x.shape
        x = x.view(-1, h)
        probs = self.gate(x).softmax(-1)  # (T, E)
        w, idx = probs.topk(K, dim=-1)  # (T, K)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        if self.style == "nonzero":  # the reference loop
            for i, expert in enumerate(self.experts):
                mask = idx == i
                if mask.any():
                    tok, slot = torch.nonzero(mask, as_tuple=True)
                    out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
            return out.view(b, s, h)
        if self.style == "where":
            for i in range(E):
                tok, slot = torch.where(idx == i)
                if tok.numel() == 0:
                    continue
                out[tok] += self.experts[i](x[tok]) * w[tok, slot].unsqueeze(-1)
            return out.view(b, s, h)
        for i, expert in enumerate(self.experts):  # a boolean mask over tokens, with a load-balancing loss
            sel = (idx == i).any(-1)  # (T,)
            if not sel.any():
                continue
            wi = (w * (idx == i)).sum(-1)[sel]
            out[sel] = out[sel] + expert(x[sel]) * wi[:, None]
        frac = F.one_hot(idx[:, 0], E).float().mean(0)
        aux = E * (frac * probs.mean(0)).sum()
        return out.view(b, s, h), aux


class Block(nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.moe = MoE(style)

    def forward(self, x: torch.Tensor):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, n, 3, NH, HD).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1) / math.sqrt(HD)).masked_fill(
            ~torch.ones(n, n, dtype=torch.bool, device=x.device).tril(), float("-inf"))
        x = x + self.proj((F.softmax(att, -1) @ v).transpose(1, 2).reshape(b, n, H))
        y = self.moe(self.n2(x))
        if isinstance(y, tuple):
            y, aux = y
            return x + y, aux
        return x + y, x.new_zeros(())


class GPT(nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList([Block(style) for _ in range(2)])
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.emb(idx)
        aux = 0.0
        for blk in self.blocks:
            x, a = blk(x)
            aux = aux + a
        logits = self.head(self.norm(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, V), targets.view(-1)) + 0.01 * aux


STYLES = ["nonzero", "where", "bool_mask"]


def build(style: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(style)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (2, S), generator=g)
    return model, (x, torch.randint(0, V, (2, S), generator=g))
