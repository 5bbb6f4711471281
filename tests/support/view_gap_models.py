"""Spellings that only move dims or do nothing, in small LMs like tests/support/pattern_models.py's (width 64, 4 heads
of 16, vocab 96, 2 layers): the transpose family in attention (``k.mT`` with tanh soft-capping, ``swapaxes``,
``movedim``, ``permute`` and ``transpose`` with negative dims, ``adjoint``, ``mH``) and identity views, no-op
casts and copies in front of every input projection (each projection reads its own such node of the normed
activations), and positions folded in groups of 4 around the MLP's activation (``view(b, s // 4, 4, f)``). Every model is ``(idx, targets) -> (logits, loss)``; tests/analysis/test_view_gaps.py runs them."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import HD, NH, S, V, H, RMSNorm
from tiny_lm import Residual, lm_build

# spellings, by name: (b, s, nh, hd) -> (b, nh, s, hd), the scores' k^T (b, nh, hd, s), and
# (b, nh, s, hd) -> (b, s, nh, hd)
PLAIN = (lambda t: t.transpose(1, 2), lambda k: k.transpose(-2, -1), lambda y: y.transpose(1, 2))
TRANSPOSES = {
    "mT": (lambda t: t.transpose(-3, -2), lambda k: k.mT, lambda y: y.transpose(-3, -2)),
    "swapaxes": (lambda t: t.swapaxes(1, 2), lambda k: k.swapaxes(-2, -1), lambda y: y.swapdims(1, 2)),
    "movedim": (lambda t: t.movedim(2, 1), lambda k: k.movedim(-1, -2), lambda y: y.movedim(1, -2)),
    "movedim_list": (lambda t: t.movedim([1, 2], [2, 1]), lambda k: torch.movedim(k, (-2, -1), (-1, -2)),
                     lambda y: torch.swapdims(y, 2, -3)),
    "permute_neg": (lambda t: t.permute(0, -2, 1, -1), lambda k: k.permute(0, 1, -1, -2),
                    lambda y: y.permute(0, 2, -3, -1)),
    "adjoint": (lambda t: t.transpose(1, -2), lambda k: k.adjoint(), lambda y: y.transpose(-2, 1)),
    "mH": (lambda t: t.permute(0, 2, 1, 3), lambda k: k.mH, lambda y: y.permute(0, -2, -3, -1)),
}

# what each input projection reads of the normed activations x (b, s, h): q, k, v, gate, up
IDENTITIES = {
    "view_as": [lambda x: x.view_as(x), lambda x: x.view_as(x), lambda x: torch.Tensor.view_as(x, x),
                lambda x: x.view_as(x), lambda x: x.view_as(x)],
    "reshape_same": [lambda x: x.reshape(x.shape[0], x.shape[1], H), lambda x: x.view(x.shape),
                     lambda x: x.reshape(*x.shape), lambda x: x.view(x.size(0), -1, x.size(-1)),
                     lambda x: torch.reshape(x, x.shape)],
    # .to(x.dtype), .type_as(x), .float() of a float tensor give the tensor itself; contiguous() of a
    # contiguous one too
    "noop_casts": [lambda x: x.to(x.dtype), lambda x: x.type_as(x), lambda x: x.float(),
                   lambda x: x.contiguous().to(torch.float32), lambda x: x.to(device=x.device)],
    "slices": [lambda x: x[:], lambda x: x[..., :], lambda x: x[:, :], lambda x: x[:, :, :H],
               lambda x: x[0:]],
    "copies": [lambda x: x.clone(), lambda x: x.expand_as(x), lambda x: torch.ops.aten.alias(x),
               lambda x: x.expand(x.shape[0], -1, -1), lambda x: x.clone().expand_as(x)],
}

# positions folded in groups of 4 around the MLP's activation, and back: (b, s, f) -> (b, s // 4, 4, f); the
# quotient is a size of its own in the graph, which the shape analysis must read as s / 4
FOLDS = {"fold_div": (lambda y: y.view(y.shape[0], y.shape[1] // 4, 4, y.shape[2]),
                      lambda y, like: y.view(like.shape)),
         "fold_neg": (lambda y: y.reshape(y.size(0), -1, 4, y.size(-1)),
                      lambda y, like: y.flatten(1, 2))}

# each kind spells its two layers differently (one kind, two spellings: half the cost of a test run);
# seq_first keeps its own layout (movedim, permute with negative dims, swapaxes) and takes only k's spelling
LAYERS = {"mT_softcap": ("mT", "mH"), "swapaxes": ("swapaxes", "movedim_list"),
          "permute_neg": ("permute_neg", "adjoint"), "seq_first": ("movedim", "movedim"),
          "view_as": ("view_as", "reshape_same"), "noop_casts": ("noop_casts", "slices"), "copies": ("copies", "view_as"),
          "seq_fold": ("fold_div", "fold_neg")}
KINDS = tuple(LAYERS)


class Attention(nn.Module):
    """q, k, v, o projections; heads moved and k transposed in the kind's spelling; causal softmax (with tanh
    soft-capping for ``mT_softcap``, as Gemma-2 writes it)."""

    def __init__(self, kind: str, spelling: str):
        super().__init__()
        self.kind, self.spelling = kind, spelling
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))

    def forward(self, x):
        kind = self.kind
        heads, kt, back = TRANSPOSES.get(self.spelling, PLAIN)
        ins = IDENTITIES[self.spelling][:3] if self.spelling in IDENTITIES else [lambda t: t] * 3
        if kind == "seq_first":  # (s, b, h) in, heads (b, nh, s, hd) by one permute, as Megatron's layout
            s, b, _ = x.shape
            q, k, v = (p(x).view(s, b, NH, HD).permute(1, -2, 0, -1) for p in (self.q, self.k, self.v))
        else:
            b, s, _ = x.shape
            q, k, v = (heads(p(f(x)).view(b, s, NH, HD)) for p, f in zip((self.q, self.k, self.v), ins))
        att = (q @ kt(k)) * (1.0 / math.sqrt(HD))
        if kind == "mT_softcap":  # Gemma-2's tanh soft-capping of the scores
            cap = 30.0
            att = cap * torch.tanh(att / cap)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v  # (b, nh, s, hd)
        if kind == "seq_first":
            return self.o(y.movedim(2, 0).reshape(s, b, H))
        return self.o(back(y).reshape(b, s, H))


class MLP(nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.gate, self.up, self.down = nn.Linear(H, 128, bias=False), nn.Linear(H, 128, bias=False), \
            nn.Linear(128, H, bias=False)

    def forward(self, x):
        g, u = (f(x) for f in IDENTITIES[self.spelling][3:]) if self.spelling in IDENTITIES else (x, x)
        if self.spelling in FOLDS:  # (b, s, f) -> (b, s / 4, 4, f) around the activation, and back
            fold, unfold = FOLDS[self.spelling]
            gate = self.gate(g)
            return self.down(unfold(F.silu(fold(gate)), gate) * self.up(u))
        return self.down(F.silu(self.gate(g)) * self.up(u))


def Block(kind: str, spelling: str) -> Residual:
    """The attention then the MLP, each on a pre-norm residual branch."""
    return Residual(attn=lambda: Attention(kind, spelling), mlp=lambda: MLP(spelling))


class LM(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList([Block(kind, spelling) for spelling in LAYERS[kind]])
        self.norm = RMSNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        if self.kind == "seq_first":  # the residual stream as (s, b, h), moved there and back by the family
            x = x.movedim(1, 0)
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        if self.kind == "seq_first":
            x = x.swapaxes(0, 1)
        logits = self.head(x)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(kind: str):
    return lm_build(lambda: LM(kind))
