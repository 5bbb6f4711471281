"""Hybrid state-space and linear-attention mixers written by hand, in a small LM (width 64, vocab 96, sequence
8), and the Hugging Face families that use them, built tiny. Every hand-written model is
``(idx, targets) -> (logits, loss)``.

A Mamba-1 mixer whose Δ, B and C are normalized after the reducing projection (Jamba's): ``x_proj`` gives
``(b, l, r + 2n)``, split into Δ, B, C, each RMS-normalized over its own width with a weight, then Δ
projected back to the channels by ``dt_proj``. Megatron-style: ``x_proj`` row-parallel with one all-reduce of
its small output, the norms run whole on every rank (their weights' gradients summed over the ranks, each
rank's channels giving a part), ``dt_proj`` column-parallel.

- ``normed_cumsum``: channels last, a fused input projection ``chunk`` into x | z, ``F.conv1d`` of a left-padded
  input, the norms written (``x * rsqrt(mean(x²) + eps) * w``), ``dt_proj`` an ``nn.Linear``, the scan in
  closed form (a ``cumsum`` of Δ·A over time);
- ``normed_simple``: channels on dim 1 ``(b, d, l)`` as Jamba writes it: the norms by ``F.rms_norm`` with their
  weights, ``dt_proj``'s weight on the left (``W @ Δ.transpose(1, 2)``), its bias added in the scan, the scan as
  a Python loop over time;
- ``jamba``: Hugging Face's Jamba (a Mamba layer then an attention layer with 4 experts) on ``input_ids`` and
  ``labels``.

Linear-attention mixers whose heads are regrouped under the batch (``(b, s, h·d) -> (b·h, s, d)``), 4 heads
(key dim 16, value dim 32), cut by heads as Megatron cuts Qwen3.5's gated-delta-net: the input projections
column-parallel (per segment where fused), the convolution and the per-head decay parameters by heads, the
recurrence local, the output projection row-parallel; the gated norm's weight ``(d_v,)`` is read by every head
(whole, its gradient summed over the ranks).

- ``delta_loop``: a gated delta rule as Qwen3.5 / fla's recurrent reference writes it, from one fused input
  projection ``split`` into segments of unequal sizes ``q | k | v | z | β | a`` (64, 64, 128, 128, 4, 4), a
  depthwise ``F.conv1d`` over ``q | k | v`` left-padded by ``F.pad``, q and k L2-normalized, the decay
  ``-exp(A_log)·softplus(a + dt_bias)``, the state ``(b·h, d_k, d_v)`` stepped by ``bmm`` in a Python loop over
  time, the gated RMS norm on ``(b·s·h, d_v)`` then ``(b, s, h·d_v)``;
- ``linear_closed``: gated linear attention in closed form, one ``nn.Linear`` per input (q, k, v, the output
  gate, the per-head forget gate), the heads folded by ``permute`` and ``flatten(0, 1)``, q and k divided by
  their norms, the decays as differences of a ``cumsum`` over time of ``logsigmoid`` gates on ``(b·h, s)``,
  the scores and output by ``torch.bmm``, the per-head RMS norm by ``F.rms_norm`` on ``(b, s, h, d_v)`` gated
  by ``sigmoid``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mixer_models import D_CONV, D_INNER, D_STATE, DT_RANK, Mamba  # the same sizes as mixer_models' Mamba
from pattern_models import H, RMSNorm
from tiny_lm import Residual, TinyLM, hf_build, lm_build

S = 8


class NormedMamba(Mamba):
    """tests/support/mixer_models.py's Mamba (its parameters, made in its order) with RMS norms on dt, B and C."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.dt_norm, self.b_norm, self.c_norm = RMSNorm(DT_RANK), RMSNorm(D_STATE), RMSNorm(D_STATE)
        for norm in (self.dt_norm, self.b_norm, self.c_norm):  # weights away from 1, so a wrong gradient shows
            nn.init.normal_(norm.weight, 1.0, 0.2)

    def forward(self, hidden):
        return self._simple(hidden) if self.kind == "normed_simple" else self._cumsum(hidden)

    def _cumsum(self, hidden):
        b, l, _ = hidden.shape
        x, z = self.in_proj(hidden).chunk(2, dim=-1)
        x = F.conv1d(F.pad(x.transpose(1, 2), (D_CONV - 1, 0)), self.conv1d.weight, self.conv1d.bias,
                     groups=D_INNER)
        x = F.silu(x.transpose(1, 2))
        delta, B, C = torch.split(self.x_proj(x), [DT_RANK, D_STATE, D_STATE], dim=-1)
        delta, B, C = self.dt_norm(delta), self.b_norm(B), self.c_norm(C)
        delta = F.softplus(self.dt_proj(delta))  # (b, l, d_inner)
        A = -torch.exp(self.A_log)
        BX = delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)  # (b, l, d_inner, n)
        cum = torch.cumsum(delta.unsqueeze(-1) * A, dim=1)  # (b, l, d_inner, n)
        causal = torch.tril(torch.ones(l, l, dtype=torch.bool, device=x.device)).view(1, l, l, 1, 1)
        decay = (cum.unsqueeze(2) - cum.unsqueeze(1)).masked_fill(~causal, float("-inf")).exp()  # (b, t, s, d, n)
        hs = (decay * BX.unsqueeze(1)).sum(2)
        y = (hs @ C.unsqueeze(-1)).squeeze(3) + self.D * x
        return self.out_proj(y * F.silu(z))

    def _simple(self, hidden):
        b, l, _ = hidden.shape
        x, z = self.in_proj(hidden).transpose(1, 2).chunk(2, dim=1)  # (b, d, l)
        x = F.silu(self.conv1d(x)[..., :l])
        dt, B, C = torch.split(self.x_proj(x.transpose(1, 2)), [DT_RANK, D_STATE, D_STATE], dim=-1)
        dt = F.rms_norm(dt, (DT_RANK,), self.dt_norm.weight, 1e-6)
        B = F.rms_norm(B, (D_STATE,), self.b_norm.weight, 1e-6)
        C = F.rms_norm(C, (D_STATE,), self.c_norm.weight, 1e-6)
        dt = self.dt_proj.weight @ dt.transpose(1, 2)  # (b, d, l)
        delta = F.softplus(dt + self.dt_proj.bias[:, None])
        A = -torch.exp(self.A_log.float())
        dA = torch.exp(A[None, :, None, :] * delta[..., None])  # (b, d, l, n)
        dBu = delta[..., None] * B[:, None] * x[..., None]
        h, ys = A.new_zeros((b, D_INNER, D_STATE)), []
        for i in range(l):
            h = dA[:, :, i] * h + dBu[:, :, i]
            ys.append((h @ C[:, i, :, None])[..., 0])
        y = (torch.stack(ys, dim=-1) + x * self.D[:, None]) * F.silu(z)
        return self.out_proj(y.transpose(1, 2))


NL, DK, DV = 4, 16, 32  # the linear-attention mixers' heads, key and value dims


class DeltaNet(nn.Module):
    """``delta_loop``: a gated delta rule over heads folded under the batch (see the module's doc)."""

    def __init__(self):
        super().__init__()
        self.sizes = [NL * DK, NL * DK, NL * DV, NL * DV, NL, NL]  # q | k | v | z | β | a
        self.in_proj = nn.Linear(H, sum(self.sizes), bias=False)
        conv = 2 * NL * DK + NL * DV
        self.conv1d = nn.Conv1d(conv, conv, D_CONV, groups=conv, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, NL + 1, dtype=torch.float32)))
        self.dt_bias = nn.Parameter(0.1 * torch.randn(NL))
        self.norm_weight = nn.Parameter(1.0 + 0.2 * torch.randn(DV))  # away from 1, so a wrong gradient shows
        self.out_proj = nn.Linear(NL * DV, H, bias=False)

    def forward(self, hidden):
        b, l, _ = hidden.shape
        q, k, v, z, beta, a = torch.split(self.in_proj(hidden), self.sizes, dim=-1)
        qkv = F.conv1d(F.pad(torch.cat([q, k, v], -1).transpose(1, 2), (D_CONV - 1, 0)), self.conv1d.weight,
                       groups=self.conv1d.in_channels)
        q, k, v = torch.split(F.silu(qkv.transpose(1, 2)), [NL * DK, NL * DK, NL * DV], dim=-1)
        # heads regrouped under the batch: (b, l, h·d) -> (b·h, l, d)
        q, k = (F.normalize(t.view(b, l, NL, DK), dim=-1).transpose(1, 2).reshape(b * NL, l, DK) for t in (q, k))
        v = v.view(b, l, NL, DV).transpose(1, 2).reshape(b * NL, l, DV)
        g = -self.A_log.exp() * F.softplus(a + self.dt_bias)  # (b, l, h)
        g, beta = (t.transpose(1, 2).reshape(b * NL, l) for t in (g, beta.sigmoid()))
        q = q * DK ** -0.5
        state, ys = q.new_zeros(b * NL, DK, DV), []
        for t in range(l):
            state = state * g[:, t].exp()[:, None, None]
            kv_mem = torch.bmm(k[:, t, None], state)[:, 0]  # (b·h, d_v)
            delta = (v[:, t] - kv_mem) * beta[:, t, None]
            state = state + torch.bmm(k[:, t, :, None], delta[:, None])
            ys.append(torch.bmm(q[:, t, None], state)[:, 0])
        y = torch.stack(ys, 1).view(b, NL, l, DV).transpose(1, 2).reshape(b * l * NL, DV)  # (b·l·h, d_v)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        y = y * F.silu(z.unflatten(-1, (NL, DV)).flatten(0, 2))
        return self.out_proj(y.reshape(b, l, NL * DV))


class GatedLinearAttention(nn.Module):
    """``linear_closed``: gated linear attention in closed form over heads folded under the batch."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(H, NL * DK, bias=False), nn.Linear(H, NL * DK, bias=False)
        self.v_proj, self.g_proj = nn.Linear(H, NL * DV, bias=False), nn.Linear(H, NL * DV, bias=False)
        self.gk_proj = nn.Linear(H, NL, bias=True)  # one forget gate per head and position
        self.norm_weight = nn.Parameter(1.0 + 0.2 * torch.randn(DV))
        self.o_proj = nn.Linear(NL * DV, H, bias=False)

    def forward(self, x):
        b, l, _ = x.shape
        q, k = (p(x).view(b, l, NL, DK).permute(0, 2, 1, 3).flatten(0, 1) for p in (self.q_proj, self.k_proj))
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)  # unit rows: the scores bounded by 1
        v = self.v_proj(x).view(b, l, NL, DV).permute(0, 2, 1, 3).flatten(0, 1)  # (b·h, l, d_v)
        cum = F.logsigmoid(self.gk_proj(x)).permute(0, 2, 1).flatten(0, 1).cumsum(-1)  # (b·h, l)
        # the decay from position s to t: exp(cum_t - cum_s) for s <= t
        causal = torch.ones(l, l, dtype=torch.bool, device=x.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # (b·h, t, s)
        scores = torch.bmm(q, k.transpose(1, 2)) * DK ** -0.5 * decay
        y = torch.bmm(scores, v).unflatten(0, (b, NL)).permute(0, 2, 1, 3)  # (b, l, h, d_v)
        y = F.rms_norm(y, (DV,), self.norm_weight, 1e-5)  # eps 1e-5: rows near 0 at the first positions
        y = y * torch.sigmoid(self.g_proj(x)).view(b, l, NL, DV)
        return self.o_proj(y.flatten(2))


def _mixer(kind: str) -> nn.Module:
    if kind == "delta_loop":
        return DeltaNet()
    return GatedLinearAttention() if kind == "linear_closed" else NormedMamba(kind)


def _lm(kind: str) -> TinyLM:
    """Two blocks of the mixer alone."""
    return TinyLM(lambda: Residual(mixer=lambda: _mixer(kind)))


NORMED = ("normed_cumsum", "normed_simple")
LINEAR = ("delta_loop", "linear_closed")
HF = ("jamba",)
KINDS = (*NORMED, *LINEAR, *HF)


def _jamba():
    from transformers import JambaConfig

    cfg = JambaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_experts=4,
                      num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                      expert_layer_offset=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
                      pad_token_id=0, bos_token_id=0, eos_token_id=0, use_cache=False)
    model, args, kwargs = hf_build(cfg)
    with torch.no_grad():  # the norms' weights away from 1, so a wrong gradient shows
        for name, p in model.named_parameters():
            if "layernorm" in name and ".mamba." in name:
                p.normal_(1.0, 0.2)
    return model, args, kwargs


def build(kind: str):
    if kind == "jamba":
        return _jamba()
    return lm_build(lambda: _lm(kind), s=S)
