"""Experts stored as 3-D parameters and read whole by a batched matmul, every expert on its own rows of tokens
(Llama 4's text experts: the tokens repeated once per expert and scaled by the routing scores), in small LMs
like tests/support/pattern_models.py's (width 64, 4 heads of 16, vocab 96, 2 layers, 4 experts of 32
features). Every model is ``(idx, targets) -> (logits, loss)``.

- ``bmm_chunk``: ``torch.bmm(x [E, T, H], gate_up [E, H, 2I])``, ``chunk(2, -1)`` into gate | up,
  ``torch.bmm(up * silu(gate), down [E, I, H])``; top-1 scores by sigmoid, scattered into a dense ``(T, E)``
  matrix, and a shared SwiGLU expert added in place (Llama 4's layer);
- ``matmul_split``: ``x @ w_in`` (``torch.matmul`` of two 3-D tensors), ``split(I, -1)``, softmax scores
  over every expert, no shared expert;
- ``bmm_transposed``: weights stored ``[E, 2I, H]`` / ``[E, H, I]`` and read ``w.transpose(1, 2)``, gate and up
  taken by slicing ``h[..., :I]``, ``h[..., I:]``.

Hugging Face's own (``HF_KINDS``), called ``model(input_ids=ids, labels=ids)``:

- ``llama4_text``: Llama 4's text model (2 layers, 4 experts of 32 features, top-1, a shared expert), its
  experts' ``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]`` read by ``torch.bmm``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, Attention, SwiGLU
from tiny_lm import Residual, TinyLM, hf_build, lm_build

E, I = 4, 32  # experts, expert features
KINDS = ("bmm_chunk", "matmul_split", "bmm_transposed")
HF_KINDS = ("llama4_text",)


class BatchedExperts(nn.Module):
    """Every expert on every token: ``(T, H) -> (T, H)``, the tokens weighted by their routing scores."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.router = nn.Linear(H, E, bias=False)
        if kind == "bmm_transposed":
            self.w_in = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
            self.w_out = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        else:
            self.w_in = nn.Parameter(torch.randn(E, H, 2 * I) * H ** -0.5)
            self.w_out = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.shared = SwiGLU() if kind == "bmm_chunk" else None

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """``(T, E)`` routing scores: top-1 sigmoid scattered into zeros (Llama 4), or a softmax over all."""
        logits = self.router(x)
        if self.kind != "bmm_chunk":
            return F.softmax(logits, dim=-1)
        top, sel = torch.topk(logits, 1, dim=-1)
        return torch.full_like(logits, float("-inf")).scatter(1, sel, top).sigmoid()

    def forward(self, x):
        b, s, h = x.shape
        x = x.reshape(-1, h)  # (T, H)
        scores = self.scores(x)  # (T, E)
        routed = x.repeat(E, 1) * scores.transpose(0, 1).reshape(-1, 1)  # (E·T, H), expert-major
        routed = routed.view(E, -1, h)  # (E, T, H)
        if self.kind == "bmm_chunk":
            gate, up = torch.bmm(routed, self.w_in).chunk(2, dim=-1)
            y = torch.bmm(up * F.silu(gate), self.w_out)
        elif self.kind == "matmul_split":
            gate, up = (routed @ self.w_in).split(I, dim=-1)
            y = (F.silu(gate) * up) @ self.w_out
        else:
            hid = torch.bmm(routed, self.w_in.transpose(1, 2))
            y = torch.bmm(F.silu(hid[..., :I]) * hid[..., I:], self.w_out.transpose(1, 2))
        out = y.sum(dim=0)  # (T, H): each token's experts added
        if self.shared is not None:
            shared = self.shared(x)
            shared.add_(out)
            out = shared
        return out.view(b, s, h)


def _hf(kind: str):
    from transformers import Llama4TextConfig

    ids = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0, "use_cache": False}
    cfg = {"llama4_text": lambda: Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        num_local_experts=E, num_experts_per_tok=1, **ids)}[kind]()
    return hf_build(cfg)


def build(kind: str):
    if kind in HF_KINDS:
        return _hf(kind)
    # two blocks of plain attention then the experts
    return lm_build(lambda: TinyLM(lambda: Residual(attn=lambda: Attention("plain"), moe=lambda: BatchedExperts(kind))))
