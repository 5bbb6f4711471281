"""Models for the pipeline tests: four blocks (so pp 2 × v 2 has a block per stage), loss in the forward."""
from __future__ import annotations

import torch
import torch.nn as nn


def nanogpt(layers: int = 4, dropout: float = 0.0) -> tuple[nn.Module, tuple, dict]:
    from nanogpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=layers, dropout=dropout))
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (8, 16), generator=g)
    targets = torch.randint(0, 256, (8, 16), generator=g)
    return model, (idx, targets), {}


def llama(layers: int = 4, kv_heads: int = 2) -> tuple[nn.Module, tuple, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0, loss_type="ForCausalLM", tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    return model, (), {"input_ids": ids, "labels": ids, "use_cache": False}


def llama_mqa() -> tuple[nn.Module, tuple, dict]:
    """Llama with one kv head (multi-query attention): at tp 2 both ranks hold it."""
    return llama(2, kv_heads=1)


def llama_positions() -> tuple[nn.Module, tuple, dict]:
    """Llama called with position ids of shape (1, s): an input the micro-batches share, not cut."""
    model, args, kwargs = llama()
    return model, args, {**kwargs, "position_ids": torch.arange(16).unsqueeze(0)}


def nanogpt_dropout() -> tuple[nn.Module, tuple, dict]:
    """nanoGPT with dropout: evaluation must run the graph captured in eval mode."""
    return nanogpt(dropout=0.1)


def moe() -> tuple[nn.Module, tuple, dict]:
    """A mixture-of-experts stack (tests/support/moe_models.py, experts in a ModuleList), on 4 sequences."""
    from moe_models import S, V, build

    model, _, kwargs = build("fused_loop")
    g = torch.Generator().manual_seed(1)
    return model, (torch.randint(0, V, (4, S), generator=g), torch.randint(0, V, (4, S), generator=g)), kwargs


MODELS = {"nanogpt": nanogpt, "llama": llama, "llama_mqa": llama_mqa, "llama_positions": llama_positions, "nanogpt_dropout": nanogpt_dropout,
          "moe": moe}
