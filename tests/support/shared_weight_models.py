"""Blocks whose weights are used more than once in one forward, as looped and parameter-sharing models write
them, in small LMs like tests/support/pattern_models.py's (width 64, 4 heads of 16, vocab 96):

- ``looped``: one block applied 3 times (recurrent-depth / universal-transformer style);
- ``shared_list``: a ModuleList holding the same block object twice, then a block of its own (ALBERT style);
- ``tied_attrs``: two blocks whose attention and MLP weights are the first block's Parameters, assigned after
  construction;
- ``unlike``: the second block's attention output projection is the first block's q projection (a column in
  one use, a row in the other: no one cut serves both, so those two pairs stay whole, with the reason).

Every model is ``(idx, targets) -> (logits, loss)``."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, V, Block, RMSNorm, build_with

KINDS = ("looped", "shared_list", "tied_attrs", "unlike")
LAYERS = {"looped": 3, "shared_list": 3, "tied_attrs": 2, "unlike": 2}  # blocks run per forward


class LM(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(V, H)
        if kind == "looped":
            self.block = Block("plain")
        elif kind == "shared_list":
            shared = Block("plain")
            self.blocks = nn.ModuleList([shared, shared, Block("plain")])
        else:
            self.blocks = nn.ModuleList([Block("plain"), Block("plain")])
            first, second = self.blocks
            tied = {"attn.o": "attn.q"} if kind == "unlike" else \
                {n: n for n in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")}
            for mine, theirs in tied.items():
                second.get_submodule(mine).weight = first.get_submodule(theirs).weight
        self.norm = RMSNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        if self.kind == "looped":
            for _ in range(3):
                x = self.block(x)
        else:
            for blk in self.blocks:
                x = blk(x)
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(kind: str):
    torch.manual_seed(0)
    return build_with(LM(kind))
