"""Hugging Face causal-LM families built tiny from their configs, for parity at tp 2 and 4: each model is
called as a training step calls it, ``model(input_ids=ids, labels=ids)``, and returns the loss with the
logits.

- ``xlstm``: xLSTM, whose mLSTM layers concatenate their gate pre-activations with ``torch.concatenate``
  (``aten.concatenate``, an alias of ``cat`` that autotp's table now lists);
- ``lfm3``: LFM3, a hybrid of a gated short-convolution layer (in projection, a depthwise ``conv1d`` over
  the sequence, out projection: sharded by channels, the filters with them) and a grouped-query attention
  layer (2 kv heads);
- ``hrm_text``: HRM-Text, whose two stacks of 2 layers are applied again and again in nested loops: every
  weight is used by several matmuls, each use cut alike.
"""
from __future__ import annotations

import torch

KINDS = ("xlstm", "lfm3", "hrm_text")


def build(kind: str):
    from transformers import AutoModelForCausalLM, HrmTextConfig, Lfm3Config, xLSTMConfig

    ids = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0, "use_cache": False}
    cfg = {"xlstm": lambda: xLSTMConfig(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=128, **ids),
           "lfm3": lambda: Lfm3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64, layer_types=["conv", "full_attention"], **ids),
           "hrm_text": lambda: HrmTextConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_attention_heads=4, head_dim=16, max_position_embeddings=64,
                                             num_layers_per_stack=2, **ids),
           }[kind]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, (), {"input_ids": ids, "labels": ids}
