"""Attention spellings of encoder-style and unusual Hugging Face families, and hand-written spellings of the same
patterns, for tests/analysis/test_attention_families.py. The Hugging Face models are built tiny from their configs (width
64, 4 heads of 16, 2 layers, vocab 128, no dropout) and called as a training step calls them,
``model(input_ids=ids, labels=ids)``; the hand-written ones are tests/support/pattern_models.py's small LM
(``(idx, targets) -> (logits, loss)``) with their own attention.

- ``xlm``: XLM, whose scores are masked in place, ``scores.masked_fill_(mask, finfo.min)``, on the matmul's
  result (the mask a ``(b, 1, 1, s)`` view expanded to the scores);
- ``fill_inplace``: the causal mask written in place by a chain of in-place ops on the scores,
  ``att.mul_(scale).masked_fill_(~causal, -inf)``;
- ``fill_inplace_stale``: the same, but a view of the scores taken before the write is read after it (a
  transposed copy added to the result): a write another node sees, never read as its functional form;
- ``roformer``: RoFormer, rotary applied with a sin | cos table looked up by position in a frozen
  ``nn.Embedding`` (one table for every layer), each half repeated pairwise by ``stack([sin, sin], -1)`` and
  ``reshape_as``, the rotated half by ``stack([-q[..., 1::2], q[..., ::2]], -1)``;
- ``rope_table_frozen``, ``rope_table_learned``: the same spelling by hand, the table a frozen
  ``nn.Embedding`` or a learned ``nn.Parameter`` read by ``F.embedding(positions, table)`` (its gradient,
  partial on each rank's heads, summed);
- ``head_scale_flat``: Dory's query scale, a flat learned parameter of one entry per head and channel read as
  ``(sqk * c).view(-1, 1, d).square()`` and multiplied into q (cut with the heads, its sizes inferred), and a
  flat output gate scale ``(s_gate * c).square()`` on the attention's ``(b, s, h)`` output;
- ``head_scale_looped``: the same blocks applied twice in a loop, as Dory runs its layers: every weight and
  every flat scale is read twice, each read cut alike;
- ``head_scale_stray``: the flat query scale also read whole outside attention's region (its mean added to the
  output): cut for one reader and whole for the other would be wrong, so the attention stays replicated;
- ``dory``: Dory, its layers run twice, with those scales, per-channel scales of its MLP (``suv_gate``,
  ``suv_up``) and a per-token logit scale on its LM head (``logits * logit_scale``, which keeps the head whole).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import HD, NH, H, LMWith, build_with

HF_KINDS = ("xlm", "roformer", "dory")
KINDS = ("fill_inplace", "rope_table_frozen", "rope_table_learned", "head_scale_flat", "head_scale_looped")


class InPlaceMasked(nn.Module):
    """q, k, v, o projections; the scores scaled and causally masked by in-place ops."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, NH, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        att = q @ k.transpose(-2, -1)  # (b, nh, s, s), a fresh tensor
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        early = att.transpose(-2, -1)  # a view of the scores before the write
        att.mul_(1 / math.sqrt(HD)).masked_fill_(~causal, float("-inf"))
        if self.kind == "fill_inplace_stale":  # reads the written values through the earlier view
            att = att + early.tril()
        return self.o((att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, H))


class TableRotary(nn.Module):
    """q, k, v, o projections; rotary from a sin | cos table looked up by position, RoFormer's spelling."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))
        pos = torch.arange(64, dtype=torch.float32)[:, None]
        angles = pos / 10000 ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD)  # (64, HD/2)
        table = torch.cat([angles.sin(), angles.cos()], -1)  # (64, HD): sin | cos
        if kind == "rope_table_frozen":
            self.table = nn.Embedding.from_pretrained(table, freeze=True)
        else:
            self.weight = nn.Parameter(table)

    def forward(self, x):
        b, s, _ = x.shape
        pos = torch.arange(s, device=x.device)
        table = self.table(pos) if self.kind == "rope_table_frozen" else F.embedding(pos, self.weight)
        table = table[None, None]  # (1, 1, s, HD)
        sin, cos = table.chunk(2, dim=-1)
        sin, cos = (torch.stack([t, t], dim=-1).reshape_as(table) for t in (sin, cos))  # θ0 θ0 θ1 θ1 ...

        def rotate(t):
            return t * cos + torch.stack([-t[..., 1::2], t[..., ::2]], dim=-1).reshape_as(t) * sin

        q, k, v = (p(x).view(b, s, NH, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, H))


class FlatHeadScale(nn.Module):
    """q, k, v, o projections; q scaled per head and channel by a flat parameter viewed into heads, and the
    attention's output gated by another flat parameter, as Dory spells them."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))
        self.sqk = nn.Parameter(torch.linspace(0.5, 1.5, H))
        self.s_gate = nn.Parameter(torch.linspace(1.5, 0.5, H))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, NH, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        q = q * (self.sqk * 0.5).view(-1, 1, HD).square()  # (NH, 1, HD) against (b, NH, s, HD)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, H)
        y = y * torch.sigmoid((self.s_gate * 2.0).square())
        if self.kind == "head_scale_stray":
            return self.o(y) + self.sqk.mean()
        return self.o(y)


class LoopedLM(LMWith):
    """The small LM with its blocks applied twice in a loop (weights read twice per step)."""

    def forward(self, idx, targets):
        x = self.emb(idx)
        for _ in range(2):
            for blk in self.blocks:
                x = blk(x)
        logits = self.head(self.final_norm(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _hf_config(kind: str):
    from transformers import DoryConfig, RoFormerConfig, XLMConfig

    ids = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0, "use_cache": False}
    return {"xlm": lambda: XLMConfig(vocab_size=128, emb_dim=64, n_layers=2, n_heads=4, dropout=0.0,
                                     attention_dropout=0.0, max_position_embeddings=64, **ids),
            "roformer": lambda: RoFormerConfig(vocab_size=128, embedding_size=64, hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
                                               attention_probs_dropout_prob=0.0, max_position_embeddings=64,
                                               is_decoder=True, rotary_value=False, **ids),
            # an input layer, a recurrent one run in 2 loops, an output layer
            "dory": lambda: DoryConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                       n_input_layers=1, n_recurrent_layers=1, n_output_layers=1, n_recurrent_loops=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=64, attention_dropout=0.0, **ids)}[kind]()


def build(kind: str):
    torch.manual_seed(0)
    if kind in HF_KINDS:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(_hf_config(kind))
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
        return model, (), {"input_ids": ids, "labels": ids}
    attention = TableRotary if kind.startswith("rope_table") else FlatHeadScale if kind.startswith("head_scale") \
        else InPlaceMasked
    return build_with((LoopedLM if kind == "head_scale_looped" else LMWith)(kind, attention))
