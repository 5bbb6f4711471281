"""Relative-position logits gathered per head (tests/support/relative_logit_models.py: five hand-written
spellings and Hugging Face's Inkling): the logits over E distances come from one weight every head shares,
``(.., heads, .., d) @ W [d, E]``, and ``gather`` along the distances picks ``i - j`` for query i and key j.
The shared matmul is no column of a pair (the heads are its batch dim): cut by heads, each rank applies the
whole W to its own heads, W's gradient summed over the group, and the gather of a head-cut source by an index
that does not touch the heads is local (torch's gather strategy, the index read as this rank's slice). It was
read as a column cut on E, the gather dim, and attention was left replicated.

ProphetNet's layout: a projection of the hidden states to ``E·n`` bucket logits laid out ``(b, s, E, n)``, the
heads last. The view's outer dim is the one gathered along, so it is never cut: the projection is a column of
attention's pair cut by heads within each of its E buckets (it was cut on the buckets, and the gather refused
it). ProphetNet itself stays whole, named: its gather reads the logits with the heads folded between the batch
and the sequence, ``(b, n, s, E) -> (b·n·s, E)``, which no cut of one dim describes."""
from __future__ import annotations

import math

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from pattern_models import NH, H, S
from ranks import Launches
from relative_logit_models import DR, E, HD, build

SPELLINGS = ["hidden_relative", "query_relative", "einsum_relative"]
BUCKETS = ["buckets_heads_last", "buckets_unflatten"]  # a column of the pair, heads last in each bucket
SHARED = {"hidden_relative": ("proj", (DR, E)), "query_relative": ("rel", (E, HD)), "einsum_relative": ("rel", (E, HD))}


@pytest.mark.extended
@pytest.mark.parametrize("kind", SPELLINGS)
def test_relative_logits_are_cut_by_heads(kind: str):
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    name, shape = SHARED[kind]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), (tp, plan.replicated)
        # the shared weight alone is whole, by design, in both blocks
        assert [(w.name, w.reason.split(":")[0]) for w in plan.whole] == \
            [(f"blocks.{i}.attn.{name}", "head-shared weight kept whole") for i in range(2)], plan.whole
        params = dict(plan.params)
        assert params["blocks.0.attn.o.weight"].local_shape == (H, H // tp), params["blocks.0.attn.o.weight"]
        # the shared weight's gradient, partial per rank, is summed once per block (as read: rel.t() is (HD, E))
        grads = [c.shape for c in plan.collectives if c.module == "blocks.0.attn" and c.direction == "backward"]
        assert sum(g in (tuple(map(str, shape)), tuple(map(str, shape[::-1]))) for g in grads) == 1, (tp, grads)


@pytest.mark.parametrize("kind", BUCKETS)
def test_bucket_logits_heads_last_are_cut_by_heads(kind: str):
    """Nothing replicated or whole at tp 2 and 4; the bucket projection's rows (and bias) are, in each of its E
    buckets, this rank's heads: rank r holds rows ``e·n + h`` for its heads h of every bucket e."""
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    total = sum(p.numel() for p in model.parameters())
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (kind, tp, plan.replicated, plan.whole)
        params = dict(plan.params)
        for i in range(2):
            rel = params[f"blocks.{i}.attn.rel.weight"]
            assert rel.local_shape == (E * NH // tp, H), (kind, tp, rel)
            assert [(g.size, g.parts) for g in rel.segments] == [(NH, tp)] * E, (kind, tp, rel.segments)
            assert params[f"blocks.{i}.attn.rel.bias"].segments == rel.segments, (kind, tp)
        held = sum(math.prod(s.local_shape) for _, s in plan.params) + \
            sum(p.numel() for n, p in model.named_parameters() if n not in params)
        assert held / total <= 1 / tp + 0.12, (kind, tp, held / total)


@pytest.mark.extended
def test_prophetnet_names_its_heads_folded_with_the_sequence():
    """ProphetNet's n-gram self-attention: its relative-position logits ``(b, s, buckets, heads)`` are cut by
    heads (no longer on the buckets, which the gather reads whole), and the attention stays whole because the
    gather reads them as rows ``(b·heads·s, buckets)``: the reason says so, at the reshape. The n-gram embeddings,
    rows picked by constant indices, are whole as position embeddings."""
    model, args, kwargs = build("prophetnet")
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        reasons = dict(plan.replicated)
        attn = reasons["prophetnet.decoder.layers.0.self_attn"]
        assert attn.startswith("view folds the sharded dim (of 16) into one dim with ") and "reshape_4" in attn, \
            (tp, attn)
        kept = {w.name: w.reason for w in plan.whole}
        assert kept["prophetnet.decoder.ngram_embeddings.weight"].startswith(
            "position embedding: its rows are picked by constant indices"), kept


@pytest.mark.extended
def test_inkling2_cuts_its_sliding_attention_by_heads():
    """Inkling-2's sliding attention (its hidden-state relative-position bias scaled per head and L2-clipped,
    gathered along the distances): cut by heads at tp 2 and 4, the shared profiles whole."""
    model, args, kwargs = build("inkling2")
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        params = dict(plan.params)
        attn = "model.layers.0.self_attn"
        for w in ("q_proj.linear", "relative_position_bias.linear", "o_proj.gate_proj"):
            full = model.get_parameter(f"{attn}.{w}.weight").shape[0]
            assert params[f"{attn}.{w}.weight"].local_shape[0] == full // tp, (tp, w, params[f"{attn}.{w}.weight"])
        kept = {w.name: w.reason for w in plan.whole}
        assert kept[f"{attn}.relative_position_bias.proj"].startswith("head-shared weight kept whole"), kept


@pytest.mark.extended
def test_inkling_is_planned_fully_sharded():
    model, args, kwargs = build("inkling")
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), (tp, plan.replicated)
        kept = {w.name: w.reason.split(":")[0] for w in plan.whole}
        assert kept["model.layers.0.self_attn.rel_logits_proj.proj"] == "head-shared weight kept whole", kept
        assert kept["model.layers.0.attn_sconv.conv1d.weight"] == "filter kept whole", kept
        assert set(kept.values()) <= {"head-shared weight kept whole", "filter kept whole", "router kept whole"}, kept
        r_proj = "model.layers.0.self_attn.r_proj.weight"
        assert dict(plan.params)[r_proj].local_shape[0] == model.get_parameter(r_proj).shape[0] // tp


RUNS = SPELLINGS + ["inkling"]
MORE = {2: [BUCKETS[1]], 4: BUCKETS}  # the buckets' default launch: world 2 of the first
PARITY = Launches({2: {"buckets": (pattern_parity, BUCKETS[:1], 3, False, "relative_logit_models")}},
                  extended={w: {"relative": (pattern_parity, RUNS, 3, False, "relative_logit_models"),
                                "buckets_more": (pattern_parity, MORE[w], 3, False, "relative_logit_models")}
                            for w in (2, 4)})


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_relative_logits_train_exactly_with_megatron_collectives(world: int):
    """3 AdamW steps: loss, gradients and parameters within 1e-5, every block cut, at most 1/tp + 0.12 of the
    parameters per rank; the hand-written LMs' step is Megatron's (forward per layer attention's and the MLP's
    all-reduce of b·s·h, the embedding's, the loss's max and two sums of b·s; backward per layer two f and the
    head's), and per layer one all-reduce of the shared weight's gradient."""
    bsh, bs = 2 * S * H, 2 * S
    for rank, by_kind in PARITY(world, "relative").items():
        assert list(by_kind) == RUNS, (rank, list(by_kind))
        for kind, r in by_kind.items():
            assert_exact(r, (rank, kind))
            assert_fully_sharded(r, world, (rank, kind))
            if kind == "inkling":
                continue
            _, shape = SHARED[kind]
            assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * 5 + [("all_reduce", "max", bs)]
                                                  + [("all_reduce", "sum", bs)] * 2), (rank, kind, r["forward"])
            assert sorted(r["backward"]) == sorted([("all_reduce", "sum", bsh)] * 5
                                                   + [("all_reduce", "sum", shape[0] * shape[1])] * 2), \
                (rank, kind, r["backward"])


def _check_buckets(by_rank: dict, kinds: list[str], world: int) -> None:
    bsh, bs = 2 * S * H, 2 * S
    for rank, by_kind in by_rank.items():
        assert list(by_kind) == kinds, (rank, list(by_kind))
        for kind, r in by_kind.items():
            assert_exact(r, (rank, kind))
            assert_fully_sharded(r, world, (rank, kind))
            assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * 5 + [("all_reduce", "max", bs)]
                                                  + [("all_reduce", "sum", bs)] * 2), (rank, kind, r["forward"])
            assert sorted(r["backward"]) == [("all_reduce", "sum", bsh)] * 5, (rank, kind, r["backward"])


@pytest.mark.slow
def test_bucket_logits_train_exactly_with_megatron_collectives():
    """3 AdamW steps at world 2 (the bucket projection ``view(b, s, E, n)``, heads last): loss, gradients and
    parameters within 1e-5, at most 1/2 + 0.12 of the parameters per rank, and Megatron's step: forward per
    layer attention's and the MLP's all-reduce of b·s·h, the embedding's, the loss's max and two sums of b·s;
    backward per layer two f and the head's, nothing more (the projection is a column of attention's pair)."""
    _check_buckets(PARITY(2, "buckets"), BUCKETS[:1], 2)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_every_bucket_spelling_trains_exactly(world: int):
    """The unflatten spelling at world 2, both at world 4: exact, fully sharded, Megatron's collectives."""
    _check_buckets(PARITY(world, "buckets_more"), MORE[world], world)
