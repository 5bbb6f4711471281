"""A model file for ``autotp plan``: a Llama-shaped 70B decoder (80 layers, hidden 8192, 64 heads, 8 kv heads,
SwiGLU 28672, vocab 32000, sequence 4096), built by ``benchmarks/llama_shaped.py``. Plan it on meta:

    autotp plan benchmarks/llama70b.py --auto --world-size 64 --gpus-per-node 8 --gpu h100 --global-batch 256

Its example batch is one data-parallel replica's step of the layout that search chooses (64 sequences: the
global batch of 256 over dp 4, 64 micro-batches of 1; benchmarks/results/llama70b_auto.md), so the ``autotp
shard`` command it prints runs as printed.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_shaped import Config, LlamaShaped  # noqa: E402

SEQ = 4096
BATCH = 64  # sequences per data-parallel replica per step: 256 / dp 4
CONFIG = Config(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=SEQ)


def build_model() -> LlamaShaped:
    return LlamaShaped(CONFIG)


def example_batch() -> tuple[tuple, dict]:
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    return (ids, ids), {}
