"""The model's own autograd Functions and cached helpers, as state-space, recurrent and RWKV-style model files
spell them: small LMs like tests/support/pattern_models.py's (width 64, 4 heads of 16, seq 12, vocab 96, 2
layers); every model is ``(idx, targets) -> (logits, loss)``.

Loss helpers (forward: the loss unchanged, the logits (b, s, V) saved; backward: the loss's gradient, and a
small term for the logits built over the whole vocab, which a rank holding a part of it cannot build):

- ``loss_max``: a max over the vocab scattered into zeros at the argmax, called by ``MaxTerm.apply``;
- ``loss_argmax``: a one-hot at the argmax, called through an alias bound at import (``argmax_term =
  ArgmaxTerm.apply``);
- ``loss_lse``: the softmax (``exp(logits - logsumexp)``), through ``functools.partial`` with a keyword;
- ``loss_static``: the max term again, held as a ``staticmethod`` on the model class;

a scan (``h_t = a_t * h_{t-1} + x_t`` over the sequence, per feature) whose forward writes its output's views in
place, between a column and a row linear (local to a shard of the features, forward and backward):

- ``scan_alias``: called through ``scan = Scan.apply`` bound at import;
- ``scan_apply``: called as ``Scan.apply``;
- ``scan_allowed``: through ``torch.compiler.allow_in_graph(Scan)``;

an attention whose causal decay mask (s, s) comes from a cached builder of (seq_len, device, dtype):

- ``mask_lru``: ``functools.lru_cache`` at module level;
- ``mask_cache``: ``functools.cache`` as a staticmethod of the attention class;
- ``mask_memo``: a module-level dict memo;

and ``grad_max``: a Function on the attention's output (b, s, H) whose backward divides the gradient by its max
over the features (deliberately not local to a shard of them): its attention runs whole.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import HD, NH, H, V, BlockWith, LMWith, build_with

LOSSES = ("loss_max", "loss_argmax", "loss_lse", "loss_static")
SCANS = ("scan_alias", "scan_apply", "scan_allowed")
MASKS = ("mask_lru", "mask_cache", "mask_memo")
KINDS = (*LOSSES, *SCANS, *MASKS, "grad_max")


class MaxTerm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, logits):
        ctx.save_for_backward(logits)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        top, at = logits.max(dim=-1, keepdim=True)  # (b, s, 1)
        return grad, grad * 1e-2 * torch.zeros_like(logits).scatter(-1, at, top)


class ArgmaxTerm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, logits):
        ctx.save_for_backward(logits)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        at = logits.argmax(dim=-1, keepdim=True)
        return grad, grad * 1e-2 * torch.zeros_like(logits).scatter(-1, at, 1.0)


class LseTerm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, logits, scale=1.0):
        ctx.save_for_backward(logits)
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        p = (logits - logits.logsumexp(dim=-1, keepdim=True)).exp()
        return grad, grad * ctx.scale * p, None


argmax_term = ArgmaxTerm.apply
lse_term = functools.partial(LseTerm.apply, scale=1e-2)


class Scan(torch.autograd.Function):
    """``h_t = a_t * h_{t-1} + x_t`` along dim 1 of (b, s, f), each step written into ``out[:, t]`` in place."""

    @staticmethod
    def forward(ctx, a, x):
        out = torch.empty_like(x)
        h = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            out[:, t] = h
        ctx.save_for_backward(a, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        a, out = ctx.saved_tensors
        ga, gx = torch.zeros_like(a), torch.empty_like(grad)
        g = torch.zeros_like(grad[:, 0])
        for t in reversed(range(grad.shape[1])):
            g = g + grad[:, t]  # dL/dh_t, through every later step
            gx[:, t] = g
            if t > 0:
                ga[:, t] = g * out[:, t - 1]
            g = g * a[:, t]
        return ga, gx


scan = Scan.apply
AllowedScan = torch.compiler.allow_in_graph(type("AllowedScan", (Scan,), {}))


class ScanMix(nn.Module):
    """Token mixing by the scan: a decay and an input (column linears), the scan, an output (row linear)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.decay, self.inp = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        self.out = nn.Linear(H, H, bias=False)

    def forward(self, x):
        a, u = torch.sigmoid(self.decay(x)), self.inp(x)
        if self.kind == "scan_alias":
            y = scan(a, u)
        elif self.kind == "scan_apply":
            y = Scan.apply(a, u)
        else:
            y = AllowedScan.apply(a, u)
        return self.out(y)


def _decay(n: int, device, dtype) -> torch.Tensor:
    i = torch.arange(n, device=device)
    d = (i[:, None] - i[None, :]).to(dtype)
    return torch.where(d >= 0, torch.pow(0.9, d.clamp(min=0)), torch.zeros((), dtype=dtype, device=device))


@functools.lru_cache(maxsize=4)
def lru_mask(n: int, device, dtype) -> torch.Tensor:
    return _decay(n, device, dtype)


MEMO: dict = {}


def memo_mask(n: int, device, dtype) -> torch.Tensor:
    key = (n, device, dtype)
    if key not in MEMO:
        MEMO[key] = _decay(n, device, dtype)
    return MEMO[key]


class Attention(nn.Module):
    """Causal attention, its probabilities weighted by a decay mask from a cached builder (mask kinds), or its
    output through ``GradMax`` (``grad_max``)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.proj = nn.Linear(H, H, bias=False)

    @staticmethod
    @functools.cache
    def cached_mask(n: int, device, dtype) -> torch.Tensor:
        return _decay(n, device, dtype)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split(H, dim=-1)
        q, k, v = (t.view(b, n, NH, HD).transpose(1, 2) for t in (q, k, v))  # (b, h, n, d)
        if self.kind == "mask_lru":
            mask = lru_mask(n, x.device, x.dtype)
        elif self.kind == "mask_cache":
            mask = self.cached_mask(n, x.device, x.dtype)
        elif self.kind == "mask_memo":
            mask = memo_mask(n, x.device, x.dtype)
        else:
            mask = _decay(n, x.device, x.dtype)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(HD)).masked_fill(mask == 0, float("-inf"))
        y = ((scores.softmax(-1) * mask) @ v).transpose(1, 2).reshape(b, n, H)
        if self.kind == "grad_max":
            y = GradMax.apply(y)
        return self.proj(y)


class GradMax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad / grad.abs().amax(dim=-1, keepdim=True)


class LossLM(LMWith):
    """The suite's LM, its loss through a loss helper (``kind``)."""

    term = staticmethod(MaxTerm.apply)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.final_norm(x))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        if self.kind == "loss_max":
            loss = MaxTerm.apply(loss, logits)
        elif self.kind == "loss_argmax":
            loss = argmax_term(loss, logits)
        elif self.kind == "loss_lse":
            loss = lse_term(loss, logits)
        else:
            loss = self.term(loss, logits)
        return logits, loss


def build(kind: str):
    torch.manual_seed(0)
    if kind in LOSSES:
        return build_with(LossLM(kind, Attention))
    return build_with(LMWith(kind, ScanMix if kind in SCANS else Attention))


def clear_caches() -> None:
    """The helpers' caches empty (a test's own start)."""
    lru_mask.cache_clear()
    Attention.cached_mask.cache_clear()
    MEMO.clear()
