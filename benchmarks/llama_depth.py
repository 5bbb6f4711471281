"""A model file for ``autotp plan`` whose depth is set from outside: the 70B-wide Llama-shaped decoder of
``benchmarks/llama_shaped.py`` (hidden 8192, SwiGLU 28672, 64 heads, 8 kv heads, vocab 32000) with
``AUTOTP_BENCH_LAYERS`` layers (default 8), planned on (1, 2048) token ids. Used by benchmarks/startup.py:

    AUTOTP_BENCH_LAYERS=32 autotp plan benchmarks/llama_depth.py --tp 8
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_shaped import Config, LlamaShaped  # noqa: E402

SEQ = 2048


def config(layers: int | None = None) -> Config:
    layers = int(os.environ.get("AUTOTP_BENCH_LAYERS", "8")) if layers is None else layers
    return Config(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers,
                  num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=SEQ)


def build_model() -> LlamaShaped:
    return LlamaShaped(config())


def example_batch() -> tuple[tuple, dict]:
    return (torch.zeros(1, SEQ, dtype=torch.long),), {}
