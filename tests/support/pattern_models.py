"""Attention and MLP spellings from public model code, each in a small LM of its own (width 64, 4 query
heads of 16, vocab 96): the pattern suite of tests/analysis/test_patterns.py. Every model is
``(idx, targets) -> (logits, loss)``."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

V, H, NH, HD, S = 96, 64, 4, 16, 12


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(dim: int, s: int = S):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(s).float(), inv)  # (s, dim/2)
    return freqs.cos(), freqs.sin()


def rotate_interleaved(x, cos, sin):
    """GPT-J / Mistral-reference style: rotate pairs (x0, x1), (x2, x3), ... with stack + flatten."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def rotate_complex(x, freqs_cis):
    """Llama-reference style: pairs as complex numbers."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis).flatten(-2).type_as(x)


class VarLayerNorm(nn.Module):
    """A LayerNorm written out with mean and var, as many research code bases do."""

    def __init__(self, dim: int):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim)), nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5) * self.w + self.b


class Attention(nn.Module):
    """q, k, v projections, one of several spellings of what happens between them and the output."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q, self.k, self.v = (nn.Linear(H, H, bias=False) for _ in range(3))
        self.o = nn.Linear(H, H, bias=False)
        if kind in ("qk_norm_head", "qk_norm_width"):
            d = HD if kind == "qk_norm_head" else H
            self.q_norm, self.k_norm = RMSNorm(d), RMSNorm(d)
        if kind == "qk_rmsnorm_width":  # torch's own RMSNorm over all heads (one fused op)
            self.q_norm, self.k_norm = nn.RMSNorm(H, eps=1e-6), nn.RMSNorm(H, eps=1e-6)
        if kind == "qk_layernorm_width":
            self.q_norm, self.k_norm = nn.LayerNorm(H), nn.LayerNorm(H)
        if kind == "qk_varnorm_width":
            self.q_norm, self.k_norm = VarLayerNorm(H), VarLayerNorm(H)
        if kind == "qk_l2norm_width":  # cosine attention: q and k scaled to unit length over all heads
            self.q_norm = self.k_norm = lambda t: F.normalize(t, dim=-1) * 4.0
        if kind == "qk_layernorm_head":  # StableLM / Persimmon style: a LayerNorm per head
            self.q_norm, self.k_norm = nn.LayerNorm(HD), nn.LayerNorm(HD)
        if kind in ("alibi", "baddbmm_alibi"):
            self.register_buffer("slopes", torch.tensor([2.0 ** (-8 * (i + 1) / NH) for i in range(NH)]))
        if kind in ("rope_interleaved", "rope_partial"):
            cos, sin = rope_tables(HD if kind == "rope_interleaved" else HD // 2)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        if kind == "rope_complex":
            cos, sin = rope_tables(HD)
            self.register_buffer("freqs_cis", torch.polar(torch.ones_like(cos), torch.atan2(sin, cos)),
                                 persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.kind in ("qk_norm_width", "qk_rmsnorm_width", "qk_layernorm_width", "qk_varnorm_width",
                         "qk_l2norm_width"):  # OLMo-2: over all heads
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(b, s, NH, HD) for t in (q, k, v))  # (b, s, nh, hd)
        if self.kind in ("qk_norm_head", "qk_layernorm_head"):  # Qwen3 style: one norm per head
            q, k = self.q_norm(q), self.k_norm(k)
        if self.kind == "rope_interleaved":
            cos, sin = self.cos[:s, None, :], self.sin[:s, None, :]
            q, k = rotate_interleaved(q, cos, sin), rotate_interleaved(k, cos, sin)
        if self.kind == "rope_partial":  # rotary on the first half of each head only (GPT-NeoX rotary_pct)
            r = HD // 2
            cos, sin = self.cos[:s, None, :], self.sin[:s, None, :]
            q = torch.cat((rotate_interleaved(q[..., :r], cos, sin), q[..., r:]), dim=-1)
            k = torch.cat((rotate_interleaved(k[..., :r], cos, sin), k[..., r:]), dim=-1)
        if self.kind == "rope_complex":
            f = self.freqs_cis[:s, None, :]
            q, k = rotate_complex(q, f), rotate_complex(k, f)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, nh, s, hd)
        if self.kind == "baddbmm":  # GPT-2 / BLOOM style: heads folded into the batch
            qf, kf, vf = (t.reshape(b * NH, s, HD) for t in (q, k, v))
            bias = torch.zeros(b * NH, s, s, dtype=x.dtype, device=x.device)
            att = torch.baddbmm(bias, qf, kf.transpose(1, 2), beta=0.0, alpha=1.0 / math.sqrt(HD))
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(-1)
            y = torch.bmm(att, vf).view(b, NH, s, HD)
        elif self.kind == "baddbmm_alibi":  # BLOOM style: the ALiBi bias is baddbmm's input, [b·heads, 1, s]
            alibi = (self.slopes[:, None] * torch.arange(s, device=x.device)[None, :]).expand(b, NH, s)
            alibi = alibi.reshape(b * NH, 1, s)
            qf, kf, vf = (t.reshape(b * NH, s, HD) for t in (q, k, v))
            att = alibi.baddbmm(batch1=qf, batch2=kf.transpose(1, 2), beta=1.0, alpha=1.0 / math.sqrt(HD))
            att = att.view(b, NH, s, s)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            att = F.softmax(att.masked_fill(~mask, torch.finfo(att.dtype).min), dim=-1, dtype=torch.float32)
            y = torch.bmm(att.view(b * NH, s, s), vf).view(b, NH, s, HD)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(HD)
            if self.kind == "alibi":  # per-head slopes times distance
                pos = torch.arange(s, device=x.device)
                att = att + self.slopes[:, None, None] * (pos[None, :] - pos[:, None])[None]
            if self.kind == "softcap":  # Gemma-2 style tanh soft-capping of the scores
                att = torch.tanh(att / 50.0) * 50.0
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, s, H))


class FusedAttention(nn.Module):
    """One q|k|v projection with n_kv key/value heads, read the ways public code reads it."""

    def __init__(self, kind: str, n_kv: int):
        super().__init__()
        self.kind, self.n_kv = kind, n_kv
        self.qkv = nn.Linear(H, (NH + 2 * n_kv) * HD, bias=False)
        self.o = nn.Linear(H, H, bias=False)
        if kind == "gqa_qk_norm":
            self.q_norm, self.k_norm = RMSNorm(HD), RMSNorm(HD)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x)
        q_size, kv_size = NH * HD, self.n_kv * HD
        if self.kind == "falcon_mqa":  # Falcon-7B: [b, s, n_heads + 2, d], the last two "heads" are k and v
            f = qkv.view(b, s, NH + 2, HD)
            q, k, v = (t.transpose(1, 2) for t in (f[:, :, :-2], f[:, :, -2:-1], f[:, :, -1:]))
            k, v = k.expand(b, NH, s, HD), v.expand(b, NH, s, HD)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(b, s, H))
        if self.kind == "falcon_mqa_index":  # HF Falcon-7B: k and v picked by index lists
            f = qkv.view(b, s, NH + 2, HD)
            q, k, v = f[..., :-2, :], f[..., [-2], :], f[..., [-1], :]
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            k, v = torch.broadcast_to(k, q.shape), torch.broadcast_to(v, q.shape)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(b, s, H))
        if self.kind == "grouped_index":  # HF Falcon-40B: [b, s, n_kv, group + 2, d], index lists, broadcast_to
            f = qkv.view(b, s, -1, NH // self.n_kv + 2, HD)
            q, k, v = f[:, :, :, :-2], f[:, :, :, [-2]], f[:, :, :, [-1]]
            k, v = torch.broadcast_to(k, q.shape), torch.broadcast_to(v, q.shape)
            q, k, v = (t.flatten(2, 3).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(b, s, H))
        if self.kind == "offset_slices":  # vLLM / Phi-3 style
            q = qkv[..., :q_size]
            k = qkv[..., q_size:q_size + kv_size]
            v = qkv[..., q_size + kv_size:]
        elif self.kind.startswith("grouped_view"):  # Falcon style: [b, s, n_kv, group + 2, d]
            g = NH // self.n_kv
            qkv = qkv.view(b, s, self.n_kv, g + 2, HD)
            q = qkv[:, :, :, :g].reshape(b, s, NH * HD)
            k = qkv[:, :, :, g].reshape(b, s, kv_size)
            v = qkv[:, :, :, g + 1].reshape(b, s, kv_size)
        else:  # split with unequal sizes (multi-query: one k and one v head)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(b, s, NH, HD)
        k, v = (t.view(b, s, self.n_kv, HD) for t in (k, v))
        if self.kind == "gqa_qk_norm":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        rep = NH // self.n_kv
        k, v = (t[:, :, None].expand(b, self.n_kv, rep, s, HD).reshape(b, NH, s, HD) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, H))


class MQAttention(nn.Module):
    """Multi-query attention: one fused projection of the query heads and one key and one value head
    (``q | k | v`` of widths ``(n·d, d, d)``, or Falcon-7B's ``[b, s, n + 2, d]``), the key and value
    broadcast over the query heads the ways public code spells it. A ``_bias`` suffix gives the projection
    a bias."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind.removesuffix("_bias")
        self.qkv = nn.Linear(H, (NH + 2) * HD, bias=kind.endswith("_bias"))
        self.o = nn.Linear(H, H, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        kind, qkv = self.kind, self.qkv(x)
        if kind.startswith("falcon"):
            f = qkv.view(b, s, NH + 2, HD)
            if kind == "falcon_select":  # one k and one v position, (b, s, d), given back a head dim of 1
                q, k, v = f[:, :, :-2].transpose(1, 2), f[..., -2, :].unsqueeze(1), f[..., -1, :].unsqueeze(1)
            elif kind == "falcon_matmul":  # slices
                q, k, v = (t.transpose(1, 2) for t in (f[:, :, :-2], f[:, :, -2:-1], f[:, :, -1:]))
            else:  # index lists
                q, k, v = (t.transpose(1, 2) for t in (f[..., :-2, :], f[..., [-2], :], f[..., [-1], :]))
        elif kind == "bigcode":  # GPTBigCode: split after an unsqueeze, (b, 1, s, hd) keys and values
            q, k, v = qkv.unsqueeze(1).split([NH * HD, HD, HD], dim=3)
            q = q.view(b, s, -1, HD).transpose(1, 2)
        else:
            q, k, v = qkv.split([NH * HD, HD, HD], dim=-1)
            q = q.view(b, s, NH, HD).transpose(1, 2)  # (b, nh, s, hd)
            if kind in ("mqa_unsqueeze", "mqa_matmul"):  # the one head kept as (b, s, hd)
                k, v = k.unsqueeze(1), v.unsqueeze(1)
            else:
                k, v = (t.view(b, s, 1, HD).transpose(1, 2) for t in (k, v))  # (b, 1, s, hd)
        if kind in ("mqa_expand_as", "falcon_select"):
            k, v = k.expand_as(q), v.expand_as(q)
        elif kind == "mqa_repeat":
            k, v = k.repeat(1, NH, 1, 1), v.repeat(1, NH, 1, 1)
        elif kind == "mqa_unsqueeze":
            k, v = k.expand(-1, NH, -1, -1), v.expand(-1, NH, -1, -1)
        elif kind == "bigcode":  # Hugging Face's repeat_kv
            k, v = (t[:, :, None].expand(b, 1, NH, s, HD).reshape(b, NH, s, HD) for t in (k, v))
        if kind.endswith("matmul"):  # written out: (b, 1, s, hd) keys and values broadcast over the heads
            att = (q @ k.transpose(-2, -1)) / math.sqrt(HD)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        else:  # mqa_bcast, falcon_bcast: (b, 1, s, hd) keys and values broadcast by attention itself
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, H))


MQA = ("mqa_bcast", "mqa_bcast_bias", "mqa_expand_as", "mqa_repeat", "mqa_unsqueeze", "mqa_matmul", "falcon_bcast",
       "falcon_bcast_bias", "falcon_matmul", "falcon_select", "bigcode_bias")


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(H, 128, bias=False), nn.Linear(H, 128, bias=False), \
            nn.Linear(128, H, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.n1, self.n2 = RMSNorm(H), RMSNorm(H)
        fused = {"offset_slices": 2, "grouped_view": 2, "grouped_view_mha": 4, "fused_mqa": 1, "falcon_mqa": 1,
                 "gqa_qk_norm": 2, "falcon_mqa_index": 1, "grouped_index": 2}
        self.attn = MQAttention(kind) if kind in MQA else FusedAttention(kind, fused[kind]) if kind in fused \
            else Attention(kind)
        self.mlp = SwiGLU()

    def forward(self, x):
        if self.kind == "parallel":  # GPT-J / Falcon style: one norm feeds attention and MLP side by side
            h = self.n1(x)
            return x + self.attn(h) + self.mlp(h)
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


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


class BlockWith(nn.Module):
    """A pre-norm block around an attention module of another suite's own (and this suite's SwiGLU)."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.n1, self.n2 = RMSNorm(H), RMSNorm(H)
        self.attn, self.mlp = attn, SwiGLU()

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class LMWith(nn.Module):
    """This suite's small LM with two :class:`BlockWith` of ``attention(kind)``; ``final_norm(x)`` (default:
    the RMSNorm) lets a suite spell the last norm its own way."""

    def __init__(self, kind: str, attention):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList([BlockWith(attention(kind)) for _ in range(2)])
        self.norm = RMSNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def final_norm(self, x):
        return self.norm(x)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.final_norm(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_with(model: nn.Module):
    """``model`` (built after seeding 0 by the caller) with this suite's batch."""
    g = torch.Generator().manual_seed(1)
    return model, (torch.randint(0, V, (2, S), generator=g), torch.randint(0, V, (2, S), generator=g)), {}


KINDS = ("plain", "rope_interleaved", "rope_partial", "rope_complex", "qk_norm_head", "qk_layernorm_head",
         "qk_norm_width", "qk_rmsnorm_width", "qk_layernorm_width", "alibi", "softcap", "baddbmm", "baddbmm_alibi",
         "parallel", "offset_slices", "grouped_view", "grouped_view_mha", "fused_mqa", "falcon_mqa", "gqa_qk_norm",
         "qk_varnorm_width", "qk_l2norm_width", "falcon_mqa_index", "grouped_index", *MQA)


def build(kind: str):
    torch.manual_seed(0)
    model = LM(kind)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randint(0, V, (2, S), generator=g), torch.randint(0, V, (2, S), generator=g)), {}
