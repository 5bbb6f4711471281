"""Hugging Face mixture-of-experts and latent-attention models from small random configs (2 layers, width 64,
4 heads, 4 experts of 32 features, top-2, vocab 96): ``build(kind) -> (model, (), kwargs)``.

Experts are stored fused as 3-D parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) and run
by the implementation the kind names: ``grouped_mm`` (the default: tokens sorted by expert, one grouped GEMM)
or ``batched_mm`` (a weight gathered per (token, k) slot, ``bmm``)."""
from __future__ import annotations

import torch

V = 96
COMMON = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
              bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _config(name: str):
    import transformers as T

    moe = dict(intermediate_size=32, num_experts_per_tok=2)
    if name == "mixtral":
        return T.MixtralForCausalLM, T.MixtralConfig(**COMMON, **moe, num_local_experts=4, num_key_value_heads=2)
    if name == "qwen2_moe":  # a shared expert scaled by sigmoid(gate(x)) beside the routed ones
        return T.Qwen2MoeForCausalLM, T.Qwen2MoeConfig(**COMMON, **moe, moe_intermediate_size=32,
                                                       shared_expert_intermediate_size=32, num_experts=4,
                                                       num_key_value_heads=2, decoder_sparse_step=1)
    if name == "qwen3_moe":
        return T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig(**COMMON, **moe, moe_intermediate_size=32, num_experts=4,
                                                       num_key_value_heads=2, head_dim=16, decoder_sparse_step=1)
    if name == "olmoe":
        return T.OlmoeForCausalLM, T.OlmoeConfig(**COMMON, **moe, num_experts=4, num_key_value_heads=4)
    if name == "deepseek_v3":  # latent attention; a dense first layer, then routed + shared experts
        return T.DeepseekV3ForCausalLM, T.DeepseekV3Config(
            **COMMON, **moe, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, n_group=2,
            topk_group=1, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1)
    if name == "gpt_oss":  # experts with biases and gate/up interleaved, attention sinks, a router with a bias
        return T.GptOssForCausalLM, T.GptOssConfig(**COMMON, **moe, num_local_experts=4, num_key_value_heads=2,
                                                   head_dim=16, sliding_window=4,
                                                   layer_types=["sliding_attention", "full_attention"])
    if name == "ernie4_5_moe":  # a dense first layer; a (1, E) correction bias steering topk; 2 shared experts
        return T.Ernie4_5_MoeForCausalLM, T.Ernie4_5_MoeConfig(
            **COMMON, intermediate_size=32, moe_intermediate_size=32, moe_k=2, moe_num_experts=4,
            moe_num_shared_experts=1, moe_layer_start_index=1, num_key_value_heads=2)
    raise ValueError(name)


def build(kind: str):
    """``kind``: a model name, optionally ``:batched_mm`` for that experts implementation. ``deepseek_v3_idle``:
    DeepSeek-V3 whose routing bias rules out its second expert group (experts 2 and 3 get no tokens)."""
    name, _, impl = kind.partition(":")
    idle = name.endswith("_idle")
    cls, cfg = _config(name.removesuffix("_idle"))
    cfg.loss_type = "ForCausalLM"
    if impl:
        cfg._experts_implementation = impl
    torch.manual_seed(0)
    model = cls(cfg)
    if idle:  # group-limited routing scores a group by its best experts: -1e4 on one rules the group out
        for m in model.modules():
            if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor):
                m.e_score_correction_bias[-1] = -1e4
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, (), {"input_ids": ids, "labels": ids, "use_cache": False}
