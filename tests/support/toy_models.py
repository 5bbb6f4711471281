"""Unusual GPT blocks nobody wrote a plan for: each exercises one layout the analysis must recognise."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

H, NH, HD = 64, 4, 16


class InterleavedQKV(nn.Module):
    """One projection laid out per head as [n_heads, 3, head_dim] (GPT-NeoX style)."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.qkv = nn.Linear(H, 3 * H)
        self.out = nn.Linear(H, H)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.ln(x)).view(b, s, NH, 3, HD).permute(0, 2, 1, 3, 4)  # (b, nh, s, 3, hd)
        q, k, v = qkv.unbind(dim=3)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, s, H))


class FusedGQA(nn.Module):
    """Fused q|k|v with unequal segments (4 query heads, 2 kv heads), repeat_kv by expand+reshape."""

    def __init__(self, n_kv: int = 2):
        super().__init__()
        self.n_kv = n_kv
        self.qkv = nn.Linear(H, (NH + 2 * n_kv) * HD, bias=False)
        self.o = nn.Linear(H, H, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([NH * HD, self.n_kv * HD, self.n_kv * HD], dim=-1)
        q = q.view(b, s, NH, HD).transpose(1, 2)
        k = k.view(b, s, self.n_kv, HD).transpose(1, 2)
        v = v.view(b, s, self.n_kv, HD).transpose(1, 2)
        rep = NH // self.n_kv
        k = k[:, :, None].expand(b, self.n_kv, rep, s, HD).reshape(b, NH, s, HD)
        v = v[:, :, None].expand(b, self.n_kv, rep, s, HD).reshape(b, NH, s, HD)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, s, H))


class HandWritten(nn.Module):
    """Raw parameters used as ``x @ W.T``, and a chunked fused gate|up SwiGLU."""

    def __init__(self):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.randn(2 * 4 * H, H) * 0.05)
        self.w_down = nn.Parameter(torch.randn(H, 4 * H) * 0.05)

    def forward(self, x):
        gate, up = (x @ self.w_gate_up.T).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ self.w_down.T


class HeadMixing(nn.Module):
    """Averages over heads inside attention: the heads are not independent, so the pair must stay whole."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(H, H)
        self.o = nn.Linear(HD, H)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, NH, HD)
        return x + self.o(q.mean(dim=2))


class Stack(nn.Module):
    """A toy LM around one of the blocks above: embedding, block, tied head, loss."""

    def __init__(self, block: nn.Module, vocab: int = 96):
        super().__init__()
        self.emb = nn.Embedding(vocab, H)
        self.block = block
        self.head = nn.Linear(H, vocab, bias=False)

    def forward(self, idx, targets):
        logits = self.head(self.block(self.emb(idx)))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class LossForms(nn.Module):
    """A small LM whose loss is one of the cross-entropy forms users write (untied head with a bias)."""

    def __init__(self, kind: str, vocab: int = 97):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(vocab, H)
        self.mlp = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))
        self.head = nn.Linear(H, vocab)

    def forward(self, idx, targets):
        x = self.emb(idx)
        logits = self.head(x + self.mlp(x))
        flat, t = logits.flatten(0, 1), targets.flatten()
        if self.kind == "nll_sum":
            loss = F.nll_loss(F.log_softmax(logits, dim=-1).flatten(0, 1), t, reduction="sum")
        elif self.kind == "smoothing_none":
            loss = F.cross_entropy(flat, t, label_smoothing=0.1, reduction="none").mean()
        else:  # ignore_index, mean
            loss = F.cross_entropy(flat, t.masked_fill(t % 3 == 0, -100))
        return logits, loss


TOYS = {"interleaved": InterleavedQKV, "fused_gqa": FusedGQA, "fused_mqa": lambda: FusedGQA(n_kv=1),
        "handwritten": HandWritten}


LOSSES = ("nll_sum", "smoothing_none", "ignore_mean")


def toy(name: str) -> tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    if name in LOSSES:
        model = LossForms(name)
        g = torch.Generator().manual_seed(1)
        return model, (torch.randint(0, 97, (2, 12), generator=g), torch.randint(0, 97, (2, 12), generator=g)), {}
    model = Stack(TOYS[name]() if name != "head_mixing" else HeadMixing())
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 96, (2, 12), generator=g)
    return model, (idx, torch.randint(0, 96, (2, 12), generator=g)), {}
