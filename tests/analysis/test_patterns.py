"""The attention and MLP spellings of public model code, each sharded head-parallel with exactly Megatron's
collectives: rotary (interleaved with stack/flatten, partial, complex), q/k norms per head and over the whole
width, ALiBi slopes, baddbmm over [b·heads, s, d], tanh soft-capping, parallel attention + MLP blocks, fused
projections read by split, offset slices, index lists and per-group views (also with fewer kv groups than
ranks), multi-query keys and values of one head broadcast over the query heads, var and p-norms over the width,
and KV caches kept in module buffers."""
from __future__ import annotations

import pytest

from ranks import Launches
from parity_workers import cache_parity, pattern_parity
from pattern_models import HD, MQA, NH, H, S

SHARDED = ["plain", "rope_interleaved", "rope_partial", "rope_complex", "qk_norm_head", "qk_layernorm_head",
           "qk_norm_width", "qk_rmsnorm_width", "qk_layernorm_width", "alibi", "softcap", "baddbmm",
           "baddbmm_alibi", "parallel", "offset_slices", "grouped_view_mha", "fused_mqa", "falcon_mqa", "gqa_qk_norm",
           "qk_varnorm_width", "qk_l2norm_width", "falcon_mqa_index", "grouped_view", "grouped_index", *MQA]
# fused projections whose kv heads (2, or 1 for multi-query) are fewer than tp: replicated, Megatron's way
# (grouped: Falcon's [2 kv groups, 2 q heads + k + v, d]; at tp 4 each group's q heads are split over 2 ranks)
# (multi-query: its one k and v head, broadcast over the q heads unexpanded, expanded, repeated or written out)
KV_HEADS = {"offset_slices": 2, "fused_mqa": 1, "falcon_mqa": 1, "gqa_qk_norm": 2, "falcon_mqa_index": 1,
            "grouped_view": 2, "grouped_index": 2, **{kind: 1 for kind in MQA}}
# fused projections with a bias: its kv blocks, replicated like the weight's, get their gradients summed too
BIASED = {"mqa_bcast_bias", "falcon_bcast_bias", "bigcode_bias"}
# a norm over the whole projection width: one all-reduce of its b·s statistics per reduction, forward and
# backward (layer_norm and var: sums of x and x² stacked, 2·b·s; a hand-written LayerNorm: a mean and a var)
WIDTH_NORMS = {"qk_norm_width": [1], "qk_rmsnorm_width": [1], "qk_layernorm_width": [2], "qk_varnorm_width": [1, 2],
               "qk_l2norm_width": [1]}
# per-head norms: each learned vector (weight, and bias for LayerNorm) of q's and k's norm enters through f
HEAD_NORMS = {"qk_norm_head": 1, "gqa_qk_norm": 1, "qk_layernorm_head": 2}
CACHES = ["index_put", "index_copy", "mqa"]
# one of each way the sharding changes with tp (kv heads fewer than 4 in a fused split, by offsets, by groups,
# broadcast with a bias; width statistics; a parallel block) at tp 2 by default and at tp 4 in the extended run,
# which trains the other spellings at tp 2 and 4 too (each spelling's plan at tp 2 and 4 is
# tests/passes/test_structure.py's)
CORE = ["plain", "qk_norm_width", "parallel", "offset_slices", "grouped_view", "falcon_mqa", "mqa_bcast_bias"]
AT = {2: CORE, 4: CORE}
OTHERS_AT_2 = [k for k in SHARDED if k not in CORE]
REST = ["rope_interleaved", "qk_norm_head", "qk_layernorm_width", "alibi", "gqa_qk_norm", "grouped_index",
        "falcon_mqa_index", "mqa_bcast", "falcon_bcast_bias", "bigcode_bias"]


@pytest.fixture(scope="module")
def runs() -> Launches:
    """Both tests' jobs in one launch per world; tp 4 (kv heads fewer than tp, held by several ranks) in the
    extended run: four ranks on CI's two cores cost the most of any launch (the plans at tp 4 are checked
    without a process group by the structural tests)."""
    return Launches({2: {"patterns": (pattern_parity, AT[2]), "caches": (cache_parity, CACHES)}},
                    extended={2: {"others": (pattern_parity, OTHERS_AT_2)},
                              4: {"patterns": (pattern_parity, AT[4]), "caches": (cache_parity, CACHES),
                                  "rest": (pattern_parity, REST)}})


@pytest.mark.slow
@pytest.mark.parametrize("world,part", [(2, "patterns"), pytest.param(2, "others", marks=pytest.mark.extended),
                                        pytest.param(4, "patterns", marks=pytest.mark.extended),
                                        pytest.param(4, "rest", marks=pytest.mark.extended)])
def test_patterns_shard_exactly_with_megatron_collectives(runs, world: int, part: str):
    results = runs(world, part)
    bsh, layers = 2 * S * NH * HD, 2
    for rank, by_kind in results.items():
        assert list(by_kind) == {"rest": REST, "others": OTHERS_AT_2}.get(part, AT[world])
        for kind, r in by_kind.items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert not r["replicated"], (kind, r["replicated"])
            assert r["whole"] == {} and r["unexplained"] == [], (kind, r["whole"], r["unexplained"])
            replicated_kv = KV_HEADS.get(kind, NH) < world
            qkv = [f"blocks.{i}.attn.qkv.{p}" for i in range(layers) for p in ("bias", "weight")
                   if p == "weight" or kind in BIASED] if replicated_kv else []
            assert r["quarter"] == [n for n in qkv if n.endswith("weight")], (kind, r)  # else 1/tp
            assert r["kv_replicated"] == qkv, (kind, r)
            # forward: embedding + 2 per layer (b·s·h), the loss's max and 2 sums (b·s), width-norm statistics
            stats = [("all_reduce", "sum", 2 * S * k) for k in WIDTH_NORMS.get(kind, [])] * 2 * layers
            assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * (2 * layers + 1) + stats + [
                ("all_reduce", "max", 2 * S), ("all_reduce", "sum", 2 * S), ("all_reduce", "sum", 2 * S)]), kind
            # backward: entering attention and the MLP per layer, the LM head
            # (a parallel block's attention and MLP read one input: they share its f, one all-reduce per layer)
            entering = (layers if kind == "parallel" else 2 * layers) + 1
            assert [c for c in r["backward"] if c[2] == bsh] == [("all_reduce", "sum", bsh)] * entering, kind
            # per-head q/k norm weights see only this rank's heads: their gradients are summed (Megatron
            # all-reduces q/k layernorm gradients over the TP group too)
            small = [c for c in r["backward"] if c[2] != bsh]
            norms = [("all_reduce", "sum", HD)] * 2 * layers * HEAD_NORMS.get(kind, 0)
            # kv blocks held by several ranks: their weight gradients are summed over those ranks
            kv = [("all_reduce", "sum", HD * H)] * 2 * layers if replicated_kv else []  # k and v: one head each
            kv += [("all_reduce", "sum", HD)] * 2 * layers if replicated_kv and kind in BIASED else []  # their biases
            assert sorted(small) == sorted(norms + kv + stats), (kind, small)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_kv_cache_buffers_written_in_place_shard_by_kv_head(runs, world: int):
    """gpt-fast's ``cache[:, :, pos] = k`` and torchtune's ``index_copy_``: prefill, then one-token decode
    calls under no_grad, exact; each rank caches its own kv heads (2 kv heads: 1 per rank at tp 2, and at
    tp 4 each held by 2 ranks; one kv head of multi-query attention: held by every rank); a decode step costs
    the embedding's and 2 per layer all-reduces of b·h, and reading its logits one all-gather of b·V."""
    from cache_models import B, H as CH, HD as CHD, MAXS, V as CV

    for rank, by_kind in runs(world, "caches").items():
        for kind, r in by_kind.items():
            assert not r["replicated"], (kind, r["replicated"])
            assert r["tokens_equal"] and r["logits_diff"] <= 1e-5, (rank, kind, r)
            assert r["cache_shape"] == [B, 1, MAXS, CHD], (kind, r["cache_shape"])
            assert r["decode"] == [("all_reduce", "sum", B * CH)] * 5 + [("all_gather", "", B * CV)], (kind, r["decode"])
