"""Losses over logits whose class dim is dim 1, (b, V, s), as torch's losses take N-d inputs: the spellings
public GPT files use to move the vocab there before ``F.cross_entropy`` / ``F.nll_loss``, each with its own
``reduction``, ``ignore_index`` or label smoothing. Small LMs like tests/support/pattern_models.py's (width 64, 4 heads
of 16, seq 12, 2 layers); every model is ``(idx, targets) -> (logits, loss)`` with logits (b, s, V).

- ``ce_transpose``: ``F.cross_entropy(logits.transpose(1, 2), targets)``;
- ``ce_permute_none``: ``F.cross_entropy(logits.permute(0, 2, 1), targets, reduction="none", ignore_index=-1)``
  summed and divided by the targets kept (targets of -1 at a few positions);
- ``ce_movedim_sum``: ``logits.movedim(-1, 1)`` (what einops' ``rearrange(logits, 'b n c -> b c n')``
  exports as), ``reduction="sum"``, label smoothing;
- ``nll_transpose``: ``F.nll_loss(F.log_softmax(logits, -1).transpose(1, 2), targets)``;
- ``nll_dim1``: ``F.log_softmax(logits.transpose(1, 2), dim=1)`` then ``F.nll_loss(..., ignore_index=-1)``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, S, Block, RMSNorm

V = 96
KINDS = ("ce_transpose", "ce_permute_none", "ce_movedim_sum", "nll_transpose", "nll_dim1")
IGNORES = ("ce_permute_none", "nll_dim1")  # targets hold -1 (ignored) at a few positions


class LossLM(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(Block("plain") for _ in range(2))
        self.norm = RMSNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x))  # (b, s, V)
        kind = self.kind
        if kind == "ce_transpose":
            return logits, F.cross_entropy(logits.transpose(1, 2), targets)
        if kind == "ce_permute_none":
            per_token = F.cross_entropy(logits.permute(0, 2, 1), targets, reduction="none", ignore_index=-1)  # (b, s)
            return logits, per_token.sum() / (targets != -1).sum()
        if kind == "ce_movedim_sum":
            loss = F.cross_entropy(logits.movedim(-1, 1), targets, reduction="sum", label_smoothing=0.1)
            return logits, loss / targets.numel()
        if kind == "nll_transpose":
            return logits, F.nll_loss(F.log_softmax(logits, dim=-1).transpose(1, 2), targets)
        if kind == "nll_dim1":
            logp = F.log_softmax(logits.transpose(1, 2), dim=1)  # (b, V, s)
            return logits, F.nll_loss(logp, targets, ignore_index=-1)
        raise ValueError(kind)


def build(kind: str):
    torch.manual_seed(0)
    model = LossLM(kind)
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, V, (2, S), generator=g), torch.randint(0, V, (2, S), generator=g)
    if kind in IGNORES:
        targets[0, :3] = -1
        targets[1, -2:] = -1
    return model, (idx, targets), {}
