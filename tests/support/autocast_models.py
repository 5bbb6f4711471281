"""Regions under ``torch.autocast`` inside the model, as public GPT files write them (export wraps each in the
``wrap_with_autocast`` higher-order op): small LMs like tests/support/pattern_models.py's (width 64, 4 heads of 16,
seq 12, 2 layers); every model is ``(idx, targets) -> (logits, loss)``.

- ``qk_norm_with``: q and k RMSNorms over the whole projection width in fp32, in
  ``with torch.autocast(device_type, enabled=False):`` (OLMo-2 style under mixed precision);
- ``qk_norm_decorated``: the same norms as a module whose ``forward`` is decorated ``@torch.autocast(..., enabled=False)``;
- ``rope_decorated``: rotary embedding in a function decorated ``@torch.autocast("cpu", enabled=False)``, in fp32
  (x-transformers style);
- ``rope_matmul_with``: the rotary tables computed per call as Hugging Face's Llama does, ``inv_freq @
  positions`` in fp32 under ``with torch.autocast(device_type, enabled=False)`` (a matmul: under an outer
  bf16 autocast it would run in bf16 outside the region);
- ``final_norm_with``: the final norm in fp32 in a ``with`` block that also casts back (``.type_as``), and a
  second, nested ``with`` inside it.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from pattern_models import HD, NH, H, LMWith, RMSNorm, build_with, rope_tables

KINDS = ("qk_norm_with", "qk_norm_decorated", "rope_decorated", "final_norm_with", "rope_matmul_with")
WIDTH_NORM = ("qk_norm_with", "qk_norm_decorated")  # q/k norms over all heads: one b·s statistic each way


class FP32Norm(RMSNorm):
    """An RMSNorm computed in fp32 whatever autocast the caller runs under."""

    @torch.autocast("cpu", enabled=False)
    def forward(self, x):
        return super().forward(x.float()).type_as(x)


@torch.autocast("cpu", enabled=False)
def rotate(x, cos, sin):
    x = x.float()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def rotate_plain(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))
        if kind == "qk_norm_with":
            self.q_norm, self.k_norm = RMSNorm(H), RMSNorm(H)
        if kind == "qk_norm_decorated":
            self.q_norm, self.k_norm = FP32Norm(H), FP32Norm(H)
        if kind == "rope_matmul_with":
            self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD)),
                                 persistent=False)
        if kind == "rope_decorated":
            cos, sin = rope_tables(HD)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.kind == "qk_norm_with":
            with torch.autocast(x.device.type, enabled=False):
                q, k = self.q_norm(q.float()).type_as(v), self.k_norm(k.float()).type_as(v)
        if self.kind == "qk_norm_decorated":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(b, s, NH, HD) for t in (q, k, v))
        if self.kind == "rope_decorated":
            cos, sin = self.cos[:s, None, :], self.sin[:s, None, :]
            q, k = rotate(q, cos, sin).type_as(v), rotate(k, cos, sin).type_as(v)
        if self.kind == "rope_matmul_with":
            pos = torch.arange(s, device=x.device)[None, None, :].float()  # (1, 1, s)
            with torch.autocast(x.device.type, enabled=False):
                freqs = (self.inv_freq[None, :, None].float() @ pos).transpose(1, 2)  # (1, s, hd/2)
                cos, sin = freqs.cos()[0, :, None, :], freqs.sin()[0, :, None, :]  # (s, 1, hd/2)
            q, k = (rotate_plain(t, cos.type_as(t), sin.type_as(t)) for t in (q, k))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, nh, s, hd)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(HD)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, s, H))


class LM(LMWith):
    def __init__(self, kind: str):
        super().__init__(kind, Attention)

    def final_norm(self, x):
        if self.kind != "final_norm_with":
            return self.norm(x)
        with torch.autocast(x.device.type, enabled=False):
            h = self.norm(x.float())
            with torch.autocast(x.device.type, enabled=False):
                h = h * 1.0
            return h.type_as(x)


def build(kind: str):
    torch.manual_seed(0)
    return build_with(LM(kind))
