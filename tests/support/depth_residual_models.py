"""Layers whose inputs are attention over the outputs of the layers before them (a block attention residual, Inkling
2's), in a small LM (width 64, 4 heads of 16, vocab 96, sequence 12), and Hugging Face's Inkling 2 built tiny.
Each layer reads a softmax-weighted mix of the RMS-normed earlier outputs (the embedding's included), scored by a
few learned queries ``(n, h)``, in place of the residual stream; its keys and values pass through a causal short
convolution over the sequence written with ``unfold`` (each channel's taps ``(K, C)`` read per head), and its
attention output is added to the mix it read. Megatron's cut: each attention's heads (q, k, v and the short
convolution's taps by channels, the output projection row-parallel), each MLP or expert column→row, the mixes read
whole (they read the all-reduced layer outputs) with their queries whole by design, as a router's gate is. Every
hand-written model is ``(idx, targets) -> (logits, loss)``.

- ``listed``: the earlier outputs kept in a Python list and ``torch.stack``-ed for each mix, one query ``(1, h)``
  scoring them as ``normed @ query.t()``; static taps ``taps.t()[None, :, None, :]``; a SwiGLU MLP;
- ``stacked``: the earlier outputs kept as one ``(b, s, L, h)`` tensor grown by ``torch.cat``, two queries
  ``(2, h)`` expanded over the positions and read by ``matmul`` and ``softmax`` (q and k read the first mix, v the
  second); taps that are the static ``taps.t().reshape(heads, d, K)`` plus per-token ones projected from the
  input, ``(b, s, heads, 1, K)``; a depthwise ``conv1d`` of the residual stream after attention (its filters whole,
  as norms are); top-2 of 4 sigmoid-scored experts run in a loop;
- ``inkling2_text`` and ``inkling2_loop_text``: Hugging Face's Inkling 2 (2 layers, the sizes
  benchmarks/op_coverage.py gives) on ``input_ids`` and ``labels``.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, HD, NH, S, V, RMSNorm
from tiny_lm import lm_build

K, E, I, TOP, L = 4, 4, 32, 2, 2  # taps, experts, expert width, experts per token, layers


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class ListedMix(nn.Module):
    """A softmax over the earlier outputs, listed: ``(b, s, L, h) @ (h, 1)`` scores, weights over L."""

    def __init__(self):
        super().__init__()
        self.query = nn.Parameter(torch.randn(1, H) * 0.3)

    def forward(self, outs: list[torch.Tensor]) -> torch.Tensor:
        states = torch.stack(outs, dim=-2)  # (b, s, L, h)
        w = torch.softmax(_rms(states) @ self.query.t() / math.sqrt(H), dim=-2)  # (b, s, L, 1)
        return (w * states).sum(-2)  # (b, s, h)


class StackedMix(nn.Module):
    """Attention of ``n`` learned queries over the stacked outputs, as Hugging Face's Inkling 2 writes it."""

    def __init__(self, n: int):
        super().__init__()
        self.query = nn.Parameter(torch.randn(n, H) * 0.3)

    def forward(self, states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        normed = _rms(states)  # (b, s, L, h)
        q = self.query.float().expand(*states.shape[:-2], -1, -1)  # (b, s, n, h)
        w = torch.softmax(q @ normed.transpose(-1, -2) * H ** -0.5, dim=-1)  # (b, s, n, L)
        return (w @ normed).unbind(-2)  # n of (b, s, h)


class ShortConv(nn.Module):
    """A causal convolution of each channel over the sequence (the token and K - 1 before it), by ``unfold``."""

    def __init__(self, dynamic: bool):
        super().__init__()
        self.taps = nn.Parameter(torch.randn(K, NH * HD) * 0.3)  # tap i weighs the token i steps back
        self.weight_proj = nn.Linear(H, NH * K, bias=False) if dynamic else None

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        b, s, c = y.shape  # y (b, s, C) the channels, x (b, s, h) what the per-token taps are made from
        windows = F.pad(y.transpose(1, 2), (K - 1, 0)).unfold(-1, K, 1).flip(-1)  # (b, C, s, K)
        if self.weight_proj is None:
            out = (windows * self.taps.t()[None, :, None, :]).sum(-1).transpose(1, 2)  # (b, s, C)
        else:
            taps = self.taps.t().reshape(NH, HD, K) + self.weight_proj(x).view(b, s, NH, 1, K)  # (b, s, NH, HD, K)
            windows = windows.transpose(1, 2).reshape(b, s, NH, HD, K)
            out = (windows * taps).sum(-1).reshape(b, s, c)
        return (out + y) / math.sqrt(K + 1)


class Attention(nn.Module):
    def __init__(self, dynamic: bool):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))
        self.k_conv, self.v_conv = ShortConv(dynamic), ShortConv(dynamic)

    def forward(self, x: torch.Tensor, xv: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, NH, HD).transpose(1, 2)
        k = self.k_conv(self.k(x), x).view(b, s, NH, HD).transpose(1, 2)
        v = self.v_conv(self.v(xv), xv).view(b, s, NH, HD).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, H))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(H, 2 * H, bias=False), nn.Linear(H, 2 * H, bias=False)
        self.down = nn.Linear(2 * H, H, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """Top-2 of 4 sigmoid-scored experts, the weights renormalized, run one expert at a time."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.w1, self.w3 = (nn.Parameter(torch.randn(E, I, H) * H ** -0.5) for _ in range(2))
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        b, s, h = x.shape
        x = x.reshape(-1, h)  # (T, h)
        scores = torch.sigmoid(self.router(x))  # (T, E)
        sel = torch.topk(scores, TOP, dim=-1).indices
        w = scores.gather(1, sel)
        w = w / w.sum(-1, keepdim=True)
        out = x.new_zeros(x.shape)
        for e in range(E):
            we = (w * (sel == e)).sum(-1, keepdim=True)  # (T, 1)
            out = out + we * F.linear(F.silu(x @ self.w1[e].t()) * (x @ self.w3[e].t()), self.w2[e])
        return out.view(b, s, h)


class Layer(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        stacked = kind == "stacked"
        self.attn_input = StackedMix(2) if stacked else ListedMix()
        self.mlp_input = StackedMix(1) if stacked else ListedMix()
        self.n_qk, self.n_v, self.n_mlp = RMSNorm(H), RMSNorm(H), RMSNorm(H)
        self.attn = Attention(dynamic=stacked)
        # a short convolution of the residual stream: it reads attention's all-reduced output, whole
        self.post_conv = nn.Conv1d(H, H, K, groups=H, padding=K - 1, bias=False) if stacked else None
        self.mlp = MoE() if stacked else MLP()

    def forward(self, states):
        if self.kind == "listed":  # states: the earlier outputs, listed
            x = self.attn_input(states)
            n = self.n_qk(x)
            h = x + self.attn(n, n)
            return h + self.mlp(self.n_mlp(self.mlp_input([*states, h])))
        x, xv = self.attn_input(states)  # states: (b, s, L, h)
        a = self.attn(self.n_qk(x), self.n_v(xv))
        h = x + self.post_conv(a.transpose(1, 2))[..., :a.shape[1]].transpose(1, 2)
        (m,) = self.mlp_input(torch.cat([states, h.unsqueeze(-2)], dim=-2))
        return h + self.mlp(self.n_mlp(m))


class LM(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(V, H)
        self.layers = nn.ModuleList(Layer(kind) for _ in range(L))
        self.final_input = StackedMix(1) if kind == "stacked" else ListedMix()
        self.final_norm = RMSNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        if self.kind == "listed":
            outs = [x]
            for layer in self.layers:
                outs.append(layer(outs))
            x = self.final_input(outs)
        else:
            states = x.unsqueeze(-2)  # (b, s, 1, h)
            for layer in self.layers:
                states = torch.cat([states, layer(states).unsqueeze(-2)], dim=-2)
            (x,) = self.final_input(states)
        logits = self.head(self.final_norm(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


KINDS = ("listed", "stacked", "inkling2_text", "inkling2_loop_text")


def _hf(family: str):
    """Hugging Face's ``family`` built as benchmarks/op_coverage.py builds it (its tiny config, 2 kv heads)."""
    bench = str(Path(__file__).resolve().parents[2] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from op_coverage import _build_hf

    model, args, kwargs, _ = _build_hf(family, None)
    return model, args, kwargs


def build(kind: str):
    if kind.startswith("inkling2"):
        return _hf(kind)
    return lm_build(lambda: LM(kind))
