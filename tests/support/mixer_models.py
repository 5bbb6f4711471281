"""Channel-parallel mixers from public single-device files, each in a small LM (width 64, vocab 96, sequence 8):
blocks that are not attention, whose inner width (channels) Megatron cuts. Every model is
``(idx, targets) -> (logits, loss)``.

- ``mamba_einsum``: a Mamba-style selective state-space mixer as mamba-minimal writes it: a fused input
  projection ``split`` into x | z, a depthwise ``nn.Conv1d`` with causal padding cropped to the sequence, a
  reducing projection ``x_proj`` split into Δ, B, C, ``dt_proj`` then softplus, ``-exp(A_log)``, the
  discretisation by two- and three-operand ``torch.einsum``, a selective scan written as a Python loop over
  time, ``y + x·D``, gated by ``silu(z)``, an output projection;
- ``mamba_cumsum``: the same mixer as mamba.py writes it, its scan in closed form: ``chunk`` of the input
  projection, ``F.conv1d`` of a left-padded input with the module's weight and ``groups`` = channels, the
  discretisation by broadcasting (``Δ.unsqueeze(-1) * A``), the decays as a ``torch.cumsum`` over time with a
  causal ``masked_fill``, each step's output as a batched ``matmul`` with C;
- ``mamba_simple``: as the reference mamba_simple.py writes it, channels on dim 1 ``(b, d, l)``: the input
  projection and the Δ projection with the weight on the left (``W @ x.t()`` over ``(d, b·l)``, the Δ bias added
  in the scan), ``x_proj`` over ``(b·l, d)``, the scan as selective_scan_ref's Python loop over time from
  ``A.new_zeros((b, d, n))``;
- ``mamba_cumprod``: the same, its scan in closed form: the decays between each two positions by a
  ``torch.cumprod`` over time of ``torch.where(t > s, dA_t, 1.0)``, masked to ``s <= t``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H
from tiny_lm import Residual, TinyLM, lm_build

S = 8  # the scan is a Python loop over time: each step is captured, so the sequence stays short

D_INNER, D_STATE, D_CONV = 2 * H, 8, 4
DT_RANK = math.ceil(H / 16)
LRU_HEADS = 4  # the recurrent block's gates: block-diagonal, 4 blocks of 32 channels


class Mamba(nn.Module):
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

    def forward(self, hidden):
        if self.kind in ("mamba_simple", "mamba_cumprod"):
            return self._simple(hidden)
        return self._einsum(hidden) if self.kind == "mamba_einsum" else self._cumsum(hidden)

    def _simple(self, hidden):
        b, l, _ = hidden.shape
        xz = (self.in_proj.weight @ hidden.reshape(b * l, H).t()).reshape(2 * D_INNER, b, l).permute(1, 0, 2)
        x, z = xz.chunk(2, dim=1)  # (b, d, l)
        x = F.silu(self.conv1d(x)[..., :l])
        x_dbl = self.x_proj(x.transpose(1, 2).reshape(b * l, D_INNER))  # (b·l, r + 2n)
        dt, B, C = torch.split(x_dbl, [DT_RANK, D_STATE, D_STATE], dim=-1)
        dt = (self.dt_proj.weight @ dt.t()).reshape(D_INNER, b, l).permute(1, 0, 2)  # (b, d, l)
        B, C = B.reshape(b, l, D_STATE).transpose(1, 2), C.reshape(b, l, D_STATE).transpose(1, 2)  # (b, n, l)
        A = -torch.exp(self.A_log.float())
        delta = F.softplus(dt + self.dt_proj.bias[..., None])
        dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
        dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, x)
        if self.kind == "mamba_simple":
            h, ys = A.new_zeros((b, D_INNER, D_STATE)), []
            for i in range(l):
                h = dA[:, :, i] * h + dBu[:, :, i]
                ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, i]))
            y = torch.stack(ys, dim=2)
        else:  # h_t = sum over s <= t of (dA_{s+1} ... dA_t) dBu_s: the products by a cumprod over t of dA_t where
            # t > s, else 1, masked to s <= t
            t = torch.arange(l, device=x.device)
            picked = torch.where((t[:, None] > t[None, :])[:, :, None], dA.unsqueeze(3), 1.0)  # (b, d, t, s, n)
            decay = torch.cumprod(picked, dim=2).masked_fill(~(t[:, None] >= t[None, :])[:, :, None], 0.0)
            y = torch.einsum("bdln,bnl->bdl", (decay * dBu.unsqueeze(2)).sum(3), C)
        y = (y + x * self.D[:, None]) * F.silu(z)
        return self.out_proj(y.transpose(1, 2))

    def _einsum(self, hidden):
        b, l, _ = hidden.shape
        x, z = self.in_proj(hidden).split([D_INNER, D_INNER], dim=-1)
        x = self.conv1d(x.transpose(1, 2))[:, :, :l].transpose(1, 2)
        x = F.silu(x)
        A = -torch.exp(self.A_log.float())  # (d_inner, n)
        delta, B, C = self.x_proj(x).split([DT_RANK, D_STATE, D_STATE], dim=-1)
        delta = F.softplus(self.dt_proj(delta))  # (b, l, d_inner)
        dA = torch.exp(torch.einsum("bld,dn->bldn", delta, A))
        dBu = torch.einsum("bld,bln,bld->bldn", delta, B, x)
        h = torch.zeros(b, D_INNER, D_STATE, dtype=x.dtype)
        ys = []
        for i in range(l):
            h = dA[:, i] * h + dBu[:, i]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, i]))
        y = torch.stack(ys, dim=1) + x * self.D
        return self.out_proj(y * F.silu(z))

    def _cumsum(self, hidden):
        b, l, _ = hidden.shape
        x, z = self.in_proj(hidden).chunk(2, dim=-1)
        x = F.conv1d(F.pad(x.transpose(1, 2), (D_CONV - 1, 0)), self.conv1d.weight, self.conv1d.bias,
                     groups=D_INNER)
        x = F.silu(x.transpose(1, 2))
        deltaBC = self.x_proj(x)
        delta, B, C = torch.split(deltaBC, [DT_RANK, D_STATE, D_STATE], dim=-1)
        delta = F.softplus(self.dt_proj(delta))
        A = -torch.exp(self.A_log)
        BX = delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)  # (b, l, d_inner, n)
        # the scan in closed form: h_t = sum over s <= t of exp(sum of Δ·A over (s, t]) · B_s x_s
        cum = torch.cumsum(delta.unsqueeze(-1) * A, dim=1)  # (b, l, d_inner, n)
        causal = torch.tril(torch.ones(l, l, dtype=torch.bool, device=x.device)).view(1, l, l, 1, 1)
        decay = (cum.unsqueeze(2) - cum.unsqueeze(1)).masked_fill(~causal, float("-inf")).exp()  # (b, t, s, d, n)
        hs = (decay * BX.unsqueeze(1)).sum(2)  # (b, l, d_inner, n)
        y = (hs @ C.unsqueeze(-1)).squeeze(3) + self.D * x
        return self.out_proj(y * F.silu(z))


class BlockDiagonalLinear(nn.Module):
    """RecurrentGemma's per-head gate: ``einsum('... h i, h i j -> ... h j')`` over blocks of the channels."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.w = nn.Parameter(torch.randn(heads, width // heads, width // heads) / (width // heads) ** 0.5)
        self.b = nn.Parameter(0.1 * torch.randn(heads, width // heads))

    def forward(self, x):
        x = x.reshape(*x.shape[:-1], self.heads, -1)
        y = torch.einsum("... h i, h i j -> ... h j", x, self.w) + self.b
        return y.reshape(*y.shape[:-2], -1)


class ShiftedConv1D(nn.Module):
    """RecurrentGemma's temporal convolution: shifted windows of the input, each left-padded with zeros made in
    the forward (``griffin``: ``torch.zeros`` and ``torch.concatenate``; ``hawk``: ``x.new_zeros`` and
    ``torch.cat``), weighted by one row of ``w`` each."""

    def __init__(self, kind: str, width: int, temporal_width: int = D_CONV):
        super().__init__()
        self.kind, self.temporal_width = kind, temporal_width
        self.w = nn.Parameter(torch.randn(temporal_width, width) / temporal_width)
        self.b = nn.Parameter(0.1 * torch.randn(width))

    def forward(self, x):
        b, l, width = x.shape
        out = 0.0
        for shift in range(self.temporal_width):
            window = x[:, :l - shift]
            if self.kind == "griffin":
                pad = torch.zeros((b, shift, width), dtype=x.dtype, device=x.device)
                window = torch.concatenate([pad, window], dim=1)
            else:
                window = torch.cat([x.new_zeros(b, shift, width), window], dim=1)
            out = out + window * self.w[self.temporal_width - shift - 1]
        return out + self.b


class RGLRU(nn.Module):
    """The real-gated linear recurrent unit: per-head input and recurrence gates, a per-channel decay
    ``a_param``, the state reset at the first position; the recurrence as a Python loop over time
    (``griffin``) or in closed form by a ``torch.cumsum`` of the log decays (``hawk``)."""

    def __init__(self, kind: str, width: int, heads: int):
        super().__init__()
        self.kind = kind
        self.a_param = nn.Parameter(torch.rand(width) + 0.5)
        self.input_gate, self.a_gate = BlockDiagonalLinear(width, heads), BlockDiagonalLinear(width, heads)

    def forward(self, x):
        b, l, width = x.shape
        reset = (torch.arange(l, device=x.device) == 0)[None, :, None]  # (1, l, 1)
        gate_x, gate_a = torch.sigmoid(self.input_gate(x)), torch.sigmoid(self.a_gate(x))
        log_a = -8.0 * gate_a * F.softplus(self.a_param)
        a, a_square = torch.exp(log_a), torch.exp(2 * log_a)
        multiplier = reset + ~reset * torch.sqrt(1 - a_square)
        normalized = x * gate_x * multiplier
        a = a * ~reset
        if self.kind == "griffin":
            h = torch.zeros(b, width, dtype=x.dtype, device=x.device)
            ys = []
            for t in range(l):
                h = a[:, t] * h + normalized[:, t]
                ys.append(h)
            return torch.stack(ys, dim=1)
        # h_t = sum over s <= t of (a_{s+1} ... a_t) x_s: the products of a as differences of a cumulative sum of
        # log a (the state reset at the first position), masked to s <= t
        cum = torch.cumsum(log_a * ~reset, dim=1)  # (b, l, width)
        causal = torch.tril(torch.ones(l, l, dtype=torch.bool, device=x.device)).view(1, l, l, 1)
        decay = (cum.unsqueeze(2) - cum.unsqueeze(1)).masked_fill(~causal, float("-inf")).exp()  # (b, t, s, width)
        return (decay * normalized.unsqueeze(1)).sum(2)


class Recurrent(nn.Module):
    """RecurrentGemma's recurrent block: a GELU branch and a convolved, gated-recurrent branch of the channels,
    multiplied, then the output projection."""

    def __init__(self, kind: str):
        super().__init__()
        self.linear_y, self.linear_x = nn.Linear(H, D_INNER), nn.Linear(H, D_INNER)
        self.conv_1d = ShiftedConv1D(kind, D_INNER)
        self.rg_lru = RGLRU(kind, D_INNER, LRU_HEADS)
        self.linear_out = nn.Linear(D_INNER, H)

    def forward(self, x):
        y = F.gelu(self.linear_y(x), approximate="tanh")
        x = self.rg_lru(self.conv_1d(self.linear_x(x)))
        return self.linear_out(x * y)


def _lm(kind: str) -> TinyLM:
    """Two blocks of the mixer alone."""
    return TinyLM(lambda: Residual(mixer=lambda: Mamba(kind) if kind in MAMBA else Recurrent(kind)))


MAMBA = ("mamba_einsum", "mamba_cumsum", "mamba_simple", "mamba_cumprod")
RECURRENT = ("griffin", "hawk")
KINDS = (*MAMBA, *RECURRENT)


def build(kind: str):
    return lm_build(lambda: _lm(kind), s=S)
