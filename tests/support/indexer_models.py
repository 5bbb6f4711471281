"""Latent attention whose keys a sparse-attention indexer chooses (DeepSeek-V3.2's DSA): ``build(kind) ->
(model, args, kwargs)``, every model called as a training step calls it, returning the logits and the loss.

Hugging Face families (2 layers, width 64, 4 heads, q latent 24, kv latent 16, an indexer of 4 heads of 16 that
keeps the top 4 keys of each query's 8, so the choice masks keys):

- ``deepseek_v32``: DeepSeek-V3.2, the indexer under ``@torch.no_grad()``, half-split rotary in it;
- ``glm_moe_dsa``: GLM-MoE-DSA, the same with interleaved rotary in the indexer;
- ``dots3_note_text``: Dots3-Note, latents rescaled before their up-projections, a per-head sigmoid gate
  ``g_proj(x).view(b, s, heads, 1)`` on attention's output, its indexer reading ``hidden_states.to(float32)``
  (the float32 input itself, read again by the gate);
- ``hy_v4``: HY-V4, hyper-connections (4 residual streams, each layer's input and output mixed by a small
  linear of all of them, ``fn (8, 4·h)``), a gate per head and value dim (``gate_proj``), attention sinks, and the
  second layer reusing the first layer's chosen keys.

Hand-written (width 64, 4 heads of 16, q latent 24, kv latent 16, vocab 96, 12 tokens; an indexer of 2 heads
of 8 keeps the top 4 keys), ``(idx, targets) -> (logits, loss)``:

- ``written_no_grad``: the indexer in ``torch.no_grad()``, reading ``x.to(x.dtype)`` (``x`` itself, read again
  with its gradient by the gate after it): ``topk(...).indices`` scattered into a bool mask of the keys not
  chosen, ``masked_fill`` of attention's scores; attention's output weighted by ``sigmoid(gate(x)).unsqueeze(-1)``;
- ``written_argsort``: the indexer with gradients enabled (nothing reaches its weights through the choice):
  ``argsort(descending)[..., :k]``, a float ``scatter`` of ones compared to a bool mask, read by SDPA; the
  per-head gate as ``gate(x).view(b, s, heads, 1).sigmoid()``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tiny_lm import hf_build, lm_build

V, H, NH, HD, S = 96, 64, 4, 16, 12
Q_LAT, KV_LAT, IH, ID, TOP = 24, 16, 2, 8, 4

HF_KINDS = ("deepseek_v32", "glm_moe_dsa", "dots3_note_text", "hy_v4")
WRITTEN_KINDS = ("written_no_grad", "written_argsort")
KINDS = HF_KINDS + WRITTEN_KINDS


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Indexer(nn.Module):
    """Scores every key for every query from the q latent and the block input, sums its heads weighted by a
    projection of the input, and returns the keys to mask out ``(b, 1, s, s)``, True where not chosen."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.wq = nn.Linear(Q_LAT, IH * ID, bias=False)
        self.wk = nn.Linear(H, ID, bias=False)
        self.weights = nn.Linear(H, IH, bias=False)

    def scores(self, x, q_lat, causal):
        b, s, _ = x.shape
        q = self.wq(q_lat).view(b, s, IH, ID)
        k = self.wk(x)  # (b, s, ID): one key head shared by the indexer's heads
        per_head = F.relu(torch.einsum("bshd,btd->bsht", q, k))  # (b, s, IH, s)
        w = self.weights(x.to(x.dtype)) * IH ** -0.5  # x itself: the block reads it again after the indexer
        return (per_head * w.unsqueeze(-1)).sum(2).masked_fill(~causal, float("-inf"))  # (b, s, s)

    def forward(self, x, q_lat, causal):
        if self.kind == "written_no_grad":
            with torch.no_grad():
                chosen = self.scores(x, q_lat, causal).topk(TOP, dim=-1).indices
            return torch.ones_like(causal.expand(x.shape[0], -1, -1)).scatter(-1, chosen, False).unsqueeze(1)
        chosen = self.scores(x, q_lat, causal).argsort(dim=-1, descending=True)[..., :TOP]
        keep = torch.zeros(x.shape[0], x.shape[1], x.shape[1], device=x.device).scatter(-1, chosen, 1.0) > 0.5
        return ~keep.unsqueeze(1)


class LatentAttention(nn.Module):
    """q and kv through low-rank latents (kept whole), up-projections by heads, the indexer's choice masking
    attention's keys."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q_a, self.q_norm = nn.Linear(H, Q_LAT, bias=False), RMSNorm(Q_LAT)
        self.q_b = nn.Linear(Q_LAT, NH * HD, bias=False)
        self.kv_a, self.kv_norm = nn.Linear(H, KV_LAT, bias=False), RMSNorm(KV_LAT)
        self.kv_b = nn.Linear(KV_LAT, NH * 2 * HD, bias=False)
        self.o = nn.Linear(NH * HD, H, bias=False)
        self.indexer = Indexer(kind)
        self.gate = nn.Linear(H, NH, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q_lat = self.q_norm(self.q_a(x))
        q = self.q_b(q_lat).view(b, s, NH, HD).transpose(1, 2)
        k, v = self.kv_b(self.kv_norm(self.kv_a(x))).view(b, s, NH, 2 * HD).transpose(1, 2).split(HD, dim=-1)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        masked = self.indexer(x, q_lat, causal) | ~causal  # (b, 1, s, s): keys not chosen, or in the future
        if self.kind == "written_no_grad":
            att = (q @ k.transpose(-2, -1)) / math.sqrt(HD)
            y = att.masked_fill(masked, float("-inf")).softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=~masked)
        y = y.transpose(1, 2)  # (b, s, NH, HD), weighted by a sigmoid gate per head of the block input
        if self.kind == "written_argsort":
            y = y * self.gate(x).view(b, s, NH, 1).sigmoid()
        else:
            y = y * torch.sigmoid(self.gate(x)).unsqueeze(-1)
        return self.o(y.reshape(b, s, NH * HD))


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.n1, self.attn, self.n2 = RMSNorm(H), LatentAttention(kind), RMSNorm(H)
        self.up, self.down = nn.Linear(H, 4 * H, bias=False), nn.Linear(4 * H, H, bias=False)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class WrittenLM(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.wte = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(Block(kind) for _ in range(2))
        self.norm, self.head = RMSNorm(H), nn.Linear(H, V, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.view(-1, V), targets.view(-1))


def _hf_config(kind: str):
    from transformers import CONFIG_MAPPING

    sizes = dict(vocab_size=V, hidden_size=H, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=NH, num_key_value_heads=NH, max_position_embeddings=64, q_lora_rank=Q_LAT,
                 kv_lora_rank=KV_LAT, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                 num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, index_n_heads=4,
                 index_head_dim=16, index_topk=TOP, pad_token_id=0, bos_token_id=0, eos_token_id=0, use_cache=False)
    if kind == "hy_v4":  # wider MLPs: its hyper-connections' mixing linears (whole, 4·8·256) are a fifth of 115k
        sizes.update(intermediate_size=256, moe_intermediate_size=64)
    cfg = CONFIG_MAPPING[kind](**sizes)
    cfg.loss_type = "ForCausalLM"
    return cfg


def build(kind: str):
    if kind in HF_KINDS:
        return hf_build(_hf_config(kind), vocab=V)
    return lm_build(lambda: WrittenLM(kind), s=S, vocab=V)
