"""A Hugging Face Llama built from its config: a model file for ``autotp shard`` and ``autotp plan``.

Tiny (4 layers, hidden 64, 4 heads sharing 2 kv heads, vocab 256) so that it trains on CPU; the structure
is the real one (rotary embeddings, grouped-query attention, SwiGLU, RMSNorm, untied head)::

    autotp shard examples/llama.py --tp 2 --pp 2 --virtual-stages 2 --schedule Interleaved1F1B --microbatches 4

For a real checkpoint build the model from its config the same way and pass ``--weights PATH``.
"""
from __future__ import annotations

import torch
try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as exc:
    raise ImportError(f"{__file__} builds Hugging Face's Llama and needs transformers: "
                      "pip install 'autotp[hf]'") from exc


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config)


def example_batch(batch: int = 4, seq: int = 32) -> dict:
    ids = torch.randint(0, 256, (batch, seq))
    return {"input_ids": ids, "labels": ids, "use_cache": False}
