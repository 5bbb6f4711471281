"""Small models for tests: the nanoGPT example and Hugging Face GPT-2 / Llama from random configs."""
from __future__ import annotations

import torch
import torch.nn as nn


def nanogpt(dropout: float = 0.0) -> tuple[nn.Module, tuple, dict]:
    from nanogpt import GPT, GPTConfig, example_batch

    torch.manual_seed(0)
    model = GPT(GPTConfig(dropout=dropout))
    idx, targets = example_batch()
    return model, (idx, targets), {}


def gpt2(vocab: int = 128) -> tuple[nn.Module, tuple, dict]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM")
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(1))
    return model, (), {"input_ids": ids, "labels": ids, "use_cache": False}


def llama(vocab: int = 128, layers: int = 2) -> tuple[nn.Module, tuple, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0, loss_type="ForCausalLM")
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(1))
    return model, (), {"input_ids": ids, "labels": ids, "use_cache": False}


def gpt2_real_vocab() -> tuple[nn.Module, tuple, dict]:
    return gpt2(vocab=50257)  # GPT-2's own vocabulary: not divisible by 2 or 4, so it is padded


def llama_deep() -> tuple[nn.Module, tuple, dict]:
    return llama(layers=5)  # deep enough that capture exports two blocks and copies them for the other three


def llama_deep_cache() -> tuple[nn.Module, tuple, dict]:
    """llama_deep called as Hugging Face calls it by default: use_cache on, each layer's key and value returned
    besides the loss and logits (capture copies them with their blocks)."""
    model, args, kwargs = llama(layers=5)
    return model, args, {k: v for k, v in kwargs.items() if k != "use_cache"}


MODELS = {"nanogpt": nanogpt, "gpt2": gpt2, "gpt2_50257": gpt2_real_vocab, "llama": llama, "llama_deep": llama_deep}
PARITY_ONLY = {"llama_deep_cache": llama_deep_cache}  # run by the parity tests alone


def loss_and_logits(out) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits as the user reads them: vocab-parallel logits are gathered on demand)."""
    logits, loss = out if isinstance(out, tuple) else (out.logits, out.loss)
    return loss, logits
