"""Per-layer inputs (Gemma 3n's and Gemma 4's) in a small LM (width 64, vocab 96, sequence 12, 2 layers), and
Hugging Face's Gemma 4 built tiny. Every layer reads an input of its own, ``(b, s, d_pl)`` with ``d_pl`` 16: after
its MLP, a gate ``h -> d_pl`` and an activation, multiplied by the layer's per-layer input, projected back
``d_pl -> h``, normed and added to the residual stream. Megatron's cut: the gate column-parallel, the projection
row-parallel; the per-layer input, whole on every rank, enters the pair through f and each rank multiplies its
own ``d_pl/t`` slice of it. Every hand-written model is ``(idx, targets) -> (logits, loss)``.

- ``embedded``: Gemma's: a second embedding ``(V, L·d_pl)`` of the ids and a projection ``h -> L·d_pl`` of the
  token embeddings, viewed ``(b, s, L, d_pl)`` and normed over ``d_pl``, summed, and layer ``l`` reading
  ``inputs[:, :, l, :]`` (a select of the layer dim);
- ``table``: the second embedding's output split into the layers' pieces with ``torch.split``, and a learned
  ``(L, d_pl)`` table whose row ``l`` scales layer ``l``'s gate (``table[l]``, cut with the gate's features);
  a sigmoid for the activation;
- ``gemma4_text``: Hugging Face's Gemma 4 text model (2 layers, a sliding and a full attention layer, a
  per-layer width of 32 over a per-layer vocabulary of 128) on ``input_ids`` and ``labels``;
- ``gemma4``: Hugging Face's Gemma 4 with its vision tower, called on text alone (plans only): its pad row of
  the tied token table ``E[pad]`` is read by a ``torch.where`` whose result nothing reads.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, V, RMSNorm
from tiny_lm import hf_build, lm_build

L, DPL = 2, 16  # layers, per-layer width


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.n1, self.n2 = RMSNorm(H), RMSNorm(H)
        self.fc1, self.fc2 = nn.Linear(H, 4 * H, bias=False), nn.Linear(4 * H, H, bias=False)
        self.gate = nn.Linear(H, DPL, bias=False)
        self.proj = nn.Linear(DPL, H, bias=False)

    def forward(self, x, per_layer, scale=None):
        x = x + self.fc2(F.gelu(self.fc1(self.n1(x))))
        if self.kind == "embedded":
            g = F.gelu(self.gate(x), approximate="tanh")  # (b, s, d_pl)
        else:
            g = torch.sigmoid(self.gate(x)) * scale  # scale: this layer's row of the table, (d_pl,)
        return x + self.n2(self.proj(g * per_layer))  # per_layer: (b, s, d_pl), whole


class LM(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(V, H)
        self.emb_pl = nn.Embedding(V, L * DPL)
        if kind == "embedded":
            self.model_proj = nn.Linear(H, L * DPL, bias=False)
            self.pl_norm = RMSNorm(DPL)
        else:
            self.table = nn.Parameter(torch.randn(L, DPL, generator=torch.Generator().manual_seed(4)))
        self.blocks = nn.ModuleList([Block(kind) for _ in range(L)])
        self.norm = RMSNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx, targets):
        b, s = idx.shape
        x = self.emb(idx)
        if self.kind == "embedded":
            tok = self.emb_pl(idx).reshape(b, s, L, DPL) * DPL ** 0.5
            ctx = self.pl_norm((self.model_proj(x) * H ** -0.5).reshape(b, s, L, DPL))  # normed over d_pl
            inputs = (ctx + tok) * 2 ** -0.5  # (b, s, L, d_pl)
            for i, blk in enumerate(self.blocks):
                x = blk(x, inputs[:, :, i, :])
        else:
            pieces = torch.split(self.emb_pl(idx), DPL, dim=-1)  # L of (b, s, d_pl)
            for i, blk in enumerate(self.blocks):
                x = blk(x, pieces[i], self.table[i])
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


SPELLINGS = ("embedded", "table")
HF = ("gemma4_text",)
KINDS = (*SPELLINGS, *HF, "gemma4")


def _text_sizes() -> dict:
    return dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=512,
                layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=32,
                vocab_size_per_layer_input=128, global_head_dim=32, pad_token_id=0, bos_token_id=0, eos_token_id=0, use_cache=False)


def _gemma4(kind: str):
    from transformers import Gemma4Config, Gemma4TextConfig

    text = Gemma4TextConfig(**_text_sizes())
    if kind == "gemma4_text":
        cfg = text
    else:
        cfg = Gemma4Config(text_config=text.to_dict(), vision_config=dict(hidden_size=64, intermediate_size=128,
                                                                          num_hidden_layers=1, num_attention_heads=4,
                                                                          num_key_value_heads=4, head_dim=16),
                           audio_config=None)
    model, args, kwargs = hf_build(cfg, low=1)
    model.config.use_cache = False
    return model, args, kwargs


def build(kind: str):
    if kind in ("gemma4_text", "gemma4"):
        return _gemma4(kind)
    return lm_build(lambda: LM(kind))
