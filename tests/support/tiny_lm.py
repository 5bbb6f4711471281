"""The tiny language model the spelling tests share: token embedding, a stack of pre-norm residual blocks, a final
RMS norm, an untied LM head and the mean cross-entropy, ``(idx, targets) -> (logits, loss)``; and the seeded builds
(``lm_build`` for a hand-written model, ``hf_build`` for a Hugging Face config).

Each model file writes only its own mixer / MLP and hands ``TinyLM`` a block factory, e.g.
``TinyLM(lambda: Residual(attn=lambda: Attention("plain"), moe=lambda: Experts(kind)))``. Parameter names,
their order and the order the random initialisation runs in are those of the hand-written stack it replaces
(``emb``, ``blocks.{i}.{n1,n2 | norm}``, ``blocks.{i}.<branch>``, ``norm``, ``head``), so a model's numbers do not
depend on which file spells the skeleton.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, S, V, RMSNorm

HF_VOCAB = 128  # every Hugging Face config in tests/support uses this vocabulary


class Residual(nn.Module):
    """Pre-norm residual branches run in order, ``x = x + branch(norm(x))``.

    One branch: its norm is ``norm`` (``blocks.{i}.norm``); two: ``n1`` and ``n2``. The branches keep the keyword
    names they are given (``attn=``, ``moe=``, ``mixer=`` ...), so their parameters keep theirs. The norms are
    made first, then each branch in order, as the hand-written blocks did.
    """

    def __init__(self, width: int = H, **branches: Callable[[], nn.Module]):
        super().__init__()
        if len(branches) not in (1, 2):
            raise ValueError(f"Residual takes one or two branches, got {list(branches)}")
        self.names = tuple(branches)
        if len(branches) == 1:
            self.norm = RMSNorm(width)
        else:
            self.n1, self.n2 = RMSNorm(width), RMSNorm(width)
        for name, make in branches.items():
            setattr(self, name, make())

    def norms(self) -> tuple[nn.Module, ...]:
        return (self.norm,) if len(self.names) == 1 else (self.n1, self.n2)

    def forward(self, x):  # (b, s, h) -> (b, s, h)
        for norm, name in zip(self.norms(), self.names):
            x = x + getattr(self, name)(norm(x))
        return x


class TinyLM(nn.Module):
    """``emb -> blocks -> norm -> head`` and the mean cross-entropy over every position."""

    def __init__(self, block: Callable[[], nn.Module], layers: int = 2, vocab: int = V, width: int = H,
                 inputs: Callable[[], None] | None = None):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        if inputs is not None:  # what a subclass makes between the embedding and the blocks (a position-bias table)
            inputs()
        self.blocks = nn.ModuleList([block() for _ in range(layers)])
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def block_inputs(self, idx) -> tuple[torch.Tensor, ...]:
        """What every block takes after ``x``, made once from ``idx`` (a subclass's position bias); none here."""
        return ()

    def forward(self, idx, targets):
        x, extra = self.emb(idx), self.block_inputs(idx)  # (b, s, h)
        for blk in self.blocks:
            x = blk(x, *extra)
        logits = self.head(self.norm(x))  # (b, s, vocab)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(vocab: int = V, b: int = 2, s: int = S) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded ``(idx, targets)``, both ``(b, s)`` token ids, drawn from one generator seeded 1."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (b, s), generator=g), torch.randint(0, vocab, (b, s), generator=g)


def lm_build(make: Callable[[], nn.Module], s: int = S, vocab: int = V):
    """``build``'s answer for a hand-written model: made under seed 0, called ``model(idx, targets)``."""
    torch.manual_seed(0)
    model = make()
    return model, batch(vocab, 2, s), {}


def hf_build(cfg, low: int = 0, vocab: int = HF_VOCAB):
    """``build``'s answer for a Hugging Face config: a causal LM made under seed 0, called
    ``model(input_ids=ids, labels=ids)`` with ``(2, 8)`` ids in ``[low, vocab)`` seeded 1."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(low, vocab, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, (), {"input_ids": ids, "labels": ids}
