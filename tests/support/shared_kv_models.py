"""Shared-KV multi-query attention with a grouped low-rank output projection and hyper-connections (DeepSeek-V4's
layout): ``build(kind) -> (model, args, kwargs)``, every model called as a training step calls it, returning the
logits and the loss.

Each block keeps ``N`` residual streams ``(b, s, N, h)``; a small mixing linear of all of them (``fn (2N + N², N·h)``)
gives per token the weights that collapse the streams into the block's input (pre, through a sigmoid), write its
output back into every stream (post) and mix the streams (comb, a softmax, Sinkhorn-normalized). Attention: q through
a latent (``q_a`` whole, ``q_b`` by heads), one key head that is also the value head (``kv_proj``, ``h -> d``: every
rank holds it whole, as multi-query attention's), interleaved rotary on each head's last ``R`` features, a learned
sink logit per head, the output's rotary undone, then the heads' outputs projected in ``G`` groups
(``o_a``: ``G`` blocks of ``NH·HD/G -> O``, a block-diagonal linear) and mixed by ``o_b`` (``G·O -> h``).

``deepseek_v4``: Hugging Face's DeepSeek-V4, built tiny as benchmarks/op_coverage.py builds it.

Hand-written (width 64, 4 heads of 16, vocab 96, 8 tokens, 2 streams; MLPs 8 times as wide, so that the mixing
linears, whole on every rank, stay a small part of the parameters), ``(idx, targets) -> (logits, loss)``:

- ``grouped_bmm``: as Hugging Face writes it: the mixing linear's output ``split`` into pre | post | comb, the
  key head viewed ``(b, s, 1, d)`` and transposed, a compressor of windows of 4 tokens (a key and a gate
  projection of one head each, softmax over the window) whose entries are concatenated after the keys along the
  sequence, the key head repeated by ``expand`` + ``reshape``, sinks concatenated to the scores, 8 groups of half
  a head each (as Hugging Face's tiny configuration has them), ``o_a`` as ``bmm`` of its weight viewed
  ``(G, O, NH·HD/G)``;
- ``grouped_einsum``: the mixing linear's output read by slices, the key head kept ``(b, s, d)`` and unsqueezed to
  ``(b, 1, s, d)`` (broadcast by the matmuls), the sink as an extra ``logsumexp`` term, 4 groups of one head
  each, ``o_a`` as ``einsum('bsgi,goi->bsgo')``;
- ``grouped_pairs``: ``grouped_bmm`` with 2 groups of 2 heads: at tp 4 a group would span ranks (no exact cut).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from tiny_lm import lm_build

V, H, NH, HD, S, R, N = 96, 64, 4, 16, 8, 8, 2  # vocab, width, heads, head dim, tokens, rotary dims, streams
Q_LAT, O, WIN = 24, 6, 4  # q latent, o_a's outputs per group, the compressor's window

WRITTEN = ("grouped_bmm", "grouped_einsum")
FEW_GROUPS = ("grouped_pairs",)
HF_KINDS = ("deepseek_v4",)
KINDS = WRITTEN + FEW_GROUPS + HF_KINDS
GROUPS = {"grouped_bmm": 8, "grouped_einsum": 4, "grouped_pairs": 2}


class RMSNorm(nn.Module):
    def __init__(self, dim: int | None):
        super().__init__()
        self.weight = None if dim is None else nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y if self.weight is None else y * self.weight


def _rotate(x, cos, sin):
    """Interleaved rotary on the last ``R`` features of each head: ``x (b, heads, s, d)``, ``cos (s, R)``."""
    nope, rope = x[..., :-R], x[..., -R:]
    half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, rope * cos + half * sin], dim=-1)


class HyperConnection(nn.Module):
    """The mixing weights of ``N`` streams from all of them: ``(post (b, s, N), comb (b, s, N, N), collapsed
    (b, s, h))``."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fn = nn.Parameter(0.05 * torch.randn((2 + N) * N, N * H))
        self.base = nn.Parameter(0.1 * torch.randn((2 + N) * N))
        self.scale = nn.Parameter(torch.ones(3) + 0.1 * torch.randn(3))
        self.norm = RMSNorm(None)

    def forward(self, streams):
        b, s = streams.shape[:2]
        mixes = F.linear(self.norm(streams.reshape(b, s, N * H)), self.fn)
        if self.kind != "grouped_einsum":
            pre, post, comb = mixes.split([N, N, N * N], dim=-1)
            pre_b, post_b, comb_b = self.base.split([N, N, N * N])
        else:
            pre, post, comb = mixes[..., :N], mixes[..., N:2 * N], mixes[..., 2 * N:]
            pre_b, post_b, comb_b = self.base[:N], self.base[N:2 * N], self.base[2 * N:]
        pre = torch.sigmoid(pre * self.scale[0] + pre_b) + 1e-6
        post = 2 * torch.sigmoid(post * self.scale[1] + post_b)
        comb = torch.softmax((comb * self.scale[2] + comb_b).view(b, s, N, N), dim=-1) + 1e-6
        for _ in range(3):  # Sinkhorn: rows and columns summing to 1
            comb = comb / (comb.sum(dim=-2, keepdim=True) + 1e-6)
            comb = comb / (comb.sum(dim=-1, keepdim=True) + 1e-6)
        return post, comb, (pre.unsqueeze(-1) * streams).sum(dim=2)


class Compressor(nn.Module):
    """One compressed key head per window of ``WIN`` tokens: ``(b, 1, s/WIN, d)``, softmax-weighted over the
    window by a gate projection, with a learned bias per position in the window."""

    def __init__(self):
        super().__init__()
        self.kv_proj, self.gate_proj = nn.Linear(H, HD, bias=False), nn.Linear(H, HD, bias=False)
        self.position_bias = nn.Parameter(0.1 * torch.randn(WIN, HD))
        self.norm = RMSNorm(HD)

    def forward(self, x):
        b, s, _ = x.shape
        kv = self.kv_proj(x).view(b, s // WIN, WIN, HD)
        gate = self.gate_proj(x).view(b, s // WIN, WIN, HD) + self.position_bias
        return self.norm((kv * gate.softmax(dim=2)).sum(dim=2)).unsqueeze(1)


class SharedKVAttention(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.groups = kind, GROUPS[kind]
        self.q_a, self.q_norm = nn.Linear(H, Q_LAT, bias=False), RMSNorm(Q_LAT)
        self.q_b = nn.Linear(Q_LAT, NH * HD, bias=False)
        self.kv_proj, self.kv_norm = nn.Linear(H, HD, bias=False), RMSNorm(HD)
        self.o_a = nn.Linear(NH * HD // self.groups, self.groups * O, bias=False)
        self.o_b = nn.Linear(self.groups * O, H, bias=False)
        self.sinks = nn.Parameter(0.5 * torch.randn(NH))
        self.compressor = Compressor() if kind != "grouped_einsum" else None
        inv = 1.0 / (10000 ** (torch.arange(0, R, 2).float() / R))
        freqs = torch.arange(S).float()[:, None] * inv
        self.register_buffer("cos", freqs.cos().repeat_interleave(2, -1), persistent=False)
        self.register_buffer("sin", freqs.sin().repeat_interleave(2, -1), persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        cos, sin = self.cos[:s], self.sin[:s]
        q = self.q_b(self.q_norm(self.q_a(x))).view(b, s, NH, HD).transpose(1, 2)
        q = _rotate(q, cos, sin)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        if self.kind != "grouped_einsum":
            kv = _rotate(self.kv_norm(self.kv_proj(x)).view(b, s, 1, HD).transpose(1, 2), cos, sin)
            # window w's entry is seen by queries after its last token
            seen = (torch.arange(s, device=x.device)[:, None] + 1) // WIN > torch.arange(s // WIN, device=x.device)
            kv = torch.cat([kv, self.compressor(x)], dim=2)  # (b, 1, s + s/WIN, d)
            mask = torch.cat([causal, seen], dim=-1)
            k = kv.unsqueeze(2).expand(b, 1, NH, kv.shape[2], HD).reshape(b, NH, kv.shape[2], HD)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(HD)
            att = att.masked_fill(~mask, float("-inf"))
            sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)
            p = torch.cat([att, sinks], dim=-1).softmax(-1)[..., :-1]
            y = p @ k
        else:
            kv = _rotate(self.kv_norm(self.kv_proj(x)).unsqueeze(1), cos, sin)  # (b, 1, s, d)
            att = (q @ kv.transpose(-2, -1)) / math.sqrt(HD)
            att = att.masked_fill(~causal, float("-inf"))
            # the sink as one more logit per head: softmax over the keys and the sink, the sink dropped
            norm = torch.logaddexp(att.logsumexp(-1, keepdim=True), self.sinks.view(1, NH, 1, 1))
            y = torch.exp(att - norm) @ kv
        y = _rotate(y, cos, -sin).transpose(1, 2)  # (b, s, NH, HD), the rotary undone
        g = self.groups
        grouped = y.reshape(b, s, g, NH * HD // g)
        if self.kind != "grouped_einsum":
            w = self.o_a.weight.view(g, O, -1).transpose(1, 2)  # (g, NH·HD/g, O)
            out = torch.bmm(grouped.reshape(b * s, g, -1).transpose(0, 1), w).transpose(0, 1)
        else:
            out = torch.einsum("bsgi,goi->bsgo", grouped, self.o_a.weight.view(g, O, -1))
        return self.o_b(out.reshape(b, s, g * O))


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.attn_hc, self.ffn_hc = HyperConnection(kind), HyperConnection(kind)
        self.n1, self.attn, self.n2 = RMSNorm(H), SharedKVAttention(kind), RMSNorm(H)
        self.up, self.down = nn.Linear(H, 8 * H, bias=False), nn.Linear(8 * H, H, bias=False)

    def forward(self, streams):
        post, comb, x = self.attn_hc(streams)
        y = self.attn(self.n1(x))
        streams = post.unsqueeze(-1) * y.unsqueeze(-2) + comb.transpose(-1, -2) @ streams
        post, comb, x = self.ffn_hc(streams)
        y = self.down(F.silu(self.up(self.n2(x))))
        return post.unsqueeze(-1) * y.unsqueeze(-2) + comb.transpose(-1, -2) @ streams


class WrittenLM(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.wte = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(Block(kind) for _ in range(2))
        self.head_fn = nn.Parameter(0.05 * torch.randn(N, N * H))
        self.norm, self.head = RMSNorm(H), nn.Linear(H, V, bias=False)

    def forward(self, idx, targets):
        b, s = idx.shape
        streams = self.wte(idx).unsqueeze(2).expand(b, s, N, H)
        for blk in self.blocks:
            streams = blk(streams)
        pre = torch.sigmoid(F.linear(streams.reshape(b, s, N * H), self.head_fn)) + 1e-6
        logits = self.head(self.norm((pre.unsqueeze(-1) * streams).sum(dim=2)))
        return logits, F.cross_entropy(logits.view(-1, V), targets.view(-1))


def _hf(family: str):
    """The family as benchmarks/op_coverage.py builds it (width 64, 2 layers, 4 heads of 512, 8 output groups; a
    heavily compressed attention layer, windows of 128, then a compressed sparse one, windows of 4, with its
    indexer; a hash-routed MoE layer, then a top-k one; 4 residual streams), called on 2 sequences of 8 tokens."""
    bench = str(Path(__file__).resolve().parents[2] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from op_coverage import _build_hf

    model, args, kwargs, _ = _build_hf(family, None)
    return model, args, kwargs


def build(kind: str):
    if kind in HF_KINDS:
        return _hf(kind)
    return lm_build(lambda: WrittenLM(kind), s=S, vocab=V)
