"""A relative-position bias computed once and added to every layer's attention scores, in a small LM (width 64,
4 heads of 16, vocab 96, sequence 12, 2 layers), and Hugging Face's CPM-Ant built tiny. The bias is one lookup of
a ``(buckets, heads)`` table by each query-key pair's bucket, moved to ``(b or 1, heads, s, s)``: cut by heads
with every layer's attention (the table's heads column-parallel, each rank looking up its own heads' biases once
for all layers; no collective of its own, the table's gradient each rank's own heads'). Every hand-written model
is ``(idx, targets) -> (logits, loss)``.

- ``table``: T5's spelling, an ``nn.Embedding(buckets, heads)`` of the clamped distance, ``permute(2, 0, 1)``
  and ``unsqueeze(0)`` to ``(1, heads, s, s)``, added to ``q @ k.transpose(-2, -1)`` written out;
- ``raw``: CPM-Ant's, ``F.embedding`` of a raw ``(buckets, heads)`` parameter by a ``(b, s, s)`` bucket,
  ``permute(0, 3, 1, 2).contiguous()``, given to ``scaled_dot_product_attention`` as its float mask with the
  causal mask filled in;
- ``cpmant``: Hugging Face's CPM-Ant (2 layers) on ``input_ids`` and ``labels``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import HD, NH, H, S, RMSNorm
from tiny_lm import TinyLM, hf_build, lm_build

BUCKETS = 2 * S - 1  # every distance j - i of a sequence of S


class Attention(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q, self.k, self.v = (nn.Linear(H, H, bias=False) for _ in range(3))
        self.o = nn.Linear(H, H, bias=False)

    def forward(self, x, bias):
        b, s, _ = x.shape
        q, k, v = (m(x).view(b, s, NH, HD).transpose(1, 2) for m in (self.q, self.k, self.v))  # (b, nh, s, hd)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        if self.kind == "table":
            scores = q @ k.transpose(-2, -1) / math.sqrt(HD) + bias  # (b, nh, s, s)
            y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~causal, float("-inf")))
        return self.o(y.transpose(1, 2).reshape(b, s, H))


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.n1, self.n2 = RMSNorm(H), RMSNorm(H)
        self.attn = Attention(kind)
        self.fc1, self.fc2 = nn.Linear(H, 4 * H, bias=False), nn.Linear(4 * H, H, bias=False)

    def forward(self, x, bias):
        x = x + self.attn(self.n1(x), bias)
        return x + self.fc2(F.gelu(self.fc1(self.n2(x))))


class LM(TinyLM):
    """Two blocks of the attention then a GELU MLP, every block given the same position bias."""

    def __init__(self, kind: str):
        super().__init__(lambda: Block(kind), inputs=lambda: self._tables(kind))

    def _tables(self, kind: str):
        self.kind = kind
        if kind == "table":
            self.rel = nn.Embedding(BUCKETS, NH)
        else:
            self.table = nn.Parameter(torch.randn(BUCKETS, NH))

    def position_bias(self, idx):
        b, s = idx.shape
        pos = torch.arange(s, device=idx.device)
        bucket = (pos[None, :] - pos[:, None]).clamp(-(S - 1), S - 1) + (S - 1)  # (s, s): key minus query
        if self.kind == "table":
            return self.rel(bucket).permute(2, 0, 1).unsqueeze(0)  # (1, nh, s, s)
        return F.embedding(bucket.expand(b, s, s), self.table).permute(0, 3, 1, 2).contiguous()  # (b, nh, s, s)

    def block_inputs(self, idx) -> tuple[torch.Tensor]:
        return (self.position_bias(idx),)


KINDS = ("table", "raw", "cpmant")


def _cpmant():
    from transformers import CpmAntConfig

    cfg = CpmAntConfig(vocab_size=128, hidden_size=64, num_attention_heads=4, dim_head=16, dim_ff=128,
                       num_hidden_layers=2, prompt_length=4, prompt_types=3, segment_types=4,
                       position_bias_num_buckets=32, position_bias_max_distance=64, dropout_p=0.0, init_std=0.02,
                       use_cache=False)
    return hf_build(cfg, low=1)


def build(kind: str):
    if kind == "cpmant":
        return _cpmant()
    return lm_build(lambda: LM(kind))
