"""Shared-KV multi-query attention with a grouped low-rank output projection and hyper-connections
(tests/support/shared_kv_models.py, DeepSeek-V4's layout), cut as Megatron cuts multi-query attention: the query
up-projection by heads, the one key head (also the value head) and the keys pooled from it over windows of the
sequence whole on every rank (their weights' gradients summed), the sinks with their heads, the grouped output
projection ``o_a`` by groups (block-diagonal: each rank holds whole groups of its heads' features, its rows of those
groups) and ``o_b`` row-parallel: one all-reduce forward per attention; the hyper-connections' mixing linears (the
few weights per token of all residual streams) whole as gates.

Hugging Face's DeepSeek-V4 (a capture of tens of seconds: extended run) is planned the same way."""
from __future__ import annotations

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from ranks import Launches
from shared_kv_models import GROUPS, H, HD, HF_KINDS, N, NH, O, Q_LAT, S, WIN, WRITTEN, build

LAYERS = 2
BY_DESIGN = ("gate kept whole", "down-projection kept whole", "router kept whole")


@pytest.fixture(scope="module")
def written():
    """Each spelling captured once for the module's tests, when one first asks for it."""
    graphs: dict[str, object] = {}

    def get(kind: str):
        if kind not in graphs:
            model, args, kwargs = build(kind)
            graphs[kind] = capture(model, args, kwargs)[0]
        return graphs[kind]
    return get


@pytest.mark.parametrize("kind", WRITTEN)
def test_shared_kv_attention_is_cut_by_heads_and_its_grouped_output_by_groups(written, kind: str):
    gm = written(kind)
    g = GROUPS[kind]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), (tp, plan.replicated)
        why = {w.name: w.reason for w in plan.whole}
        assert all(r.startswith(BY_DESIGN) for r in why.values()), (tp, why)
        for i in range(LAYERS):
            a = f"blocks.{i}.attn"
            for hc in ("attn_hc", "ffn_hc"):
                gate = f"gate kept whole: its {N * H}→{(2 + N) * N} linear"
                assert why[f"blocks.{i}.{hc}.fn"].startswith(gate), (tp, why)
            assert why[f"{a}.q_a.weight"].startswith("down-projection kept whole"), (tp, why)
            cut = {n[len(a) + 1:]: (s.role, s.local_shape) for n, s in plan.params if n.startswith(a + ".")}
            expect = {
                "q_b.weight": ("column", (NH * HD // tp, Q_LAT)),
                "kv_proj.weight": ("column", (HD, H)),  # the one key head, whole on every rank
                "kv_norm.weight": ("column", (HD,)),
                "sinks": ("column", (NH // tp,)),
                "o_a.weight": ("column", (g * O // tp, NH * HD // g)),  # this rank's groups
                "o_b.weight": ("row", (H, g * O // tp)),
            }
            if kind == "grouped_bmm":  # the pooled keys' projections: one head, whole
                expect.update({"compressor.kv_proj.weight": ("column", (HD, H)),
                               "compressor.gate_proj.weight": ("column", (HD, H)),
                               "compressor.position_bias": ("column", (4, HD)),
                               "compressor.norm.weight": ("column", (HD,))})
            assert {k: v for k, v in cut.items() if k in expect} == expect, (tp, i, cut)
            assert not set(cut) - set(expect) - {"q_norm.weight"}, (tp, i, cut)
            # Megatron's collectives: forward the row's all-reduce (b·s·h), backward one f of the q latent and
            # the block input (the key head's and pooled keys' projections read it)
            mine = sorted((c.direction, c.shape[-1]) for c in plan.collectives if c.module == a)
            assert mine == sorted([("backward", str(H)), ("backward", str(Q_LAT)), ("forward", str(H))]), (tp, i, mine)


def test_groups_fewer_than_ranks_keep_attention_whole_with_the_reason(written):
    """2 groups of 2 heads each: cut by groups at tp 2; at tp 4 a rank's one head is half a group, whose o_a block
    reads the whole group (a partial sum no Megatron cut has), so attention stays whole, saying so."""
    gm = written("grouped_pairs")
    assert make_plan(gm, 2).replicated == ()
    why = dict(make_plan(gm, 4).replicated)["blocks.0.attn"]
    assert why.startswith("view regroups the sharded dim (of 4, cut in 4) with the dims after it into 2 groups of "
                          "32: 2 groups are not divisible by tp=4, so a group would span ranks"), why


@pytest.mark.extended
def test_deepseek_v4_is_planned_fully_sharded():
    """Hugging Face's DeepSeek-V4 built tiny as benchmarks/op_coverage.py builds it (a heavily compressed
    attention layer, then a compressed sparse one with its indexer; hash-routed then top-k MoE): nothing
    replicated at tp 2 and 4, every weight cut or whole by design."""
    model, args, kwargs = build("deepseek_v4")
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), (tp, plan.replicated)
        why = {w.name: w.reason.split(":")[0] for w in plan.whole}
        assert set(why.values()) <= {*BY_DESIGN, "indexer kept whole", "read by nothing in this call's graph"}, why
        cut = dict(plan.params)
        for i in range(2):
            a = f"model.layers.{i}.self_attn"
            for name, role in (("q_b_proj", "column"), ("kv_proj", "column"), ("o_a_proj", "column"),
                               ("o_b_proj", "row")):
                assert cut[f"{a}.{name}.weight"].role == role, (tp, a, name)
            assert why[f"model.layers.{i}.attn_hc.fn"] == "gate kept whole", why


PARITY = Launches({2: {"shared_kv": (pattern_parity, list(WRITTEN), 3, False, "shared_kv_models")}},
                  extended={2: {"hf": (pattern_parity, list(HF_KINDS), 3, False, "shared_kv_models")},
                            4: {"shared_kv": (pattern_parity, list(WRITTEN), 3, False, "shared_kv_models")}})


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_shared_kv_attention_trains_exactly_with_megatron_collectives(world: int):
    """Loss, gradients and parameters after 3 AdamW steps within 1e-5 of one device, at most 1/tp + 0.12 of
    the parameters per rank. Forward: per layer attention's and the MLP's all-reduce and the embedding's
    (b·s·h), the loss's max and two sums (b·s), none for the key head's norm (every rank holds the head whole).
    Backward: per layer f of the q latent (b·s·24) and of the attention's and the MLP's inputs (b·s·h), the LM
    head's, and the gradients of the weights every rank holds whole for the one key head (its projection and
    norm; the pooled keys' two projections, norm and position bias), partial per rank, summed as Megatron sums
    replicated kv heads'."""
    bsh, bs = 2 * S * H, 2 * S
    for rank, by_kind in PARITY(world, "shared_kv").items():
        assert list(by_kind) == list(WRITTEN), (rank, list(by_kind))
        for kind, r in by_kind.items():
            where = (rank, kind)
            assert_exact(r, where)
            assert_fully_sharded(r, world, where)
            assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * (2 * LAYERS + 1)
                                                  + [("all_reduce", "max", bs)] + [("all_reduce", "sum", bs)] * 2), \
                (where, r["forward"])
            head = [HD * H, HD] + ([HD * H, HD * H, HD, WIN * HD] if kind == "grouped_bmm" else [])
            backward = [bsh] * (2 * LAYERS + 1) + [bs * Q_LAT] * LAYERS + head * LAYERS
            assert sorted(r["backward"]) == sorted(("all_reduce", "sum", n) for n in backward), (where, r["backward"])


@pytest.mark.slow
@pytest.mark.extended
def test_deepseek_v4_trains_exactly_with_megatron_collectives():
    """Hugging Face's DeepSeek-V4 at world 2 (a capture of tens of seconds on each rank): 3 AdamW steps within
    1e-5 of one device; forward the all-reduces of each attention and MoE layer and of the embedding (b·s·h) and
    the loss's three (b·s), none for the indexer or the key head's norms. The first layer's pooled keys (windows
    of 128 tokens, none in a sequence of 8) read their projection only for its dtype: its gradient stays None on
    every rank, as on one device, so AdamW does not step it."""
    bsh, bs = 2 * 8 * 64, 2 * 8
    for rank, by_kind in PARITY(2, "hf").items():
        r = by_kind["deepseek_v4"]
        assert_exact(r, (rank, "deepseek_v4"))
        assert not r["replicated"], (rank, r["replicated"])
        assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * 5 + [("all_reduce", "max", bs)]
                                              + [("all_reduce", "sum", bs)] * 2), (rank, r["forward"])
