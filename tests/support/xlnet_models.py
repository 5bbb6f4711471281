"""Attention whose weights are raw ``(d_model, n_head, d_head)`` parameters (XLNet's), in small LMs of their own
(width 64, 4 heads of 16, vocab 96, sequence 12), and Hugging Face's XLNet built tiny. Megatron's cut is by
heads: q, k, v (and a relative-position projection r) column-parallel on their head dim, the per-head biases
cut with them, the output projection row-parallel over its (heads, d_head) dims. Every hand-written model is
``(idx, targets) -> (logits, loss)``.

- ``einsum``: XLNet's spelling, ``einsum("bsh,hnd->bsnd", x, W)`` for q, k, v, a relative-position key
  ``einsum("jh,hnd->jnd", pos, R)`` of a sinusoidal table (no gradient reaches it), content and position
  scores with their per-head biases (``r_w_bias``, ``r_r_bias`` (n, d)), the output
  ``einsum("bsnd,hnd->bsh", a, O)`` contracting two dims;
- ``matmul``: the same weights read as matrices, ``(x @ W.reshape(h, -1)).view(b, s, n, d)`` for q, k, v and
  ``a.flatten(2) @ O.flatten(1).t()`` for the output, and one column by ``torch.tensordot(x, W, dims=1)``;
- ``stored_nd``: the einsum spelling with each weight stored ``(n_head, d_head, d_model)``
  (``einsum("bsh,ndh->bsnd", x, W)``, ``einsum("bsnd,ndh->bsh", a, O)``): the merged dims lead, cut on the first;
- ``two_stream``: XLNet's two-stream attention: the content stream h and the query stream g (a learned
  embedding per position), the query weight read by both (k and v by h alone), each stream's attention
  (g's blind to its own position's content) projected by the one output weight and normed; the feed-forward,
  shared by both streams, applied to each; the query stream starts from one learned ``(1, 1, h)`` embedding (XLNet's
  ``mask_emb``) and the loss is read from it. Per layer forward one all-reduce per stream
  through the output projection and one per stream through the feed-forward;
- ``xlnet``: Hugging Face's XLNetLMHeadModel (2 layers, as benchmarks/op_coverage.py builds it) on
  ``input_ids`` and ``labels``: its plain training call computes the content stream alone;
- ``xlnet_two_stream``: the same model called with ``perm_mask`` and ``target_mapping`` (the last 2 positions
  predicted, hidden from every position): both streams, the query stream's output read by the LM head;
- ``xlnet_segments``: the plain call with ``token_type_ids`` (two segments): the segment score reads
  ``r_s_bias`` (n, d) and ``seg_embed`` (2, n, d) per head (``einsum("ibnd,snd->ibns", ..)``), cut with the heads.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, HD, NH, S, V

KINDS = ("einsum", "matmul", "stored_nd", "two_stream", "xlnet", "xlnet_two_stream", "xlnet_segments")
# the same attention with heads the tp of the test does not split (``kind:heads``; tp 2 for 3 heads, tp 4 for 2):
# the hand-written spellings (heads of 16, so the width stays 64 and its (h, n, d) weights (64, n, 16)), and
# Hugging Face's XLNet with two segments (d_model 16·n: r_s_bias (n, 16) and seg_embed (2, n, 16) read per head)
INDIVISIBLE = {"einsum:3": 2, "matmul:3": 2, "stored_nd:3": 2, "two_stream:3": 2, "xlnet_segments:3": 2,
               "einsum:2": 4, "matmul:2": 4, "stored_nd:2": 4, "two_stream:2": 4, "xlnet_segments:2": 4}


def _heads(g: torch.Generator, n: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(H, n, HD, generator=g) * 0.08)


def _positions(s: int) -> torch.Tensor:
    """A sinusoidal table (s, H) of the relative distances s-1 .. 0, as XLNet's (made from sizes alone)."""
    inv = 1.0 / (10000 ** (torch.arange(0, H, 2).float() / H))
    ang = torch.arange(s - 1, -1, -1.0)[:, None] * inv[None]
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


def _causal(s: int) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool).triu(1)


class EinsumAttention(nn.Module):
    def __init__(self, kind: str, n: int = NH):
        super().__init__()
        self.kind, self.n = kind, n
        g = torch.Generator().manual_seed(3)
        self.q, self.k, self.v, self.o, self.r = (_heads(g, n) for _ in range(5))
        if kind == "stored_nd":  # each weight stored (n, d, h): its merged dims lead, the heads outermost
            self.q, self.k, self.v, self.o, self.r = (nn.Parameter(w.detach().permute(1, 2, 0).contiguous())
                                                      for w in (self.q, self.k, self.v, self.o, self.r))
        self.r_w_bias = nn.Parameter(torch.randn(n, HD, generator=g) * 0.1)
        self.r_r_bias = nn.Parameter(torch.randn(n, HD, generator=g) * 0.1)

    def _project(self, x, w):  # (b, s, h) -> (b, s, n, d)
        if self.kind == "einsum":
            return torch.einsum("bsh,hnd->bsnd", x, w)
        if self.kind == "stored_nd":
            return torch.einsum("bsh,ndh->bsnd", x, w)
        b, s, _ = x.shape
        return (x @ w.reshape(H, -1)).view(b, s, self.n, HD)

    def forward(self, x):
        b, s, _ = x.shape
        q, k = self._project(x, self.q), self._project(x, self.k)
        v = torch.tensordot(x, self.v, dims=1) if self.kind == "matmul" else self._project(x, self.v)
        pos = _positions(s).to(x.dtype)
        # (s, n, d): the key of each distance
        kr = torch.einsum("jh,ndh->jnd" if self.kind == "stored_nd" else "jh,hnd->jnd", pos, self.r)
        ac = torch.einsum("bind,bjnd->bnij", q + self.r_w_bias, k)
        bd = torch.einsum("bind,jnd->bnij", q + self.r_r_bias, kr)
        att = ((ac + bd) / math.sqrt(HD)).masked_fill(_causal(s), float("-inf")).softmax(-1)
        a = torch.einsum("bnij,bjnd->bind", att, v)  # (b, s, n, d)
        if self.kind == "einsum":
            return torch.einsum("bsnd,hnd->bsh", a, self.o)
        if self.kind == "stored_nd":
            return torch.einsum("bsnd,ndh->bsh", a, self.o)
        return a.flatten(2) @ self.o.flatten(1).t()


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
        self.norm = nn.LayerNorm(H)

    def forward(self, x):
        return self.norm(x + self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, kind: str, n: int = NH):
        super().__init__()
        self.attn, self.n1, self.ffn = EinsumAttention(kind, n), nn.LayerNorm(H), FeedForward()

    def forward(self, x):
        return self.ffn(self.n1(x + self.attn(x)))


class TwoStreamAttention(nn.Module):
    """XLNet's two streams: h attends to the content of every earlier position and its own, g (the query
    stream) to the content of every earlier position but not its own; q reads both streams."""

    def __init__(self, n: int = NH):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.q, self.k, self.v, self.o = (_heads(g, n) for _ in range(4))
        self.r_w_bias = nn.Parameter(torch.randn(n, HD, generator=g) * 0.1)
        self.norm = nn.LayerNorm(H)

    def _core(self, q, k, v, mask):
        att = torch.einsum("ibnd,jbnd->bnij", q + self.r_w_bias, k) / math.sqrt(HD)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        return torch.einsum("bnij,jbnd->ibnd", att, v)

    def _post(self, x, a):
        return self.norm(x + torch.einsum("ibnd,hnd->ibh", a, self.o))

    def forward(self, h, g):  # (s, b, H) each, XLNet's sequence-first layout
        s = h.shape[0]
        k = torch.einsum("ibh,hnd->ibnd", h, self.k)
        v = torch.einsum("ibh,hnd->ibnd", h, self.v)
        a_h = self._core(torch.einsum("ibh,hnd->ibnd", h, self.q), k, v, _causal(s))
        # the query stream sees no position's own content (position 0 sees only itself: keep the diagonal there)
        blind = torch.ones(s, s, dtype=torch.bool).triu(0)
        blind[0, 0] = False
        a_g = self._core(torch.einsum("ibh,hnd->ibnd", g, self.q), k, v, blind)
        return self._post(h, a_h), self._post(g, a_g)


class TwoStreamBlock(nn.Module):
    def __init__(self, n: int = NH):
        super().__init__()
        self.attn, self.ffn = TwoStreamAttention(n), FeedForward()

    def forward(self, h, g):
        h, g = self.attn(h, g)
        return self.ffn(h), self.ffn(g)


class LM(nn.Module):
    def __init__(self, kind: str, n: int = NH):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(V, H)
        if kind == "two_stream":
            self.mask_emb = nn.Parameter(torch.randn(1, 1, H) * 0.02)  # the query stream's input, XLNet's
            self.blocks = nn.ModuleList([TwoStreamBlock(n) for _ in range(2)])
        else:
            self.blocks = nn.ModuleList([Block(kind, n) for _ in range(2)])
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        if self.kind == "two_stream":
            h = x.transpose(0, 1)  # (s, b, H)
            g = self.mask_emb.expand_as(h)
            for blk in self.blocks:
                h, g = blk(h, g)
            x = g.transpose(0, 1)
        else:
            for blk in self.blocks:
                x = blk(x)
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _xlnet(kind: str, n: int | None = None):
    bench = str(Path(__file__).resolve().parents[2] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from op_coverage import _build_hf, hf_config

    model, args, kwargs, _ = _build_hf("xlnet", None)
    if n is not None:  # n heads of 16: d_model 16·n
        from transformers import XLNetLMHeadModel

        cfg = hf_config("xlnet", 2)
        cfg.n_head, cfg.d_head, cfg.d_model = n, 16, 16 * n
        torch.manual_seed(0)
        model = XLNetLMHeadModel(cfg)
        model.config.use_cache = False
    if kind == "xlnet_segments":  # the last half of each sequence a second segment
        types = torch.zeros_like(kwargs["input_ids"])
        types[:, types.shape[1] // 2:] = 1
        kwargs = {**kwargs, "token_type_ids": types}
    if kind == "xlnet_two_stream":  # the last 2 positions predicted: hidden from every position's content
        ids = kwargs["input_ids"]
        b, s = ids.shape
        perm = torch.zeros(b, s, s)
        perm[:, :, -2:] = 1.0
        mapping = torch.zeros(b, 2, s)
        mapping[:, 0, -2] = mapping[:, 1, -1] = 1.0
        kwargs = {"input_ids": ids, "perm_mask": perm, "target_mapping": mapping, "labels": ids[:, -2:].clone()}
    return model, args, kwargs


def build(kind: str):
    kind, _, heads = kind.partition(":")
    n = int(heads) if heads else None
    if kind.startswith("xlnet"):
        model, args, kwargs = _xlnet(kind, n)
        for m in model.modules():  # the single-device run is the reference: no random masks (config's 0.1)
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        return model, args, kwargs
    torch.manual_seed(0)
    model = LM(kind, n or NH)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randint(0, V, (2, S), generator=g), torch.randint(0, V, (2, S), generator=g)), {}
