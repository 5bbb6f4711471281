"""Low-rank adapters (LoRA) added to column projections, written by hand in a small LM (width 64, 4 heads of 16,
vocab 96, sequence 12), and Hugging Face's Zamba2 built tiny. Every hand-written model is
``(idx, targets) -> (logits, loss)``.

An adapter is two chained matmuls, ``A: h -> r`` then ``B: r -> out``, whose output is added to a projection's
output ``W x``: ``W x + B(A(x))``. The exact Megatron-style cut keeps ``A`` whole (its ``(b, s, r)`` output is
small), cuts ``B`` column-parallel with ``W``'s split (segment by segment where ``W`` is a fused gate | up), and
``A``'s output enters ``B`` through f (identity forward, all-reduce backward), so that ``A``'s and ``x``'s
gradients are complete; the sum feeds the row-parallel projection as ``W x`` alone would.

- ``lora_matmul``: a GPT MLP (fc, gelu, proj) whose fc has an adapter spelled ``x @ A.T @ B.T * scale`` with
  ``A`` and ``B`` plain parameters; attention without adapters;
- ``lora_linear``: ``F.linear(F.linear(x, A), B)`` added to the q and v projections of attention, and to a fused
  gate | up projection (SwiGLU, split by ``chunk``);
- ``lora_rows``: adapters on the row projections, attention's o (``F.linear``) and the MLP's proj
  (``h @ A.T @ B.T * scale``): ``A`` reads the row's sharded input, so it is row-parallel beside it (one all-reduce
  of its ``(b, s, r)`` output), and ``B`` reads that output whole: whole on every rank;
- ``lora_module``: Zamba2's layout written out: one shared block (attention, SwiGLU MLP) applied at both layers,
  each application with its own ``nn.Module`` adapters (``nn.Sequential`` of two ``nn.Linear``, a scale) from a
  ``ModuleList`` indexed by the layer, on q, k, v and the fused gate | up; each layer's own linear of the
  block's output into the residual stream (whole: it reads the MLP's all-reduced output), then its own GPT MLP;
- ``zamba2``: Hugging Face's Zamba2 (2 hybrid layers sharing one transformer block, adapters on q, k, v and
  gate_up_proj).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import HD, NH, H, V, RMSNorm
from tiny_lm import hf_build, lm_build

R, FF = 8, 128  # the adapters' rank; the MLP's hidden width


def _adapter(n_out: int, g: torch.Generator) -> tuple[nn.Parameter, nn.Parameter]:
    """(A, B) as LoRA keeps them, ``A`` (r, h) and ``B`` (n_out, r); ``B`` is not zero, so every gradient shows."""
    return (nn.Parameter(torch.randn(R, H, generator=g) / H ** 0.5),
            nn.Parameter(torch.randn(n_out, R, generator=g) / R ** 0.5))


class Adapter(nn.Module):
    """A LoRA module: down to ``R`` features, up to ``n_out``, scaled."""

    def __init__(self, n_out: int, scale: float = 0.5):
        super().__init__()
        self.lora = nn.Sequential(nn.Linear(H, R, bias=False), nn.Linear(R, n_out, bias=False))
        self.scale = scale

    def forward(self, x):
        return self.lora(x) * self.scale


def _attend(q, k, v):
    b, s, _ = q.shape
    q, k, v = (t.view(b, s, NH, HD).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, H)


class Attention(nn.Module):
    def __init__(self, kind: str, g: torch.Generator):
        super().__init__()
        self.kind = kind
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))
        if kind == "lora_linear":
            self.qa, self.qb = _adapter(H, g)
            self.va, self.vb = _adapter(H, g)
        if kind == "lora_rows":
            self.oa, self.ob = _adapter(H, g)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.kind == "lora_linear":
            q = q + F.linear(F.linear(x, self.qa), self.qb)
            v = v + F.linear(F.linear(x, self.va), self.vb)
        y = _attend(q, k, v)
        if self.kind == "lora_rows":
            return self.o(y) + F.linear(F.linear(y, self.oa), self.ob)
        return self.o(y)


class MLP(nn.Module):
    def __init__(self, kind: str, g: torch.Generator):
        super().__init__()
        self.kind = kind
        if kind == "lora_matmul":
            self.fc, self.proj = nn.Linear(H, FF), nn.Linear(FF, H)
            self.a, self.b = _adapter(FF, g)
        elif kind == "lora_rows":
            self.fc, self.proj = nn.Linear(H, FF), nn.Linear(FF, H)
            self.a, self.b = nn.Parameter(torch.randn(R, FF, generator=g) / FF ** 0.5), \
                nn.Parameter(torch.randn(H, R, generator=g) / R ** 0.5)
        else:
            self.gate_up, self.down = nn.Linear(H, 2 * FF, bias=False), nn.Linear(FF, H, bias=False)
            self.a, self.b = _adapter(2 * FF, g)

    def forward(self, x):
        if self.kind == "lora_matmul":
            return self.proj(F.gelu(self.fc(x) + x @ self.a.T @ self.b.T * 0.5))
        if self.kind == "lora_rows":
            h = F.gelu(self.fc(x))
            return self.proj(h) + h @ self.a.T @ self.b.T * 0.5
        gate, up = (self.gate_up(x) + F.linear(F.linear(x, self.a), self.b)).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, kind: str, g: torch.Generator):
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(H), RMSNorm(H)
        self.attn, self.mlp = Attention(kind, g), MLP(kind, g)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class SharedBlock(nn.Module):
    """Zamba2's shared transformer written out: one block's weights applied at every layer, each layer with its
    own adapters on q, k, v and the fused gate | up; attention feeds the MLP's norm with no residual, and the
    MLP's output is the block's."""

    def __init__(self, layers: int):
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(H), RMSNorm(H)
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))
        self.gate_up, self.down = nn.Linear(H, 2 * FF, bias=False), nn.Linear(FF, H, bias=False)
        self.q_adapters, self.k_adapters, self.v_adapters = (nn.ModuleList(Adapter(H) for _ in range(layers))
                                                             for _ in range(3))
        self.gate_up_adapters = nn.ModuleList(Adapter(2 * FF) for _ in range(layers))

    def forward(self, x, layer: int):
        h = self.ln1(x)
        q = self.q(h) + self.q_adapters[layer](h)
        k = self.k(h) + self.k_adapters[layer](h)
        v = self.v(h) + self.v_adapters[layer](h)
        h = self.ln2(self.o(_attend(q, k, v)))
        gate, up = (self.gate_up(h) + self.gate_up_adapters[layer](h)).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class LM(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.kind = kind
        self.emb = nn.Embedding(V, H)
        if kind == "lora_module":
            self.shared = SharedBlock(2)
            # each layer's own linear of the shared block's output into the residual stream, then its own
            # feed-forward (Zamba2's hybrid layer: the linear, then a Mamba mixer)
            self.linears = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(2))
            self.norms = nn.ModuleList(RMSNorm(H) for _ in range(2))
            self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(H, FF), nn.GELU(), nn.Linear(FF, H)) for _ in range(2))
        else:
            self.blocks = nn.ModuleList([Block(kind, g) for _ in range(2)])
        self.norm = RMSNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        if self.kind == "lora_module":
            for layer in range(2):
                x = x + self.linears[layer](self.shared(x, layer))
                x = x + self.mlps[layer](self.norms[layer](x))
        else:
            for blk in self.blocks:
                x = blk(x)
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


WRITTEN = ("lora_matmul", "lora_linear", "lora_module", "lora_rows")
HF = ("zamba2",)
KINDS = (*WRITTEN, *HF)


def _zamba2():
    """Zamba2 with 2 hybrid layers (Mamba-2 mixers each followed by the one shared transformer block) and the
    adapters on attention's q, k, v as well as the MLP's gate_up_proj."""
    from transformers import Zamba2Config

    cfg = Zamba2Config(vocab_size=128, hidden_size=64, num_hidden_layers=2, layers_block_type=["hybrid", "hybrid"],
                       num_attention_heads=4, num_key_value_heads=4, intermediate_size=128, mamba_d_state=16,
                       mamba_ngroups=4, n_mamba_heads=8, adapter_rank=R, num_mem_blocks=1,
                       use_shared_attention_adapter=True, use_mem_rope=False, pad_token_id=0, bos_token_id=0,
                       eos_token_id=0, use_cache=False, max_position_embeddings=64)
    return hf_build(cfg)


def build(kind: str):
    if kind in HF:
        return _zamba2()
    return lm_build(lambda: LM(kind))
