"""Models that checkpoint their own activations, spelled as training scripts do: torch.utils.checkpoint around
each layer (non-reentrant and reentrant), around a plain function rather than a module, a block that
checkpoints only its MLP, attention dropout inside the checkpointed layer (and, not seen yet, Hugging Face's
``gradient_checkpointing_enable()``). ``build(style, recompute)``: (model, (idx, targets)); the same seed gives
the same weights with and without checkpointing."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, WIDTH, HEADS, LAYERS, SEQ = 64, 32, 4, 3, 8


class Attention(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.qkv, self.proj, self.dropout = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH), dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(x).split(WIDTH, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)  # (b, nh, s, d)
        return self.proj(y.transpose(1, 2).reshape(b, s, WIDTH))


class Block(nn.Module):
    def __init__(self, dropout: float = 0.0, inner: str | None = None):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention(dropout)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.inner = inner  # "mlp": the block checkpoints its MLP alone

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        return x + (checkpoint(self.mlp, h, use_reentrant=False) if self.inner == "mlp" else self.mlp(h))


class GPT(nn.Module):
    def __init__(self, style: str, recompute: bool):
        super().__init__()
        dropout = 0.1 if style == "dropout" else 0.0
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(dropout, "mlp" if style == "mlp_only" and recompute else None)
                                    for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        self.style, self.recompute = style, recompute

    def _run(self, block: Block, x: torch.Tensor) -> torch.Tensor:
        return block(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        x = self.wte(idx)
        for block in self.blocks:
            if not self.recompute or self.style == "mlp_only":
                x = block(x)
            elif self.style == "reentrant":
                x = checkpoint(block, x, use_reentrant=True)
            elif self.style == "function":
                x = checkpoint(functools.partial(self._run, block), x, use_reentrant=False)
            else:
                x = checkpoint(block, x, use_reentrant=False)
        logits = self.head(self.ln_f(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _hf(recompute: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=32,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    if recompute:
        model.gradient_checkpointing_enable()
    return model


STYLES = ["layer", "reentrant", "function", "mlp_only", "dropout"]
# Hugging Face's layers checkpoint only where torch.is_grad_enabled(), and the capture runs without grad:
# gradient_checkpointing_enable() is not seen yet (the numbers are exact; the memory is the model's without it)
GAPS = ["hf_llama"]


def build(style: str, recompute: bool = True):
    torch.manual_seed(0)
    model = _hf(recompute) if style == "hf_llama" else GPT(style, recompute)
    model.train()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return model, (idx, torch.randint(0, VOCAB, (2, SEQ), generator=g))


def loss_of(model: nn.Module, style: str, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if style == "hf_llama":
        return model(input_ids=idx, labels=targets, use_cache=False).loss
    return model(idx, targets)[1]
