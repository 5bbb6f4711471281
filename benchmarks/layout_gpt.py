"""The GPT that ``benchmarks/layouts_measured.py`` times under every parallel layout, importable on its own so
that a cost model can capture the very same model.

nanoGPT-shaped: token + learned position embeddings, ``n_layer`` pre-LN blocks (a fused q|k|v projection,
attention by ``F.scaled_dot_product_attention(is_causal=True)``, a 4×-wide GELU MLP), a final LayerNorm and
an LM head that is *not* tied to the embedding (a pipeline's first and last stages then share no weight).
``forward(idx, targets)`` returns ``(logits, loss)`` with the mean cross-entropy over the tokens.

    from layout_gpt import FULL, QUICK, build_model, example_batch
    model = build_model(FULL)                 # 8 layers, 768 wide, 12 heads, vocab 8192: 69.4M parameters
    idx, targets = example_batch(FULL, 8)     # the benchmark's global batch: 8 sequences × 128 tokens
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 8
    n_embd: int = 768
    n_head: int = 12
    vocab_size: int = 8192
    block_size: int = 128  # the sequence length the benchmark uses, and the position table's size
    bias: bool = True

    def as_dict(self) -> dict:
        return asdict(self)


FULL = GPTConfig()
QUICK = GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=512, block_size=32)  # a smoke run's model


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head, self.n_embd = cfg.n_head, cfg.n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)  # untied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def build_model(cfg: GPTConfig = FULL, seed: int = 0) -> GPT:
    """The model with seed ``seed``'s weights (every rank builds the same one)."""
    torch.manual_seed(seed)
    return GPT(cfg)


def param_count(cfg: GPTConfig) -> int:
    """Parameters of :func:`build_model` ``(cfg)``, without building it."""
    h, V, L = cfg.n_embd, cfg.vocab_size, cfg.n_layer
    b = 1 if cfg.bias else 0
    block = (h * 3 * h + b * 3 * h) + (h * h + b * h) + (h * 4 * h + b * 4 * h) + (4 * h * h + b * h) + 2 * (h + b * h)
    return V * h + cfg.block_size * h + L * block + (h + b * h) + h * V


def example_batch(cfg: GPTConfig = FULL, batch: int = 2, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` sequences of ``cfg.block_size`` random token ids, and their targets."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g) for _ in range(2))
