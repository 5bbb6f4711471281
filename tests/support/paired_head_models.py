"""Attention whose heads are not read one by one, in a small LM (width 64, vocab 96, 4 query heads of 16, 2 or 4
kv heads, sequence 12), and the Hugging Face families that write it, built tiny. Every hand-written model is
``(idx, targets) -> (logits, loss)``.

Dynamic mask attention (Doge): a linear of the whole ``v`` (``(b, s, n_kv·d) -> (b, s, n_kv)``) gives one gate
per kv head, added to every score of that head as a mask. Cut by heads, the linear is row-parallel inside
attention's region: one all-reduce of its ``b·s·n_kv`` outputs forward and backward, each rank's heads reading
their gates from the whole result.

- ``gate_linear``: ``F.linear(v.transpose(1, 2).reshape(b, s, -1), W)``, ``exp(A * softplus(.))`` as Doge
  writes it, expanded over the queries and repeated to the query heads by ``repeat_interleave``, SDPA;
- ``gate_matmul``: ``(v_flat @ W.t())`` of kv heads kept ``(b, s, n_kv, d)``, ``sigmoid(. + bias)``, the scores
  written out (``q @ k.transpose(-2, -1)``) with the gate added, softmax, ``@ v``; 4 kv heads;
- ``doge``: Hugging Face's Doge (2 layers, 4 heads, 2 kv heads) on ``input_ids`` and ``labels``.

Differential attention (DiffLlama; by hand 8 heads of 8, 4 pairs): query head ``i`` is paired with head ``i + n/2``, read apart by a chunk of
the heads after attention. Megatron-style, a pair is never split across ranks: q, k and v are cut per half
(rank r the r-th slice of each half), the output projection by rows.

- ``diff_chunk``: ``sdpa(q, k, v).chunk(2, dim=1)``, ``y1 - λ·y2`` with ``λ`` from four ``(d,)`` parameters,
  a per-head RMS norm, ``o`` of ``n/2·d`` rows;
- ``diff_split``: ``torch.split(sdpa(..).transpose(1, 2), n/2, dim=2)``, the pairs concatenated
  ``(b, s, n/2, 2d)`` and normalised over ``2d`` (a written RMS norm), ``o`` of ``n·d`` rows;
- ``diffllama``: Hugging Face's DiffLlama (2 layers, 4 heads, 2 kv heads: v read by its two halves of kv heads,
  each repeated to the kv heads); at tp 4 its 2 pairs are fewer than the ranks: attention is left replicated;
- ``diffllama_8``: the same with 8 heads and 4 kv heads (width 128): each half of v is 2 kv heads, tiled
  head-minor by the repeat; cut at tp 2, left replicated at tp 4 (2 kv heads per half, fewer than tp).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import HD, NH, H, RMSNorm
from tiny_lm import TinyLM, hf_build, lm_build


class GatedAttention(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.nkv = 2 if kind == "gate_linear" else 4
        self.q = nn.Linear(H, NH * HD, bias=False)
        self.k = nn.Linear(H, self.nkv * HD, bias=False)
        self.v = nn.Linear(H, self.nkv * HD, bias=False)
        self.dt = nn.Linear(self.nkv * HD, self.nkv, bias=False)
        self.A = nn.Parameter(torch.randn(self.nkv) * 0.5)
        self.o = nn.Linear(NH * HD, H, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, NH, HD).transpose(1, 2)
        k = self.k(x).view(b, s, self.nkv, HD).transpose(1, 2)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        if self.kind == "gate_linear":
            v = self.v(x).view(b, s, self.nkv, HD).transpose(1, 2)
            dt = F.linear(v.transpose(1, 2).reshape(b, s, -1), self.dt.weight)
            gate = torch.exp(self.A * F.softplus(dt)).transpose(-1, -2)  # (b, n_kv, s)
            mask = gate[:, :, None, :].expand(-1, -1, s, -1).masked_fill(~causal, float("-inf"))
            rep = NH // self.nkv
            y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                               attn_mask=mask.repeat_interleave(rep, 1))
        else:
            v4 = self.v(x).view(b, s, self.nkv, HD)
            gate = torch.sigmoid(v4.reshape(b, s, -1) @ self.dt.weight.t() + self.A)  # (b, s, n_kv)
            scores = q @ k.transpose(-2, -1) / math.sqrt(HD) + gate.transpose(1, 2).unsqueeze(2)
            att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            y = att @ v4.transpose(1, 2)
        return self.o(y.transpose(1, 2).reshape(b, s, NH * HD))


PH, PD = 8, 8  # differential attention's heads: 4 pairs, cut at tp 2 and 4


class DiffAttention(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q, self.k, self.v = (nn.Linear(H, PH * PD, bias=False) for _ in range(3))
        self.lq1, self.lk1, self.lq2, self.lk2 = (nn.Parameter(torch.randn(PD) * 0.1) for _ in range(4))
        self.o = nn.Linear(PH * PD // (2 if kind == "diff_chunk" else 1), H, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (m(x).view(b, s, PH, PD).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, n, s, d)
        lam = torch.exp((self.lq1 * self.lk1).sum()) - torch.exp((self.lq2 * self.lk2).sum()) + 0.8
        if self.kind == "diff_chunk":
            y1, y2 = y.chunk(2, dim=1)  # heads i and i + n/2
            z = F.rms_norm(y1 - lam * y2, (PD,)) * 0.2
            return self.o(z.transpose(1, 2).reshape(b, s, -1))
        y1, y2 = torch.split(y.transpose(1, 2), PH // 2, dim=2)
        z = torch.cat([y1, lam * y2], dim=-1)  # (b, s, n/2, 2d): each pair's two heads side by side
        z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.o(z.reshape(b, s, PH * PD))


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.n1, self.n2 = RMSNorm(H), RMSNorm(H)
        self.attn = DiffAttention(kind) if kind.startswith("diff_") else GatedAttention(kind)
        self.fc, self.proj = nn.Linear(H, 128, bias=False), nn.Linear(128, H, bias=False)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.proj(F.gelu(self.fc(self.n2(x))))


def _lm(kind: str) -> TinyLM:
    """Two blocks of the attention then a GELU MLP."""
    return TinyLM(lambda: Block(kind))


GATES = ("gate_linear", "gate_matmul")
PAIRS = ("diff_chunk", "diff_split")
HAND = (*GATES, *PAIRS)
KINDS = (*GATES, "doge", *PAIRS, "diffllama", "diffllama_8")


def _hf(family: str):
    """The family as benchmarks/op_coverage.py builds it: width 64, 2 layers, 4 heads of 16, 2 kv heads
    (``diffllama_8``: width 128, 8 heads of 16, 4 kv heads, 2 kv heads in each half of v)."""
    from transformers import AutoConfig

    wide = family.endswith("_8")
    cfg = AutoConfig.for_model(family.removesuffix("_8"), vocab_size=128, hidden_size=128 if wide else 64,
                               intermediate_size=128, num_hidden_layers=2, num_attention_heads=8 if wide else 4,
                               num_key_value_heads=4 if wide else 2, head_dim=16, max_position_embeddings=64,
                               bos_token_id=0, eos_token_id=0, use_cache=False)
    return hf_build(cfg)


def build(kind: str):
    if kind not in HAND:
        return _hf(kind)
    return lm_build(lambda: _lm(kind))
