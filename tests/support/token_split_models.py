"""Experts that take their tokens split by the routing's counts and joined again, written by hand in a small LM
(width 64, 4 query heads of 16, vocab 96, sequence 12), and Hugging Face's JetMoE built tiny. Every hand-written
model is ``(idx, targets) -> (logits, loss)``.

The tokens, each repeated once per expert it is routed to (top 2 of 4), are sorted by expert, split into one piece
per expert by the counts read at run time (``.tolist()``), each piece multiplied by its expert's matrix ``W[e]``,
and the pieces joined again with ``torch.cat`` over the rows; the router-weighted rows are added back to their
tokens (``index_add`` into zeros). Megatron's expert tensor parallelism: every expert's up-projection cut by its
output features (gate | up per segment), its down-projection by its input features, one all-reduce of the
combined output per layer; the counts are sizes of the row dim, which no rank cuts.

- ``fused``: JetMoE's ``ParallelExperts``: one ``(E, 2·I, h)`` weight of gate | up, ``F.linear`` per piece,
  ``chunk(2, -1)`` after the join, counts from ``zeros.scatter(1, ids, 1).long().sum(0)``, tokens ordered by
  ``sort``, a bias after the combine;
- ``separate``: gate and up in two ``(E, h, I)`` weights read ``piece @ W[e]``, the down-projection
  ``(E, I, h)``, counts from ``one_hot(ids, E).sum(0)``, tokens ordered by a stable ``argsort``, the pieces of
  ``torch.split``, the combine from ``x.new_zeros``;
- ``jetmoe``: Hugging Face's JetMoE (2 layers): its MLP is ``fused``, and its attention a mixture of attention
  heads: the query projection per expert (tokens split by counts, as above; ``k`` slots of 2 kv heads per
  token, ``(b, s, k·n_kv, d)``), one key | value projection every slot's heads share (repeated head-minor), the
  output projection per expert;
- ``jetmoe_kv4``: JetMoE with 4 kv heads (8 query heads over its 2 slots), so that attention cuts at tp 4 too.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, Attention
from tiny_lm import Residual, TinyLM, hf_build, lm_build

E, K, I = 4, 2, 32  # experts, experts per token, each expert's hidden features


class TokenSplitMoE(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        g = torch.Generator().manual_seed(7)
        self.router = nn.Linear(H, E, bias=False)
        if kind == "fused":
            self.w_in = nn.Parameter(torch.randn(E, 2 * I, H, generator=g) * 0.1)  # [E, out, in]
            self.w_out = nn.Parameter(torch.randn(E, H, I, generator=g) * 0.1)
            self.bias = nn.Parameter(torch.randn(H, generator=g) * 0.1)
        else:
            self.w_gate = nn.Parameter(torch.randn(E, H, I, generator=g) * 0.1)  # [E, in, out]
            self.w_up = nn.Parameter(torch.randn(E, H, I, generator=g) * 0.1)
            self.w_down = nn.Parameter(torch.randn(E, I, H, generator=g) * 0.1)

    def forward(self, x):
        b, s, h = x.shape
        x = x.reshape(-1, h)  # (b·s, h)
        top_w, top_i = self.router(x).topk(K, dim=1)  # (b·s, k)
        top_w = top_w.softmax(dim=1)
        if self.kind == "fused":
            counts = torch.zeros(x.shape[0], E).scatter(1, top_i, 1).long().sum(0).tolist()
            _, order = top_i.flatten().sort(0)
            tokens = order.div(K, rounding_mode="trunc")  # (b·s·k,) each slot's token, by expert
            pieces = x[tokens].split(counts, dim=0)
            fused = torch.cat([F.linear(p, self.w_in[e]) for e, p in enumerate(pieces)], dim=0)  # (b·s·k, 2·I)
            gate, up = fused.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
            out = torch.cat([F.linear(p, self.w_out[e]) for e, p in enumerate(hidden.split(counts, dim=0))], dim=0)
            y = torch.zeros(b * s, h).index_add(0, tokens, out * top_w.flatten()[order][:, None])
            return y.view(b, s, h) + self.bias
        flat = top_i.flatten()
        counts = F.one_hot(flat, E).sum(0).tolist()
        order = torch.argsort(flat, stable=True)
        tokens = order // K
        pieces = torch.split(x[tokens], counts)
        gate = torch.cat([p @ self.w_gate[e] for e, p in enumerate(pieces)])
        up = torch.cat([p @ self.w_up[e] for e, p in enumerate(pieces)])
        hidden = F.gelu(gate) * up  # (b·s·k, I)
        out = torch.cat([p @ self.w_down[e] for e, p in enumerate(torch.split(hidden, counts))])
        y = x.new_zeros(x.shape).index_add(0, tokens, out * top_w.flatten()[order].unsqueeze(-1))
        return y.view(b, s, h)


def _lm(kind: str) -> TinyLM:
    """Two blocks of plain attention then the token-split experts."""
    return TinyLM(lambda: Residual(attn=lambda: Attention("plain"), moe=lambda: TokenSplitMoE(kind)))


SPELLINGS = ("fused", "separate")
HF = ("jetmoe", "jetmoe_kv4")
KINDS = SPELLINGS + HF


def _jetmoe(kv: int):
    from transformers import JetMoeConfig

    cfg = JetMoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, kv_channels=16,
                       num_key_value_heads=kv, num_attention_heads=K * kv, num_local_experts=E,
                       num_experts_per_tok=K, max_position_embeddings=64, use_cache=False, bos_token_id=0,
                       eos_token_id=0, initializer_range=0.02)
    return hf_build(cfg)


def build(kind: str):
    if kind in HF:
        return _jetmoe(4 if kind == "jetmoe_kv4" else 2)
    return lm_build(lambda: _lm(kind))
