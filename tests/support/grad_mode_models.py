"""Forwards that compute part of their value without gradients, in small LMs like tests/support/pattern_models.py's
(width 64, 4 heads of 16, vocab 96, blocks of attention and a SwiGLU MLP):

- ``truncated``: one block applied 3 times, the first two under ``with torch.no_grad():`` (recurrent depth
  with truncated backpropagation, as Hugging Face's HRM-Text runs its inner cycles);
- ``decorated``: a frozen teacher block's output added to the residual stream, computed by a method under
  ``@torch.no_grad()``;
- ``set_grad``: the first block under ``with torch.set_grad_enabled(False):``;
- ``enable_inside``: two blocks read the embeddings under ``no_grad``, the second inside a nested
  ``torch.enable_grad()``, so only it and the embedding train through it (export keeps that block inside a
  ``wrap_with_set_grad_enabled`` region, which autotp leaves whole, with the reason).

Every model is ``(idx, targets) -> (logits, loss)``; ``APPLIED[kind]`` is (sharded blocks run, sharded blocks
run with gradients) per forward."""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, V, Block, RMSNorm, build_with

KINDS = ("truncated", "decorated", "set_grad", "enable_inside")
APPLIED = {"truncated": (3, 1), "decorated": (2, 1), "set_grad": (2, 1), "enable_inside": (1, 0)}


class LM(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(V, H)
        if kind == "truncated":
            self.block = Block("plain")
        else:
            self.blocks = nn.ModuleList([Block("plain"), Block("plain")])
        self.norm = RMSNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    @torch.no_grad()
    def teacher(self, x):
        return self.blocks[0](x)

    def forward(self, idx, targets):
        x = self.emb(idx)
        if self.kind == "truncated":
            for i in range(3):
                with torch.no_grad() if i < 2 else contextlib.nullcontext():
                    x = self.block(x)
        elif self.kind == "decorated":
            x = self.blocks[1](x + self.teacher(x))
        elif self.kind == "set_grad":
            with torch.set_grad_enabled(False):
                x = self.blocks[0](x)
            x = self.blocks[1](x)
        else:
            with torch.no_grad():
                frozen = self.blocks[0](x)
                with torch.enable_grad():
                    trained = self.blocks[1](x)
            x = frozen + trained
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(kind: str):
    torch.manual_seed(0)
    return build_with(LM(kind))
