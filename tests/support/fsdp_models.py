"""Tiny GPTs whose blocks are stacked in the ways people write them, for the FSDP tests.

- ``modulelist``: ``self.layers = nn.ModuleList(...)`` run in a loop, LM head tied to the embedding;
- ``sequential``: ``self.blocks = nn.Sequential(...)`` called once;
- ``attributes``: ``self.first``, ``self.second``, ``self.third`` on the root, called one by one;
- ``dense_first``: a ModuleList whose first block has a dense MLP and the others a mixture of experts (a
  ModuleList of expert MLPs, top-1 routed);
- ``nested``: blocks wrapped in another module (``self.trunk.stack[i]``), a norm after each block at the root.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

V, H, HEADS, S, B = 64, 32, 4, 8, 4
KINDS = ("modulelist", "sequential", "attributes", "dense_first", "nested")


class MLP(nn.Module):
    def __init__(self, width: int = 4 * H):
        super().__init__()
        self.up, self.down = nn.Linear(H, width), nn.Linear(width, H)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Experts(nn.Module):
    def __init__(self, n: int = 2):
        super().__init__()
        self.router = nn.Linear(H, n, bias=False)
        self.experts = nn.ModuleList(MLP(2 * H) for _ in range(n))

    def forward(self, x):
        w, sel = self.router(x).softmax(-1).max(-1)  # top-1
        return sum(torch.where((sel == e)[..., None], expert(x), 0) for e, expert in enumerate(self.experts)) * w[..., None]


class Block(nn.Module):
    def __init__(self, moe: bool = False):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))
        self.mlp = Experts() if moe else MLP()

    def forward(self, x):
        b, s, _ = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, s, HEADS, H // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, H)
        x = x + self.o(y)
        return x + self.mlp(self.ln2(x))


class Stack(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.stack = nn.ModuleList(Block() for _ in range(n))


class LM(nn.Module):
    def __init__(self, kind: str, n: int = 3):
        super().__init__()
        self.kind = kind
        self.wte = nn.Embedding(V, H)
        if kind == "modulelist":
            self.layers = nn.ModuleList(Block() for _ in range(n))
        elif kind == "sequential":
            self.blocks = nn.Sequential(*(Block() for _ in range(n)))
        elif kind == "attributes":
            self.first, self.second, self.third = Block(), Block(), Block()
        elif kind == "dense_first":
            self.layers = nn.ModuleList(Block(moe=i > 0) for i in range(n))
        elif kind == "nested":
            self.trunk = Stack(n)
            self.post = nn.ModuleList(nn.LayerNorm(H) for _ in range(n))
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)
        if kind == "modulelist":
            self.head.weight = self.wte.weight

    def forward(self, ids, targets):
        x = self.wte(ids)
        if self.kind == "sequential":
            x = self.blocks(x)
        elif self.kind == "attributes":
            x = self.third(self.second(self.first(x)))
        elif self.kind == "nested":
            for block, norm in zip(self.trunk.stack, self.post):
                x = norm(block(x))
        else:
            for layer in self.layers:
                x = layer(x)
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Twice(LM):
    """The ``modulelist`` stack run twice (weights shared across depth): its blocks cannot be FSDP units."""

    def __init__(self):
        super().__init__("modulelist", n=2)

    def forward(self, ids, targets):
        x = self.wte(ids)
        for _ in range(2):
            for layer in self.layers:
                x = layer(x)
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(kind: str) -> tuple[nn.Module, tuple, dict]:
    """One of KINDS, "single" (one block: nothing repeats) or "twice" (see :class:`Twice`)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ids, targets = (torch.randint(0, V, (B, S), generator=g) for _ in range(2))
    model = Twice() if kind == "twice" else LM("modulelist", n=1) if kind == "single" else LM(kind)
    return model, (ids, targets), {}
