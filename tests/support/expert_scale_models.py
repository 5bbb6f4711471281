"""A norm after each expert, its weight one row per expert picked per routed slot (Ergo's post-expert norm), in
small LMs like tests/support/pattern_models.py's (width 64, 4 heads of 16, vocab 96, 2 layers, 4 experts of 32
features, top-2). Each slot's expert output is normalized over the hidden width, so its all-reduce comes
before the norm; the norm's ``(E, H)`` weight then scales a replicated value. Every model is
``(idx, targets) -> (logits, loss)``.

- ``index_scale``: per-slot weights ``w_in[ids]``, ``w_out[ids]`` read by ``bmm``, ``F.rms_norm(y) *
  scale[ids]``;
- ``index_select_scale``: the same with a hand-written RMS norm and ``scale.index_select(0, ids)``.

Hugging Face's own (``HF_KINDS``), called ``model(input_ids=ids, labels=ids)``:

- ``ergo``: Ergo (2 layers, the second a mixture of 4 experts of 32 features, top-2, with a shared expert
  whose output is normalized too), its ``post_expert_norm.weight [E, H]`` read as ``weight[expert_ids]``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, Attention
from tiny_lm import Residual, TinyLM, hf_build, lm_build

E, I, K = 4, 32, 2  # experts, expert features, experts per token
KINDS = ("index_scale", "index_select_scale")
HF_KINDS = ("ergo",)


class NormedExperts(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.router = nn.Linear(H, E, bias=False)
        self.w_in = nn.Parameter(torch.randn(E, H, 2 * I) * H ** -0.5)
        self.w_out = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(E, H))

    def forward(self, x):
        b, s, h = x.shape
        x = x.reshape(-1, h)  # (T, H)
        w, sel = torch.topk(F.softmax(self.router(x), dim=-1), K, dim=-1)  # (T, K)
        ids = sel.reshape(-1)  # (T·K,): one expert per slot
        xs = x.repeat_interleave(K, dim=0).unsqueeze(1)  # (T·K, 1, H)
        gate, up = torch.bmm(xs, self.w_in[ids]).chunk(2, dim=-1)  # (T·K, 1, I) each
        y = torch.bmm(F.silu(gate) * up, self.w_out[ids]).squeeze(1)  # (T·K, H)
        if self.kind == "index_scale":
            y = F.rms_norm(y, (h,), eps=1e-6) * self.scale[ids]
        else:
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale.index_select(0, ids)
        return (y.view(-1, K, h) * w.unsqueeze(-1)).sum(1).view(b, s, h)


def _hf(kind: str):
    from transformers import ErgoConfig

    ids = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0, "use_cache": False}
    cfg = {"ergo": lambda: ErgoConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        first_dense_intermediate_size=128, moe_intermediate_size=I, shared_intermediate_size=64, num_experts=E,
        num_experts_per_tok=K, max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"], **ids)}[kind]()
    return hf_build(cfg)


def build(kind: str):
    if kind in HF_KINDS:
        return _hf(kind)
    # two blocks of plain attention then the experts
    return lm_build(lambda: TinyLM(lambda: Residual(attn=lambda: Attention("plain"), moe=lambda: NormedExperts(kind))))
