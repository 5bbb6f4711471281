"""GPT-J-style blocks: a partial rotary embedding on interleaved pairs, one layer norm read by attention and the MLP
side by side (``x + attn(ln(x)) + mlp(ln(x))``), and CodeGen's fused q | v | k projection laid out in 4 chunks.

- ``codegen``, ``gptj``: the Hugging Face families, tiny (width 64, 2 layers, head dim 16 of which ``rotary_dim``
  8 rotated, vocab 128). CodeGen's ``qkv_proj`` output is viewed ``(b, s, 4, 3·h/4)`` and split into q, v, k
  of ``(b, s, 4, h/4)`` each, so each quarter of the rows holds its own heads' q, v and k; ``codegen_8_heads``
  has 8 heads of 8 (rotary 4), two heads per quarter. Both gather their sin | cos table by position ids.
- ``chunked_qkv``: a hand-written CodeGen: the fused projection unflattened to ``(b, s, 4, 3, h/4)`` and read
  apart with ``unbind`` (order q, v, k), 8 heads of 8, the rotated half of each head spelled as pairs
  ``unflatten(-1, (-1, 2))`` and its sin and cos computed from the positions, not gathered.
- ``split_rotary``: a hand-written GPT-J: separate q, k, v, the head split into rotated and passed parts with
  ``torch.split``, the pairs taken by ``x[..., ::2]``, ``x[..., 1::2]`` and put back with ``stack`` and
  ``flatten``, the rotary table a buffer indexed by ``arange``; SDPA with ``is_causal``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

HF_KINDS = ("codegen", "codegen_8_heads", "gptj")
KINDS = ("chunked_qkv", "split_rotary")
V, H, S = 128, 64, 8


def _rotate_pairs(x, cos, sin):
    """(x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin) for each pair of the last dim; cos, sin (s, d/2)."""
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # against (b, s, heads, d/2)
    return torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)


class ChunkedQKV(nn.Module):
    """CodeGen's fused projection spelled apart: 4 chunks of q | v | k, 8 heads of 8, the first 4 dims rotated."""

    def __init__(self, heads: int = 8, chunks: int = 4, rot: int = 4):
        super().__init__()
        self.heads, self.chunks, self.rot = heads, chunks, rot
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.out = nn.Linear(H, H, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        hd = H // self.heads
        q, v, k = self.qkv(x).unflatten(-1, (self.chunks, 3, H // self.chunks)).unbind(-2)  # (b, s, 4, h/4) each
        q, k, v = (t.reshape(b, s, self.heads, hd) for t in (q, k, v))
        inv = 1.0 / (10000 ** (torch.arange(0, self.rot, 2, device=x.device).float() / self.rot))
        ang = torch.arange(s, device=x.device).float()[:, None] * inv  # (s, rot/2)
        q, k = (torch.cat([_rotate_pairs(t[..., :self.rot], ang.cos(), ang.sin()), t[..., self.rot:]], dim=-1)
                for t in (q, k))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, H))


class SplitRotary(nn.Module):
    """GPT-J's attention spelled with ``torch.split`` of each head and a buffer table of sin | cos."""

    def __init__(self, heads: int = 4, rot: int = 8):
        super().__init__()
        self.heads, self.rot = heads, rot
        self.q, self.k, self.v = (nn.Linear(H, H, bias=False) for _ in range(3))
        self.out = nn.Linear(H, H, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
        ang = torch.arange(64).float()[:, None] * inv
        self.register_buffer("table", torch.cat([ang.sin(), ang.cos()], dim=-1), persistent=False)  # (64, rot)

    def forward(self, x):
        b, s, _ = x.shape
        hd = H // self.heads
        q, k, v = (p(x).view(b, s, self.heads, hd) for p in (self.q, self.k, self.v))
        sin, cos = self.table[torch.arange(s, device=x.device)].chunk(2, dim=-1)  # (s, rot/2) each
        sin, cos = sin[:, None, :].repeat_interleave(2, -1), cos[:, None, :].repeat_interleave(2, -1)

        def rope(t):
            r, p = torch.split(t, [self.rot, hd - self.rot], dim=-1)
            turned = torch.stack((-r[..., 1::2], r[..., ::2]), dim=-1).flatten(-2)
            return torch.cat([r * cos + turned * sin, p], dim=-1)

        q, k = rope(q), rope(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, H))


class ParallelBlock(nn.Module):
    """One layer norm read by attention and the MLP side by side: ``x + attn(ln(x)) + mlp(ln(x))``."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.attn = attention
        self.fc_in, self.fc_out = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        h = self.ln(x)
        return x + self.attn(h) + self.fc_out(F.gelu(self.fc_in(h), approximate="tanh"))


class ParallelLM(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(ParallelBlock(ChunkedQKV() if kind == "chunked_qkv" else SplitRotary())
                                    for _ in range(2))
        self.ln_f = nn.LayerNorm(H)
        self.head = nn.Linear(H, V)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _hf_config(kind: str):
    from transformers import CodeGenConfig, GPTJConfig

    sizes = dict(vocab_size=V, n_embd=H, n_layer=2, n_head=4, rotary_dim=8, n_inner=128, n_positions=64,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)
    if kind == "codegen_8_heads":  # two heads per quarter of the fused projection's rows
        sizes.update(n_head=8, rotary_dim=4)
    return (GPTJConfig if kind == "gptj" else CodeGenConfig)(**sizes)


def build(kind: str):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind in HF_KINDS:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(_hf_config(kind))
        ids = torch.randint(0, V, (2, S), generator=g)
        return model, (), {"input_ids": ids, "labels": ids}
    model = ParallelLM(kind)
    return model, (torch.randint(0, V, (2, S), generator=g), torch.randint(0, V, (2, S), generator=g)), {}
