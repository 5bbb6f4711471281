"""Spellings from public single-device GPT files that used to leave weights whole: weights cast on their way
to the matmul (mixed-precision ``Linear`` subclasses) and value residuals (a per-layer value embedding of
the token ids added to v, gated per head by the input). Small LMs as in tests/support/pattern_models.py (width 64,
4 heads of 16, vocab 96); every model is ``(idx, targets) -> (logits, loss)``."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import HD, NH, H, V, RMSNorm, SwiGLU
from tiny_lm import lm_build


class CastedLinear(nn.Linear):
    """modded-nanogpt's style: the weight is cast to the activations' dtype at every call."""

    def forward(self, x):
        return F.linear(x, self.weight.to(dtype=x.dtype), self.bias.to(x.dtype) if self.bias is not None else None)


class TypeAsLinear(nn.Module):
    """A hand-written linear: ``x @ W.T`` with W cast by ``type_as`` and made contiguous (W stored [out, in])."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)

    def forward(self, x):
        return x @ self.weight.type_as(x).mT.contiguous()


def _linear(kind: str, d_in: int, d_out: int, bias: bool = False) -> nn.Module:
    if kind == "cast_typeas":
        return TypeAsLinear(d_in, d_out)
    return CastedLinear(d_in, d_out, bias=bias) if kind.startswith("cast") else nn.Linear(d_in, d_out, bias=bias)


class Attention(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        bias = kind == "cast_bias"
        self.q, self.k, self.v = (_linear(kind, H, H, bias) for _ in range(3))
        self.o = _linear(kind, H, H, bias)
        if kind == "value_gate":
            self.gate = nn.Linear(12, NH, bias=False)  # a per-head gate of the first 12 channels
        if kind == "value_lambda":
            self.lambdas = nn.Parameter(torch.tensor([0.5, 0.5]))

    def forward(self, x, ve=None):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, NH, HD) for p in (self.q, self.k, self.v))
        if self.kind == "value_gate":  # v + sigmoid(gate(x[..., :12])) * ve, one gate per head
            v = v + torch.sigmoid(self.gate(x[..., :12])).unsqueeze(-1) * ve.view(b, s, NH, HD)
        elif self.kind == "value_lambda":  # modded-nanogpt's mix: λ0·v + λ1·ve
            v = self.lambdas[0] * v + self.lambdas[1] * ve.view_as(v)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, H))


class MLP(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.up, self.down = _linear(kind, H, 128), _linear(kind, 128, H)

    def forward(self, x):
        return self.down(F.relu(self.up(x)).square())


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.n1, self.n2 = RMSNorm(H), RMSNorm(H)
        self.attn = Attention(kind)
        self.mlp = SwiGLU() if kind.startswith("value") else MLP(kind)

    def forward(self, x, ve=None):
        x = x + self.attn(self.n1(x), ve)
        return x + self.mlp(self.n2(x))


class LM(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList([Block(kind) for _ in range(2)])
        # value residuals: one embedding of the token ids per layer, the width of v
        self.value_embeds = nn.ModuleList([nn.Embedding(V, H) for _ in range(2)]) if kind.startswith("value") \
            else None
        self.norm = RMSNorm(H)
        self.head = _linear(kind, H, V)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for i, blk in enumerate(self.blocks):
            x = blk(x, self.value_embeds[i](idx) if self.value_embeds is not None else None)
        logits = self.head(self.norm(x)).float()
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


CASTS = ("cast", "cast_bias", "cast_typeas")
VALUES = ("value_gate", "value_lambda")
KINDS = (*CASTS, *VALUES)


def build(kind: str):
    return lm_build(lambda: LM(kind))
