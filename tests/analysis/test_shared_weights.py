"""Weights used more than once in a forward (tests/support/shared_weight_models.py): one block applied in a
loop, one block object listed twice, weights tied between blocks. Each use is a column or row of its own pair,
cut alike, so one shard serves them all: fully sharded and exact at tp 2 and 4, each application of a block
with its own two all-reduces. A weight whose uses cannot be cut alike (a column in one block, a row in the next)
leaves those pairs whole, with the reason, and still trains exactly."""
from __future__ import annotations

import pytest

from autotp.plan.planner import make_plan
from parity_checks import assert_patterns_train_exactly
from pattern_models import H, S
from shared_weight_models import KINDS, LAYERS
from spelling_runs import SpellingRuns
from shared_graphs import SHARED, spelling

RUNS = SpellingRuns("shared", "shared_weight_models", KINDS, ["looped", "unlike"])


@SHARED
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "unlike"])
def test_each_use_of_a_shared_weight_is_a_pair_of_its_own(kind: str):
    gm = spelling("shared_weight_models", kind)[3]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated)
        rows = [c for c in plan.collectives if c.kind == "all_reduce" and c.direction == "forward"
                and c.module.startswith(("block.", "blocks."))]
        assert len(rows) == 2 * LAYERS[kind], rows  # attention's and the MLP's, per application of a block


@SHARED
def test_a_weight_cut_unlike_in_its_uses_is_left_whole_with_its_pairs():
    gm = spelling("shared_weight_models", "unlike")[3]
    plan = make_plan(gm, 2)
    shards = dict(plan.params)
    assert "blocks.0.attn.q.weight" not in shards and "blocks.1.attn.o.weight" not in shards
    assert any("used by more than one matmul, and its uses cannot all be cut alike" in why
               for _, why in plan.replicated), plan.replicated
    assert shards["blocks.0.mlp.gate.weight"].role == "column"  # the MLPs are cut as ever


@pytest.mark.slow
@pytest.mark.parametrize("world,part", RUNS.params)
def test_shared_weights_train_exactly_with_megatron_collectives(world: int, part: str):
    results = RUNS(world, part)
    for kind in RUNS.kinds(part):
        assert_patterns_train_exactly({rank: {kind: by[kind]} for rank, by in results.items()}, [kind], world,
                                      bsh=2 * S * H, tokens=2 * S, layers=LAYERS[kind],
                                      sharded=lambda k: k != "unlike")
