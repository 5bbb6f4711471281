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

``MIXER_KINDS`` (trained in the extended run only): hybrids whose mixers are cut by channels.

- ``nemotron_h``: Nemotron-H, a Mamba-2 layer (8 heads of 16, 4 groups of B/C states of 16, chunks of 4
  positions: two chunks of the 8) and an MLP layer; its reference path reads the conv1d filters and
  ``-exp(A_log)`` twice, once in a branch nothing reads;
- ``nemotron_h_2_groups``: the same with 2 groups of B/C states, fewer than 4 ranks;
- ``qwen3_5``, ``qwen3_5_moe``: Qwen3.5's gated-delta-net layer (4 key heads, 8 value heads of 16: q and k
  repeated to the value heads) and a grouped-query attention layer, an MLP or a mixture of 4 experts with a
  shared expert; its gated norm runs on the heads folded under the batch, ``(b·s·h, d)``, then unfolds them
  merged with the head dim, ``(b, s, h·d)``;
- ``qwen3_5_2_key_heads``: Qwen3.5 with 2 key heads for 4 value heads (key heads fewer than 4 ranks);
- ``mamba``: Mamba (d_inner 128, 16 states, Δ rank 4), its reference path on CPU: in_proj's output
  ``(b, 2·d_inner, l)`` chunked into x | z, the depthwise ``conv1d`` by ``F.conv1d`` on the squeezed filters,
  ``x_proj`` split into Δ, B, C, ``dt_proj.weight @ Δ``, and the selective scan looped over time from
  ``A[None, :, None, :] * dt[:, :, :, None]``.
"""
from __future__ import annotations

from tiny_lm import hf_build

KINDS = ("xlstm", "lfm3", "hrm_text")
MIXER_KINDS = ("nemotron_h", "nemotron_h_2_groups", "qwen3_5", "qwen3_5_moe", "qwen3_5_2_key_heads", "mamba")


def _qwen3_5(moe: bool, key_heads: int, ids: dict):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                 layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                 linear_value_head_dim=16, linear_num_key_heads=key_heads, linear_num_value_heads=2 * key_heads)
    if moe:
        return Qwen3_5MoeTextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=32, **sizes, **ids)
    return Qwen3_5TextConfig(**sizes, **ids)


def _nemotron_h(groups: int, ids: dict):
    from transformers import NemotronHConfig

    return NemotronHConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                           layers_block_type=["mamba", "mlp"], ssm_state_size=16, mamba_num_heads=8,
                           mamba_head_dim=16, n_groups=groups, chunk_size=4, **ids)


def build(kind: str):
    from transformers import HrmTextConfig, Lfm3Config, MambaConfig, xLSTMConfig

    ids = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0, "use_cache": False}
    cfg = {"xlstm": lambda: xLSTMConfig(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=128, **ids),
           "lfm3": lambda: Lfm3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64, layer_types=["conv", "full_attention"], **ids),
           "hrm_text": lambda: HrmTextConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_attention_heads=4, head_dim=16, max_position_embeddings=64,
                                             num_layers_per_stack=2, **ids),
           "nemotron_h": lambda: _nemotron_h(4, ids),
           "nemotron_h_2_groups": lambda: _nemotron_h(2, ids),
           "qwen3_5": lambda: _qwen3_5(False, 4, ids),
           "qwen3_5_moe": lambda: _qwen3_5(True, 4, ids),
           "qwen3_5_2_key_heads": lambda: _qwen3_5(False, 2, ids),
           "mamba": lambda: MambaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, state_size=16,
                                        time_step_rank=4, num_hidden_layers=2, **ids),
           }[kind]()
    return hf_build(cfg)
