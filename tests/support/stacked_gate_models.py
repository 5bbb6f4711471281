"""Gated MLPs whose one input projection gives ``[gate | up]`` read apart as a dim of 2 (``(b, s, 2, f)``), in
a small LM (width 64, vocab 96, 4 heads of 16, sequence 12), and Hugging Face's Moshi built tiny. Megatron
cuts the projection per segment (each rank the r-th slice of gate and of up) and the down projection by rows:
the dim of 2 indexes segments, not 2 heads. Every hand-written model is ``(idx, targets) -> (logits, loss)``.

- ``view_select``: ``fc1(x).view(b, s, 2, -1)``, ``silu(h[..., 0, :]) * h[..., 1, :]`` (Moshi's gating MLP);
- ``view_unbind``: ``torch.unbind(fc1(x).view(b, s, 2, f), dim=2)``;
- ``reshape_index``: ``(x @ W.t()).reshape(b, s, 2, f)``, ``h[:, :, 0]`` and ``h[:, :, 1]`` with GELU;
- ``moshi``: Hugging Face's Moshi text model (2 layers, 4 heads, 2 kv heads, ffn 128) on ``input_ids`` and
  ``labels``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import HD, NH, H
from tiny_lm import Residual, TinyLM, hf_build, lm_build

FF = 96  # each of gate and up


class StackedGateMLP(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc1 = nn.Linear(H, 2 * FF, bias=False)
        self.fc2 = nn.Linear(FF, H, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        if self.kind == "view_select":
            h = self.fc1(x).view(b, s, 2, -1)
            return self.fc2(F.silu(h[..., 0, :]) * h[..., 1, :])
        if self.kind == "view_unbind":
            gate, up = torch.unbind(self.fc1(x).view(b, s, 2, FF), dim=2)
            return self.fc2(F.silu(gate) * up)
        h = (x @ self.fc1.weight.t()).reshape(b, s, 2, FF)
        return self.fc2(F.gelu(h[:, :, 0]) * h[:, :, 1])


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.proj = nn.Linear(H, H, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, NH, HD).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, H))


def _lm(kind: str) -> TinyLM:
    """Two blocks of attention then the stacked-gate MLP."""
    return TinyLM(lambda: Residual(attn=Attention, mlp=lambda: StackedGateMLP(kind)))


KINDS = ("view_select", "view_unbind", "reshape_index", "moshi")


def _moshi():
    from transformers import MoshiConfig

    cfg = MoshiConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, ffn_dim=128, max_position_embeddings=64, use_cache=False)
    return hf_build(cfg)


def build(kind: str):
    if kind == "moshi":
        return _moshi()
    return lm_build(lambda: _lm(kind))
