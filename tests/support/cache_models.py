"""Decoders that keep their KV cache in module buffers written in place, the way gpt-fast and torchtune
write them: a prefill call and one-token decode calls, both ``(idx, input_pos) -> logits`` under
``torch.no_grad()``. The pattern suite's KV-cache rows (tests/analysis/test_patterns.py). Kind ``mqa``: one kv head
(multi-query) in the fused projection, cached gpt-fast's way and broadcast over the query heads by attention."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

V, H, NH, HD, B, MAXS = 96, 64, 4, 16, 2, 16


class KVCache(nn.Module):
    def __init__(self, kind: str, n_kv: int):
        super().__init__()
        self.kind = kind
        self.register_buffer("k_cache", torch.zeros(B, n_kv, MAXS, HD))
        self.register_buffer("v_cache", torch.zeros(B, n_kv, MAXS, HD))

    def update(self, input_pos, k, v):  # k, v: (b, n_kv, s, hd)
        if self.kind == "index_copy":  # torchtune style
            self.k_cache.index_copy_(2, input_pos, k)
            self.v_cache.index_copy_(2, input_pos, v)
            return self.k_cache, self.v_cache
        k_out, v_out = self.k_cache, self.v_cache  # gpt-fast style
        k_out[:, :, input_pos] = k
        v_out[:, :, input_pos] = v
        return k_out, v_out


class Attention(nn.Module):
    def __init__(self, kind: str, n_kv: int):
        super().__init__()
        self.kind, self.n_kv = kind, n_kv
        self.wqkv = nn.Linear(H, (NH + 2 * n_kv) * HD, bias=False)
        self.wo = nn.Linear(H, H, bias=False)
        self.kv_cache = KVCache(kind, n_kv)

    def forward(self, x, mask, input_pos):
        b, s, _ = x.shape
        kv = self.n_kv * HD
        q, k, v = self.wqkv(x).split([H, kv, kv], dim=-1)
        q = q.view(b, s, NH, HD).transpose(1, 2)
        k, v = (t.view(b, s, self.n_kv, HD).transpose(1, 2) for t in (k, v))
        k, v = self.kv_cache.update(input_pos, k, v)
        if self.kind != "mqa":  # multi-query: (b, 1, MAXS, hd) keys and values broadcast over the heads
            k, v = (t.repeat_interleave(NH // self.n_kv, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (b, nh, s, hd)
        return self.wo(y.transpose(1, 2).contiguous().view(b, s, H))


class CachedLM(nn.Module):
    def __init__(self, kind: str, n_kv: int = 2):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.attn = nn.ModuleList([Attention(kind, n_kv) for _ in range(2)])
        self.mlp = nn.ModuleList([nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))
                                  for _ in range(2)])
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)
        self.register_buffer("causal_mask", torch.tril(torch.ones(MAXS, MAXS, dtype=torch.bool)), persistent=False)

    def forward(self, idx, input_pos):
        mask = self.causal_mask[None, None, input_pos]  # (1, 1, s, MAXS)
        x = self.emb(idx)
        for attn, mlp in zip(self.attn, self.mlp):
            x = x + attn(x, mask, input_pos)
            x = x + mlp(x)
        return self.head(self.norm(x))


def build(kind: str) -> CachedLM:
    torch.manual_seed(0)
    return CachedLM(kind, n_kv=1 if kind == "mqa" else 2)


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Greedy decoding: one prefill call, then ``steps`` one-token calls; the logits of each call."""
    s = prompt.shape[1]
    logits = [model(prompt, torch.arange(s))]
    tokens = [logits[-1][:, -1].argmax(-1, keepdim=True)]
    for i in range(steps):
        logits.append(model(tokens[-1], torch.tensor([s + i])))
        tokens.append(logits[-1][:, -1].argmax(-1, keepdim=True))
    return logits, torch.cat(tokens, dim=1)
