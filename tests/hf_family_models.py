"""Hugging Face causal-LM families built tiny from their configs, for parity at tp 2 and 4: each model is
called as a training step calls it, ``model(input_ids=ids, labels=ids)``, and returns the loss with the
logits.

- ``xlstm``: xLSTM, whose mLSTM layers concatenate their gate pre-activations with ``torch.concatenate``
  (``aten.concatenate``, an alias of ``cat`` that autotp's table now lists).
"""
from __future__ import annotations

import torch

KINDS = ("xlstm",)


def build(kind: str):
    from transformers import AutoModelForCausalLM, xLSTMConfig

    cfg = {"xlstm": lambda: xLSTMConfig(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=128,
                                        pad_token_id=0, bos_token_id=0, eos_token_id=0, use_cache=False)}[kind]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, (), {"input_ids": ids, "labels": ids}
