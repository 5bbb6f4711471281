"""Hugging Face families whose tiny builds did not capture until their configs were consistent or their call
complete (benchmarks/op_coverage.py), for parity at tp 2 and 4; each called as a training step calls it,
``model(input_ids=ids, labels=ids)``.

- ``kimi_linear``: Kimi-Linear, a Kimi Delta Attention layer (q, k and v projections of 4 heads of 16 each,
  joined by ``torch.cat`` for one depthwise causal ``conv1d`` over the sequence, then split apart again; a
  per-channel forget gate through a 16-wide latent) and a latent (MLA) attention layer, a dense MLP and a
  mixture of 4 experts with a shared expert;
- ``longcat_flash``: LongCat-Flash, two latent attentions and a dense MLP per layer beside a mixture of 4
  experts and 2 identity ("zero") experts;
- ``xmod``: X-MOD, a BERT-style decoder with a language adapter after each layer (one language, the default).

``joined_conv`` (hand-written): Kimi's join spelled apart: q, k and v projections of 4 heads of 16 joined by
``torch.cat`` on the features, one depthwise causal ``F.conv1d`` over the sequence (left-padded by ``F.pad``)
on the joined channels, read apart again with ``chunk(3)``, then causal SDPA and an output projection.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tiny_lm import hf_build

KINDS = ("joined_conv", "kimi_linear", "longcat_flash", "xmod")
V, H, NH, S, K = 128, 64, 4, 8, 4  # vocab, width, heads, sequence, the convolution's window
IDS = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0, "use_cache": False}
LATENT = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8)


def _config(kind: str):
    from transformers import KimiLinearConfig, LongcatFlashConfig, XmodConfig

    if kind == "kimi_linear":
        return KimiLinearConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_token=2,
                                moe_intermediate_size=32, num_expert_group=1, topk_group=1, linear_num_heads=4,
                                linear_head_dim=16, mlp_layer_types=["dense", "sparse"],
                                layer_types=["linear_attention", "full_attention"], **LATENT, **IDS)
    if kind == "longcat_flash":
        return LongcatFlashConfig(vocab_size=128, hidden_size=64, num_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4, ffn_hidden_size=128, max_position_embeddings=64,
                                  n_routed_experts=4, moe_topk=2, expert_ffn_hidden_size=32, zero_expert_num=2,
                                  q_lora_rank=24, **LATENT, **IDS)
    return XmodConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, is_decoder=True, **IDS)


class JoinedConv(nn.Module):
    """q, k, v (b, s, h) each, joined (b, s, 3h) for one depthwise causal convolution, read apart again."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))
        self.conv = nn.Parameter(torch.randn(3 * H, 1, K) / K)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1).transpose(1, 2)  # (b, 3h, s)
        qkv = F.silu(F.conv1d(F.pad(qkv, (K - 1, 0)), self.conv, groups=3 * H)).transpose(1, 2)
        q, k, v = (t.view(b, s, NH, H // NH).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, H))


class JoinedConvLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.attn = nn.ModuleList(JoinedConv() for _ in range(2))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H)) for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(H) for _ in range(5))
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for i in range(2):
            x = x + self.attn[i](self.norms[2 * i](x))
            x = x + self.mlp[i](self.norms[2 * i + 1](x))
        logits = self.head(self.norms[4](x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(kind: str):
    if kind == "joined_conv":
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        return JoinedConvLM(), (torch.randint(0, V, (2, S), generator=g), torch.randint(0, V, (2, S), generator=g)), {}
    cfg = _config(kind)
    model, args, kwargs = hf_build(cfg)
    if kind == "xmod":  # every layer's adapter is picked by language; the config lists one
        model.set_default_language(cfg.languages[0])
    return model, args, kwargs
