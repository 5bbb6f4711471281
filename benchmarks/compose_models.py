"""The models of the composition matrix (benchmarks/compose.py), as a model file ``autotp shard`` reads too.

- ``build_model()``: a small GPT (vocab 64, width 32, 4 heads, 4 blocks, SDPA causal attention, no position
  table, untied head) whose script checkpoints every block (``torch.utils.checkpoint``, non-reentrant);
- ``build_plain()``: the same weights without checkpointing;
- ``build_moe()``: tests/support/moe_models.py's ``fused_loop`` LM (4 experts as 3-D parameters, a loop over
  ``w[e]``, top-2 routing) for expert parallelism.

``example_batch()``: 4 sequences of 12 token ids and their targets (ids below 64, every model's vocab), 12
positions so that cp 2 (chunks of 3), tp 2 sequence parallelism and both together divide them.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, WIDTH, HEADS, LAYERS = 64, 32, 4, 4
BATCH, SEQ = 4, 12


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(x).split(WIDTH, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, s, width / heads)
        return self.proj(y.transpose(1, 2).reshape(b, s, WIDTH))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        self.recompute = recompute

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        x = self.wte(idx)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        logits = self.head(self.ln_f(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return GPT(recompute=True)


def build_plain() -> nn.Module:
    torch.manual_seed(0)
    return GPT(recompute=False)


def build_moe() -> nn.Module:
    support = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "support")
    if support not in sys.path:
        sys.path.insert(0, support)
    from moe_models import LM

    torch.manual_seed(0)
    return LM("fused_loop")


def example_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
