"""Attention with relative-position logits gathered per head, in a small LM (width 64, vocab 96, 4 heads of 16,
sequence 12), and Hugging Face's Inkling built tiny. Each head's logits over E relative distances come from a
matmul by one weight that every head shares (``(.., heads, .., d) @ W [d, E]``), then ``gather`` along the
last dim picks, for query i and key j, the distance ``i - j``: the index touches no head, so cut by heads the
gather is local, and the shared weight is whole on every rank with its gradient summed (Megatron sums a q/k
norm's weight so). The bucket spellings project the hidden states to every head's logits instead, a column of
attention's pair. Every hand-written model is ``(idx, targets) -> (logits, loss)``.

- ``hidden_relative``: Inkling's bias: ``r_proj(x).view(b, s, n, d_rel) @ proj`` transposed to heads, gathered by
  ``distance.clamp(0, E - 1).expand(b, n, -1, -1)``, added to the scores;
- ``query_relative``: Shaw / Music Transformer's relative logits from the queries of a fused ``qkv`` projection:
  ``q @ rel.t()`` (``rel [E, head_dim]``), gathered by an index built per head with ``repeat``;
- ``einsum_relative``: the shared weight applied by ``einsum('bnsd,ed->bnse')``, the index expanded to
  ``(b, n, s, s)`` from ``(s, s)``;
- ``buckets_heads_last``: ProphetNet's layout: a bias projection of the hidden states ``x -> E·n`` laid out
  ``(b, s, E, n)``, heads last, moved to ``(b, n, s, E)`` and gathered by a bucket index of the distance
  (log-spaced buckets, as T5 and ProphetNet bucket it) expanded over the heads: the projection is a column of
  attention's pair, cut by heads within each of its E buckets;
- ``buckets_unflatten``: the same logits by ``unflatten(-1, (E, n))`` and ``movedim``, the index repeated over
  the heads by ``repeat``;
- ``inkling``: Hugging Face's Inkling text model (2 layers, a dense MLP and a MoE one) on ``input_ids`` and
  ``labels``; ``inkling2`` and ``prophetnet`` (not in ``KINDS``: planned, not trained): Inkling-2's text model
  and ProphetNet's decoder, whose n-gram self-attention gathers its bucket logits ``(b, s, buckets, heads)``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import HD, NH, H, S, RMSNorm
from tiny_lm import TinyLM, lm_build

E, DR = 8, 8  # relative distances kept, features per head of the hidden-state relative states


def _distance(s: int, device: torch.device) -> torch.Tensor:
    pos = torch.arange(s, device=device)
    return (pos[:, None] - pos[None, :]).clamp(0, E - 1)  # (s, s): query i, key j -> i - j, clipped


def _buckets(s: int, device: torch.device) -> torch.Tensor:
    """(s, s): query i, key j -> a bucket of the distance i - j: exact below E / 2, log-spaced up to E - 1."""
    pos = torch.arange(s, device=device)
    d = (pos[:, None] - pos[None, :]).clamp(min=0)
    exact = E // 2
    far = exact + (torch.log(d.float().clamp(min=1) / exact) / math.log(S / exact) * (E - exact)).long()
    return torch.where(d < exact, d, far.clamp(max=E - 1))


class Attention(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "hidden_relative":
            self.q, self.k, self.v = (nn.Linear(H, H, bias=False) for _ in range(3))
            self.r_proj = nn.Linear(H, NH * DR, bias=False)
            self.proj = nn.Parameter(torch.randn(DR, E) / math.sqrt(DR))
        elif kind.startswith("buckets"):
            self.q, self.k, self.v = (nn.Linear(H, H, bias=False) for _ in range(3))
            self.rel = nn.Linear(H, E * NH)  # (b, s, E·n): the n heads' logits of each bucket together
        else:
            self.qkv = nn.Linear(H, 3 * H, bias=False)
            self.rel = nn.Parameter(torch.randn(E, HD) / math.sqrt(HD))
        self.o = nn.Linear(H, H, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        if self.kind == "hidden_relative":
            q, k, v = (m(x).view(b, s, NH, HD).transpose(1, 2) for m in (self.q, self.k, self.v))
            rel = (self.r_proj(x).view(b, s, NH, DR) @ self.proj).transpose(1, 2)  # (b, NH, s, E)
            bias = rel.gather(-1, _distance(s, x.device)[None, None].expand(*rel.shape[:2], -1, -1))
        elif self.kind == "buckets_heads_last":
            q, k, v = (m(x).view(b, s, NH, HD).transpose(1, 2) for m in (self.q, self.k, self.v))
            rel = self.rel(x).view(b, s, E, NH).permute(0, 3, 1, 2)  # (b, NH, s, E)
            bias = torch.gather(rel, 3, _buckets(s, x.device).expand(b, NH, s, s))
        elif self.kind == "buckets_unflatten":
            q, k, v = (m(x).unflatten(-1, (NH, HD)).transpose(1, 2) for m in (self.q, self.k, self.v))
            rel = self.rel(x).unflatten(-1, (E, NH)).movedim(-1, 1)  # (b, NH, s, E)
            bias = rel.gather(-1, _buckets(s, x.device).repeat(b, NH, 1, 1))
        else:
            q, k, v = self.qkv(x).view(b, s, 3, NH, HD).permute(2, 0, 3, 1, 4).unbind(0)
            if self.kind == "query_relative":
                rel = q @ self.rel.t()  # (b, NH, s, E)
                idx = _distance(s, x.device).repeat(b, NH, 1, 1)
                bias = torch.gather(rel, 3, idx)
            else:
                rel = torch.einsum("bnsd,ed->bnse", q, self.rel)
                bias = torch.gather(rel, -1, _distance(s, x.device).expand(b, NH, s, s))
        scores = q @ k.transpose(-2, -1) / math.sqrt(HD) + bias
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.o((att @ v).transpose(1, 2).reshape(b, s, H))


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.n1, self.n2 = RMSNorm(H), RMSNorm(H)
        self.attn = Attention(kind)
        self.fc1, self.fc2 = nn.Linear(H, 4 * H, bias=False), nn.Linear(4 * H, H, bias=False)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.fc2(F.gelu(self.fc1(self.n2(x))))


def _lm(kind: str) -> TinyLM:
    """Two blocks of the attention then a GELU MLP."""
    return TinyLM(lambda: Block(kind))


KINDS = ("hidden_relative", "query_relative", "einsum_relative", "buckets_heads_last", "buckets_unflatten",
         "inkling")


# Hugging Face families built tiny (benchmarks/op_coverage.py's configs): Inkling trains in the parity runs;
# Inkling-2's and ProphetNet's plans are checked (extended)
HF = {"inkling": "inkling_text", "inkling2": "inkling2_text", "prophetnet": "prophetnet"}


def _hf(family: str):
    import sys
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from op_coverage import _build_hf

    model, args, kwargs, _ = _build_hf(family, 2 if family == "inkling_text" else None)
    return model, args, kwargs


def build(kind: str):
    if kind in HF:
        return _hf(HF[kind])
    return lm_build(lambda: _lm(kind))
