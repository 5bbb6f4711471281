"""Hybrid state-space mixers written by hand, in a small LM (width 64, vocab 96, sequence 8), and the Hugging Face
families that use them, built tiny. Every hand-written model is ``(idx, targets) -> (logits, loss)``.

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
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, V, RMSNorm

S = 8
D_INNER, D_STATE, D_CONV, DT_RANK = 2 * H, 8, 4, 4


class NormedMamba(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.in_proj = nn.Linear(H, 2 * D_INNER, bias=False)
        self.conv1d = nn.Conv1d(D_INNER, D_INNER, D_CONV, groups=D_INNER, padding=D_CONV - 1, bias=True)
        self.x_proj = nn.Linear(D_INNER, DT_RANK + 2 * D_STATE, bias=False)
        self.dt_proj = nn.Linear(DT_RANK, D_INNER, bias=True)
        a = torch.arange(1, D_STATE + 1, dtype=torch.float32).repeat(D_INNER, 1)  # (d_inner, n)
        self.A_log = nn.Parameter(torch.log(a) + 0.1 * torch.randn(D_INNER, D_STATE))
        self.D = nn.Parameter(torch.ones(D_INNER) + 0.1 * torch.randn(D_INNER))
        self.out_proj = nn.Linear(D_INNER, H, bias=False)
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


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.norm = RMSNorm(H)
        self.mixer = NormedMamba(kind)

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class LM(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList([Block(kind) for _ in range(2)])
        self.norm = RMSNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


NORMED = ("normed_cumsum", "normed_simple")
HF = ("jamba",)
KINDS = (*NORMED, *HF)


def _jamba():
    from transformers import AutoModelForCausalLM, JambaConfig

    cfg = JambaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_experts=4,
                      num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                      expert_layer_offset=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
                      pad_token_id=0, bos_token_id=0, eos_token_id=0, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # the norms' weights away from 1, so a wrong gradient shows
        for name, p in model.named_parameters():
            if "layernorm" in name and ".mamba." in name:
                p.normal_(1.0, 0.2)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, (), {"input_ids": ids, "labels": ids}


def build(kind: str):
    if kind == "jamba":
        return _jamba()
    torch.manual_seed(0)
    model = LM(kind)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randint(0, V, (2, S), generator=g), torch.randint(0, V, (2, S), generator=g)), {}
