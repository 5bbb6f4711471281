"""Causal attention written out in the spellings of public model code, for context parallelism: the mask as a
buffer sliced to the length (GPT-2), made by ``torch.where`` or added as a very negative bias (Hugging Face's
eager attention), scores by einsum, rotary tables read up to the length; and spellings that must not run on a
chunk (probabilities returned too, a table read from an offset). Scores no ring computes — a sliding-window
mask, a symmetric ALiBi bias of distances, tanh soft-capping with a ``where`` mask — run with the keys
gathered (:mod:`autotp.analysis.keyed_attention`)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

V, H, NH, HD, S, L = 64, 32, 4, 8, 16, 32  # vocab, width, heads, head dim, sequence, longest sequence

RUNS = ("buffer_mask", "where_mask", "additive_min", "einsum_rope", "bool_sdpa_mask")
# scores a ring cannot compute: keys and values gathered
KEYED = ("window", "alibi_abs", "softcap_where", "shared_window", "sdpa_window")
NAMED = {"probs_out": "also read outside the attention", "offset_table": "not a table's first rows"}


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # t: (b, h, s, d)
    a, b = t[..., : HD // 2], t[..., HD // 2:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.qkv, self.o = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.register_buffer("bias", torch.tril(torch.ones(L, L)).view(1, 1, L, L))
        inv = 1.0 / (10000 ** (torch.arange(0, HD // 2).float() / (HD // 2)))
        angles = torch.outer(torch.arange(L + 1).float(), inv)  # (L + 1, d/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, NH, HD).transpose(1, 2) for t in self.qkv(x).split(H, dim=-1))  # (b, h, s, d)
        if self.kind in ("einsum_rope", "offset_table"):
            start = 1 if self.kind == "offset_table" else 0
            cos, sin = self.cos[start:start + s], self.sin[start:start + s]  # (s, d/2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if self.kind == "bool_sdpa_mask":  # a boolean mask made from positions, passed to SDPA
            pos = torch.arange(s, device=x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=pos[:, None] >= pos[None, :])
            return self.o(y.transpose(1, 2).reshape(b, s, H))
        if self.kind == "sdpa_window":  # Mistral's sliding window as SDPA's additive mask
            pos = torch.arange(s, device=x.device)
            near = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < 4)
            bias = torch.zeros(s, s, device=x.device).masked_fill(~near, float("-inf"))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            return self.o(y.transpose(1, 2).reshape(b, s, H))
        if self.kind == "einsum_rope":
            att = torch.einsum("bhid,bhjd->bhij", q, k) * HD ** -0.5
        else:
            att = q @ k.transpose(-2, -1) / math.sqrt(HD)
        tril = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        if self.kind == "buffer_mask":
            att = att.masked_fill(self.bias[:, :, :s, :s] == 0, float("-inf"))
        elif self.kind == "where_mask":
            att = torch.where(tril, att, torch.tensor(float("-inf"), device=x.device))
        elif self.kind == "additive_min":
            att = att + (~tril).to(att.dtype)[None, None] * torch.finfo(att.dtype).min
        elif self.kind == "window":  # each position sees the 4 before it: not causal attention
            att = att.masked_fill(~(tril & ~torch.ones_like(tril).tril(-4)), float("-inf"))
        elif self.kind == "alibi_abs":  # a bias of -|i - j| per head (the slopes a Python list), then causal
            i = torch.arange(s, device=x.device)
            dist = (i.view(-1, 1) - i.view(1, -1)).abs().float()  # (s, s)
            slopes = torch.tensor([2.0 ** -(h + 1) for h in range(NH)], device=x.device).view(1, NH, 1, 1)
            att = (att - slopes * dist).masked_fill(~tril, float("-inf"))
        elif self.kind == "softcap_where":  # Gemma-2's capping, spelled with methods, masked by where
            att = att.div(30.0).tanh().mul(30.0)
            att = torch.where(tril, att, torch.full_like(att, float("-inf")))
        else:
            att = att.masked_fill(~tril, float("-inf"))
        p = F.softmax(att, dim=-1)
        y = torch.einsum("bhij,bhjd->bhid", p, v) if self.kind == "einsum_rope" else p @ v
        out = self.o(y.transpose(1, 2).reshape(b, s, H))
        return (out, p) if self.kind == "probs_out" else out


class LM(nn.Module):
    def __init__(self, kind: str, dropout: float = 0.0):
        super().__init__()
        # dropout on the embeddings and the residual branches (GPT-2's embd_pdrop / resid_pdrop)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.emb = nn.Embedding(V, H)
        self.attn = nn.ModuleList([Attention(kind) for _ in range(2)])
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx, targets):
        x = self.drop(self.emb(idx))
        for a in self.attn:
            y = a(self.norm(x))
            x = x + self.drop(y[0] + y[1].sum() * 0 if isinstance(y, tuple) else y)
        logits = self.head(x)
        return logits, F.cross_entropy(logits.view(-1, V), targets.view(-1))


class SharedMaskLM(nn.Module):
    """One sliding-window mask made in the model's forward and read by every layer (as Hugging Face passes
    one mask to all of them)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.qkv = nn.ModuleList(nn.Linear(H, 3 * H) for _ in range(2))
        self.o = nn.ModuleList(nn.Linear(H, H) for _ in range(2))
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx, targets):
        b, s = idx.shape
        i = torch.arange(s, device=idx.device)
        hide = ~((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 4))  # (s, s): all but the last 4
        x = self.emb(idx)
        for qkv, o in zip(self.qkv, self.o):
            q, k, v = qkv(x).view(b, s, 3, NH, HD).permute(2, 0, 3, 1, 4)  # (b, h, s, d) each
            att = (q @ k.transpose(-2, -1) * HD ** -0.5).masked_fill(hide, float("-inf")).softmax(-1)
            x = x + o((att @ v).transpose(1, 2).reshape(b, s, H))
        logits = self.head(x)
        return logits, F.cross_entropy(logits.view(-1, V), targets.view(-1))


def build(kind: str, dropout: float = 0.0):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = SharedMaskLM() if kind == "shared_window" else LM(kind, dropout)
    return model, (torch.randint(0, V, (2, S), generator=g), torch.randint(0, V, (2, S), generator=g)), {}
