"""Mamba-2 mixers (state-space duality) written by hand, in a small LM (width 64, vocab 96, sequence 8), and
Hugging Face's Bamba built tiny. Every hand-written model is ``(idx, targets) -> (logits, loss)``.

The mixer as mamba_ssm's Mamba2 lays it out: one input projection ``[z | x | B | C | dt]`` (d_inner 128,
groups of B and C states 4·8 each, 8 heads), a depthwise causal ``conv1d`` over ``x | B | C``, x viewed as
8 heads of 16, B and C as 4 groups of 8 states read by the 2 heads of each group, a scalar decay per head
(``-exp(A_log)``, Δ = softplus(dt + dt_bias)), ``y + x·D``, the gated RMS norm over each group's 32 channels
(``norm(y · silu(z))``) and an output projection. Megatron cuts it by groups: each rank holds whole groups
and their heads, so the group norm stays local; with fewer groups than ranks no exact cut exists.

- ``ssd_loop``: the scan as a Python loop over time (state ``(b, heads, head_dim, n)``, from the first
  position's input, the decays ``exp(Δ·A)`` computed before it), B and C repeated to
  the heads by ``repeat_interleave``, the conv by ``nn.Conv1d`` with causal padding cropped to the sequence;
- ``ssd_closed``: the scan in closed form (the decays between positions from a ``cumsum`` of Δ·A, masked
  causally, ``einsum`` of C·B and of the scores with x), B and C broadcast to the heads by ``expand`` and
  ``reshape``, the conv by ``F.conv1d`` of a left-padded input, the projection by ``x @ W.t()``;
- ``ssd_one_group``: ``ssd_loop`` with one group (Mamba-2 2.7B's layout): its norm spans every head;
- ``bamba``: Hugging Face's Bamba (a Mamba-2 layer then an attention layer, 8 SSM heads of 16 in 4 groups of
  16 states, chunks of 4 positions) on ``input_ids`` and ``labels``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H
from tiny_lm import Residual, TinyLM, hf_build, lm_build

S = 8
D_INNER, HEADS, GROUPS, D_STATE, D_CONV = 2 * H, 8, 4, 8, 4
HEAD_DIM = D_INNER // HEADS


class Mamba2(nn.Module):
    def __init__(self, kind: str, groups: int = GROUPS):
        super().__init__()
        self.kind, self.groups = kind, groups
        self.conv_dim = D_INNER + 2 * groups * D_STATE
        self.in_proj = nn.Linear(H, D_INNER + self.conv_dim + HEADS, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, D_CONV, groups=self.conv_dim, padding=D_CONV - 1)
        self.dt_bias = nn.Parameter(0.1 * torch.randn(HEADS))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, HEADS + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(HEADS) + 0.1 * torch.randn(HEADS))
        self.norm_weight = nn.Parameter(torch.ones(D_INNER) + 0.1 * torch.randn(D_INNER))
        self.out_proj = nn.Linear(D_INNER, H, bias=False)

    def forward(self, hidden):
        b, l, _ = hidden.shape
        gn = self.groups * D_STATE
        if self.kind == "ssd_closed":
            zxbcdt = hidden @ self.in_proj.weight.t()
        else:
            zxbcdt = self.in_proj(hidden)
        z, xbc, dt = torch.split(zxbcdt, [D_INNER, self.conv_dim, HEADS], dim=-1)
        if self.kind == "ssd_closed":
            xbc = F.conv1d(F.pad(xbc.transpose(1, 2), (D_CONV - 1, 0)), self.conv1d.weight, self.conv1d.bias,
                           groups=self.conv_dim)
        else:
            xbc = self.conv1d(xbc.transpose(1, 2))[..., :l]
        x, B, C = torch.split(F.silu(xbc.transpose(1, 2)), [D_INNER, gn, gn], dim=-1)
        x = x.reshape(b, l, HEADS, HEAD_DIM)
        B, C = B.reshape(b, l, self.groups, D_STATE), C.reshape(b, l, self.groups, D_STATE)
        dt = F.softplus(dt + self.dt_bias)  # (b, l, heads)
        A = -torch.exp(self.A_log)  # (heads,)
        y = self._closed(x, B, C, dt, A) if self.kind == "ssd_closed" else self._loop(x, B, C, dt, A)
        y = y + x * self.D[:, None]
        y = y.reshape(b, l, D_INNER) * F.silu(z)
        # the gated norm over each group's channels: (b, l, groups, d_inner / groups)
        g = y.view(b, l, self.groups, D_INNER // self.groups)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-5)
        return self.out_proj(g.view(b, l, D_INNER) * self.norm_weight)

    def _loop(self, x, B, C, dt, A):
        b, l = x.shape[:2]
        rep = HEADS // self.groups
        B, C = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)  # (b, l, heads, n)
        decay = torch.exp(dt * A)  # (b, l, heads)
        ys = []
        for t in range(l):  # the state (b, heads, head_dim, n), from the first position's input
            dbx = (dt[:, t, :, None] * x[:, t]).unsqueeze(-1) * B[:, t].unsqueeze(2)
            h = dbx if t == 0 else decay[:, t, :, None, None] * h + dbx
            ys.append((h @ C[:, t].unsqueeze(-1)).squeeze(-1))  # (b, heads, head_dim)
        return torch.stack(ys, dim=1)

    def _closed(self, x, B, C, dt, A):
        b, l = x.shape[:2]
        rep = HEADS // self.groups
        B = B.unsqueeze(3).expand(b, l, self.groups, rep, D_STATE).reshape(b, l, HEADS, D_STATE)
        C = C.unsqueeze(3).expand(b, l, self.groups, rep, D_STATE).reshape(b, l, HEADS, D_STATE)
        # h_t = sum over s <= t of exp(sum of Δ·A over (s, t]) · Δ_s B_s x_s, y_t = C_t · h_t
        cum = torch.cumsum(dt * A, dim=1)  # (b, l, heads)
        causal = torch.tril(torch.ones(l, l, dtype=torch.bool, device=x.device)).view(1, l, l, 1)
        decay = (cum.unsqueeze(2) - cum.unsqueeze(1)).masked_fill(~causal, float("-inf")).exp()  # (b, t, s, heads)
        scores = torch.einsum("bthn,bshn->btsh", C, B) * decay * dt.unsqueeze(1)
        return torch.einsum("btsh,bshp->bthp", scores, x)


def _lm(kind: str, groups: int = GROUPS) -> TinyLM:
    """Two blocks of the Mamba-2 mixer alone."""
    return TinyLM(lambda: Residual(mixer=lambda: Mamba2(kind, groups)))


KINDS = ("ssd_loop", "ssd_closed", "ssd_one_group", "bamba")


def _bamba():
    from transformers import BambaConfig

    cfg = BambaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=4, mamba_d_state=16,
                      mamba_chunk_size=4, pad_token_id=0, bos_token_id=0, eos_token_id=0, use_cache=False)
    return hf_build(cfg)


def build(kind: str):
    if kind == "bamba":
        return _bamba()
    one = kind == "ssd_one_group"  # the loop with a single group of B/C
    return lm_build(lambda: _lm("ssd_loop" if one else kind, 1 if one else GROUPS), s=S)
