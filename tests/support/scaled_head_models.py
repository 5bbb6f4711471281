"""LM heads whose logits are multiplied by a learned scale per vocabulary entry (Dory's ``DoryLMHead``:
``logits.float() * (logit_scale.float() * c)``), in hand-written spellings. Small LMs like
tests/support/pattern_models.py's (width 64, 4 heads of 16, seq 12, 2 layers); every model is
``(idx, targets) -> (logits, loss)``.

- ``scale_mul``: ``head(x) * self.scale``, scale ``(V,)`` broadcast over (b, s);
- ``scale_elementwise``: Dory's spelling, ``head(x).float() * (self.scale.float() * c)``, of a vocabulary of 98
  (padded to 100 at tp 4);
- ``scale_viewed_tied``: a head tied to the embedding (``x @ wte.weight.t()``) times ``scale.view(1, 1, V).exp()``;
- ``scale_stray``: as ``scale_mul``, and the scale's mean added to the loss (a read of the whole scale outside the
  logits): no cut serves both, so the head stays whole, named with the reason;
- ``temperature``: the logits divided by one learned scalar ``(1,)`` shared by every entry: each rank's gradient
  of it would cover only its own vocab slice, so the head stays whole, named with the reason.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, S, Block, RMSNorm

KINDS = ("scale_mul", "scale_elementwise", "scale_viewed_tied")
REFUSED = {"scale_stray": "is also read by", "temperature": "meets the vocab-sharded logits"}
_VOCAB = {"scale_elementwise": 98}


class ScaledHeadLM(nn.Module):
    def __init__(self, kind: str, blocks: int = 2):
        super().__init__()
        self.kind, self.vocab = kind, _VOCAB.get(kind, 96)
        self.tok_emb = nn.Embedding(self.vocab, H)
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        self.blocks = nn.ModuleList(Block("plain") for _ in range(blocks))
        self.norm = RMSNorm(H)
        if kind != "scale_viewed_tied":
            self.head = nn.Linear(H, self.vocab, bias=False)
        if kind == "temperature":
            self.temp = nn.Parameter(torch.tensor([0.7]))
        else:  # distinct entries, so that a scale cut at the wrong offset shows in the loss
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, self.vocab))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        x = self.tok_emb(idx)
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        if self.kind == "scale_viewed_tied":
            logits = (x @ self.tok_emb.weight.t()) * self.scale.view(1, 1, -1).exp()
        elif self.kind == "scale_elementwise":
            logits = self.head(x).float() * (self.scale.float() * 2.0)
        elif self.kind == "temperature":
            logits = self.head(x) / self.temp
        else:
            logits = self.head(x) * self.scale
        loss = F.cross_entropy(logits.view(-1, self.vocab), targets.view(-1))
        if self.kind == "scale_stray":
            loss = loss + 0.1 * self.scale.mean()
        return logits, loss


def build(kind: str, blocks: int = 2):
    """``blocks``: transformer blocks between the embedding and the head (none: the head alone, a quick capture)."""
    torch.manual_seed(0)
    model = ScaledHeadLM(kind, blocks)
    g = torch.Generator().manual_seed(1)
    v = model.vocab
    return model, (torch.randint(0, v, (2, S), generator=g), torch.randint(0, v, (2, S), generator=g)), {}
