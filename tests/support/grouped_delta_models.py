"""Gated delta nets whose fused input projection is laid out per key-head group (Qwen3-Next's, OLMo-Hybrid's), written
by hand in a small LM (width 64, vocab 96, sequence 8), and the Hugging Face families, built tiny. Every
hand-written model is ``(idx, targets) -> (logits, loss)``.

``in_proj_qkvz`` gives ``(b, s, nk·(2·dk + 2·(nv/nk)·dv))``, viewed ``(b, s, nk, group)`` and split per group into
q, k (``dk`` each), v and z (``nv/nk`` value heads of ``dv`` each); ``in_proj_ba`` likewise into β and a (``nv/nk``
each). q, k and v are joined again (``cat``) for the depthwise convolution, split, q and k repeated to the value
heads. Megatron and vLLM cut it by key-head groups: each rank holds whole groups of both projections' rows (a
contiguous run of each, since the groups are outermost), the convolution's channels of its q, k and v, ``dt_bias``
and ``A_log`` of its value heads; the recurrence is local, ``out_proj`` row-parallel; the gated norm's weight
``(dv,)`` is read by every head (whole, its gradient summed over the ranks).

- ``gdn_split``: as Qwen3-Next writes it: ``view`` then ``torch.split`` per group, ``reshape`` back, ``nn.Conv1d``
  with causal padding cropped to the sequence;
- ``gdn_sliced``: ``x @ W.t()`` then ``unflatten``, q, k, v, z, β and a read by slices of the last dim,
  ``flatten`` back, ``F.conv1d`` of an ``F.pad``-ed input;
- ``qwen3_next``: Hugging Face's Qwen3-Next (a gated delta net layer then an attention layer, MoE MLPs);
- ``olmo_hybrid``: Hugging Face's OLMo-Hybrid.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H
from tiny_lm import Residual, TinyLM, hf_build, lm_build

S, D_CONV = 8, 4

NK, NV, DK, DV = 4, 8, 16, 16  # a gated delta net's key heads, value heads (2 per key head) and head dims
GROUP = 2 * DK + 2 * (NV // NK) * DV  # one key-head group's q | k | v | z in the fused projection


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear attention: one projection of q | k | v | z laid out per key-head group
    ``(nk, 2·dk + 2·(nv/nk)·dv)``, one of b | a per group, the depthwise convolution over q | k | v joined, q and k
    repeated to the value heads, the gated delta rule (a Python loop over time), a gated RMS norm per head."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.conv_dim = 2 * NK * DK + NV * DV
        self.in_proj_qkvz = nn.Linear(H, NK * GROUP, bias=False)
        self.in_proj_ba = nn.Linear(H, 2 * NV, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, D_CONV, groups=self.conv_dim, padding=D_CONV - 1,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(NV) + 0.1 * torch.randn(NV))
        self.A_log = nn.Parameter(torch.log(torch.empty(NV).uniform_(1, 16)))
        self.norm_weight = nn.Parameter(torch.ones(DV) + 0.2 * torch.randn(DV))
        self.out_proj = nn.Linear(NV * DV, H, bias=False)

    def forward(self, hidden):
        b, l, _ = hidden.shape
        r = NV // NK
        if self.kind == "gdn_split":
            qkvz = self.in_proj_qkvz(hidden).view(b, l, NK, GROUP)
            q, k, v, z = torch.split(qkvz, [DK, DK, r * DV, r * DV], dim=3)
            beta, a = torch.split(self.in_proj_ba(hidden).view(b, l, NK, 2 * r), [r, r], dim=3)
            v, z = v.reshape(b, l, -1, DV), z.reshape(b, l, -1, DV)
            beta, a = beta.reshape(b, l, NV), a.reshape(b, l, NV)
            q, k, v = (x.reshape(b, l, -1) for x in (q, k, v))
            mixed = torch.cat((q, k, v), dim=-1).transpose(1, 2)
            mixed = F.silu(self.conv1d(mixed)[..., :l]).transpose(1, 2)
        else:  # sliced apart, the convolution of a left-padded input
            qkvz = (hidden @ self.in_proj_qkvz.weight.t()).unflatten(-1, (NK, GROUP))
            q, k = qkvz[..., :DK], qkvz[..., DK:2 * DK]
            v, z = qkvz[..., 2 * DK:2 * DK + r * DV], qkvz[..., 2 * DK + r * DV:]
            ba = self.in_proj_ba(hidden).unflatten(-1, (NK, 2 * r))
            beta, a = ba[..., :r].flatten(2), ba[..., r:].flatten(2)
            v, z = v.flatten(2).unflatten(-1, (NV, DV)), z.flatten(2).unflatten(-1, (NV, DV))
            mixed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=2).transpose(1, 2)
            mixed = F.conv1d(F.pad(mixed, (D_CONV - 1, 0)), self.conv1d.weight, groups=self.conv_dim)
            mixed = F.silu(mixed).transpose(1, 2)
        q, k, v = torch.split(mixed, [NK * DK, NK * DK, NV * DV], dim=-1)
        q, k, v = q.reshape(b, l, NK, DK), k.reshape(b, l, NK, DK), v.reshape(b, l, NV, DV)
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)  # to the value heads
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / DK ** 0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        beta = beta.sigmoid()
        g = -self.A_log.exp() * F.softplus(a + self.dt_bias)  # (b, l, nv)
        state, outs = hidden.new_zeros(b, NV, DK, DV), []
        for t in range(l):
            state = state * g[:, t].exp()[..., None, None]
            kv = (state * k[:, t, :, :, None]).sum(-2)  # (b, nv, dv)
            delta = (v[:, t] - kv) * beta[:, t, :, None]
            state = state + k[:, t, :, :, None] * delta[:, :, None, :]
            outs.append((state * q[:, t, :, :, None]).sum(-2))
        y = torch.stack(outs, dim=1)  # (b, l, nv, dv)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight * F.silu(z)
        return self.out_proj(y.reshape(b, l, NV * DV))



def _lm(kind: str) -> TinyLM:
    """Two blocks of the gated delta net alone."""
    return TinyLM(lambda: Residual(mixer=lambda: GatedDeltaNet(kind)))


GDN = ("gdn_split", "gdn_sliced")
HF = ("qwen3_next", "olmo_hybrid")
KINDS = (*GDN, *HF)
# the families' linear attention as small as the hand-written one: 4 key heads (so tp 4 cuts by groups), 8 value heads
LINEAR = {"linear_num_key_heads": NK, "linear_num_value_heads": NV, "linear_key_head_dim": DK,
          "linear_value_head_dim": DV}


def _hf(family: str):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family]
    have = cls().to_dict()
    sizes = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
             "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 32, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0,
             "use_cache": False, **LINEAR}
    kwargs = {k: v for k, v in sizes.items() if k in have}
    if isinstance(have.get("layer_types"), list):  # a linear-attention layer, then a full-attention one
        kwargs["layer_types"] = ["linear_attention", "full_attention"]
    model, args, kwargs = hf_build(cls(**kwargs))
    with torch.no_grad():  # the gated norms' weights away from 1, so a wrong gradient shows
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name:
                p.normal_(1.0, 0.2)
    return model, args, kwargs


def build(kind: str):
    if kind in HF:
        return _hf(kind)
    return lm_build(lambda: _lm(kind), s=S)
