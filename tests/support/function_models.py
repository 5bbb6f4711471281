"""Models with their own ``torch.autograd.Function``: small LMs like tests/support/pattern_models.py's (width 64, 4
heads of 16, seq 12, 2 layers); every model is ``(idx, targets) -> (logits, loss)``. Export traces a
Function's forward and drops its backward; autotp calls the Function again (autotp.operators.functions).

- ``ste``: the attention output rounded by a straight-through estimator (forward ``round``, backward the
  identity: the traced ops alone would give a zero gradient) before the output projection;
- ``custom_fwd``: the values through a SiLU written as a Function decorated with ``torch.amp.custom_fwd``
  (inputs cast to fp32) and ``custom_bwd``, its backward written by hand;
- ``outside``: the block's input through a gradient-scaling Function (forward the identity, backward
  half the gradient) before the attention: outside every tensor-parallel region;
- ``grad_norm``: the attention output through a Function whose backward normalizes the gradient over the
  features: on a shard of the features it would see only part of them, so the attention stays whole.

The first three run on shards (their forward and backward are local to a slice of the features or heads).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from pattern_models import HD, NH, H, LMWith, build_with

KINDS = ("ste", "custom_fwd", "outside", "grad_norm")


class RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        return (x * scale).round() / scale

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SiLU(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * s * (1 + x * (1 - s))


class ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


class GradNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad / grad.norm(dim=-1, keepdim=True)


class Attention(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.proj = nn.Linear(H, H, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        if self.kind == "outside":
            x = ScaleGrad.apply(x)
        q, k, v = self.qkv(x).split(H, dim=-1)
        q, k, v = (t.view(b, n, NH, HD).transpose(1, 2) for t in (q, k, v))  # (b, h, n, d)
        if self.kind == "custom_fwd":
            v = SiLU.apply(v)
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        scores = (q @ k.transpose(-2, -1) / math.sqrt(HD)).masked_fill(~mask, float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, H)
        if self.kind == "ste":
            y = RoundSTE.apply(y, 8.0)
        elif self.kind == "grad_norm":
            y = GradNorm.apply(y)
        return self.proj(y)


def build(kind: str):
    torch.manual_seed(0)
    return build_with(LMWith(kind, Attention))
