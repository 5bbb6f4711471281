"""Small GPTs whose forward writes state on the model, in the spellings public model files use: the loss kept
on the model (``self.last_loss``) and ``None`` when sampling, rotary and mask caches built on first use with a
``reset_cache()`` that reads them, a dict of caches, a flag and a length kept in Python, and a complex-number
rotary table (``torch.polar``) re-assigned to itself every call (``self.freqs_cis = self.freqs_cis.to(dev)``),
at the root or in a submodule; the last position's logits and the ids kept on the model. Every model is ``(idx, targets=None) -> logits`` with 2 blocks, width 32,
4 heads."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

V, H, NH, S = 64, 32, 4, 8
HD = H // NH


def polar_table(n: int) -> torch.Tensor:
    """(n, HD/2) complex: the reference Llama's ``precompute_freqs_cis``."""
    freqs = 1.0 / (10000.0 ** (torch.arange(0, HD, 2)[: HD // 2].float() / HD))
    return torch.polar(torch.ones(n, HD // 2), torch.outer(torch.arange(n).float(), freqs))


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x (b, s, nh, hd) rotated by the complex table (s, hd/2): view_as_complex, multiply, view_as_real."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * table[None, :, None, :]).flatten(3).type_as(x)


def cos_sin(n: int, device: torch.device) -> torch.Tensor:
    """(n, HD) cos and (n, HD) sin stacked on a last dim: a real-valued rotary cache."""
    freqs = 1.0 / (10000.0 ** (torch.arange(0, HD, 2, device=device).float() / HD))
    ang = torch.outer(torch.arange(n, device=device).float(), freqs).repeat(1, 2)
    return torch.stack((ang.cos(), ang.sin()), -1)


def rotate_cached(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    cos, sin = cache[: x.shape[1], None, :, 0], cache[: x.shape[1], None, :, 1]
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat((-b, a), -1) * sin


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(H, H, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (w(x).view(b, n, NH, HD) for w in (self.wq, self.wk, self.wv))
        q, k = rope(q), rope(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = q @ k.transpose(-2, -1) / math.sqrt(HD)
        if mask is None:
            mask = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask[:n, :n], float("-inf"))
        return self.wo((F.softmax(att, -1) @ v).transpose(1, 2).reshape(b, n, H))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.attn = Attention()
        self.up, self.down = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x, rope, mask=None):
        x = x + self.attn(self.n1(x), rope, mask)
        return x + self.down(F.gelu(self.up(self.n2(x))))


class Rope(nn.Module):
    """The complex table as a submodule's buffer, re-assigned to itself by the submodule's own forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freqs", polar_table(2 * S), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.freqs = self.freqs.to(x.device)
        return self.freqs[: x.shape[1]]


class GPT(nn.Module):
    def __init__(self, style: str, blocks: int = 2):
        super().__init__()
        self.style = style
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)
        if style in ("complex_root", "kept_outputs"):
            self.register_buffer("freqs_cis", polar_table(2 * S), persistent=False)
        elif style in ("complex_sub", "counter"):
            self.rope = Rope()
            if style == "counter":  # a plain tensor attribute the forward counts its calls in
                self.calls = torch.zeros(())
        elif style == "lazy_caches":
            self.rope_cache = self.mask_cache = None
            self.max_seq_length = S
        elif style == "dict_cache":
            self.caches: dict[str, torch.Tensor] = {}
            self.seq_len_cached = 0
            self.ready = False
        self.last_loss = None

    def reset_cache(self) -> None:
        """lit-gpt's spelling: rebuilt where the cache already is (fails on a cache that was never written)."""
        self.rope_cache = cos_sin(self.max_seq_length, self.rope_cache.device)

    def _rope(self, idx: torch.Tensor):
        n = idx.shape[1]
        if self.style in ("complex_root", "kept_outputs"):
            self.freqs_cis = self.freqs_cis.to(idx.device)
            table = self.freqs_cis[:n]
            return (lambda x: rotate(x, table)), None
        if self.style in ("complex_sub", "counter"):
            table = self.rope(idx)
            return (lambda x: rotate(x, table)), None
        if self.style == "lazy_caches":
            if self.rope_cache is None:
                self.rope_cache = cos_sin(self.max_seq_length, idx.device)
            if self.mask_cache is None:
                self.mask_cache = torch.ones(self.max_seq_length, self.max_seq_length, dtype=torch.bool,
                                             device=idx.device).tril()
            cache = self.rope_cache
            return (lambda x: rotate_cached(x, cache)), self.mask_cache
        if "rope" not in self.caches or self.seq_len_cached < n:
            self.caches["rope"] = cos_sin(n, idx.device)
            self.seq_len_cached = n
            self.ready = True
        cache = self.caches["rope"]
        return (lambda x: rotate_cached(x, cache)), None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        rope, mask = self._rope(idx)
        if self.style == "counter":  # re-assigned every call: each call reads the count the last one wrote
            self.calls = self.calls + 1
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x, rope, mask)
        logits = self.head(self.norm(x))
        if targets is not None:
            self.last_loss = F.cross_entropy(logits.view(-1, V), targets.view(-1))  # llama2.c: loss on the model
        else:
            self.last_loss = None
        if self.style == "kept_outputs":  # the last position's logits per sample, and the ids, kept on the model
            self.last_logits = logits[:, -1, :]
            self.last_idx = idx
        return logits


STYLES = ["complex_root", "complex_sub", "lazy_caches", "dict_cache", "counter"]
# a pipeline's micro-batches: per-sample values and inputs kept on the model (tests/runtime/test_written_state.py)
PIPELINE_STYLES = [*STYLES, "kept_outputs"]


def build(style: str, blocks: int = 2) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """``style``'s model with ``blocks`` blocks (from 3 on, capture exports a few and copies the rest) and a
    batch of inputs and targets."""
    torch.manual_seed(0)
    model = GPT(style, blocks)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randint(0, V, (2, S), generator=g), torch.randint(0, V, (2, S), generator=g))
