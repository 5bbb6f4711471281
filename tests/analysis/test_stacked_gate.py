"""Gated MLPs whose input projection's ``[gate | up]`` is read apart as a dim of 2 (tests/support/
stacked_gate_models.py: three hand-written spellings and Hugging Face's Moshi): the dim of 2 indexes segments,
so the projection is cut per segment (each rank the r-th slice of gate and of up) and the down projection by
rows, one all-reduce forward and one backward per MLP, as for a fused gate_up_proj. Pieces of one row each
were read as one head each, fewer than tp: the plan failed. Extended run (captures of seconds each)."""
from __future__ import annotations

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from pattern_models import H, S
from ranks import Launches
from stacked_gate_models import FF, build

SPELLINGS = ["view_select", "view_unbind", "reshape_index"]


@pytest.mark.extended
@pytest.mark.parametrize("kind", SPELLINGS)
def test_stacked_gate_up_is_cut_per_segment(kind: str):
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        params = dict(plan.params)
        fc1, fc2 = params["blocks.0.mlp.fc1.weight"], params["blocks.0.mlp.fc2.weight"]
        assert [(g.size, g.parts) for g in fc1.segments] == [(FF, tp), (FF, tp)], fc1
        assert fc1.local_shape == (2 * FF // tp, H) and (fc2.role, fc2.local_shape) == ("row", (H, FF // tp)), fc2
        mlp = sorted((c.op, c.direction) for c in plan.collectives if c.module == "blocks.0.mlp")
        assert mlp == [("sum", "backward"), ("sum", "forward")], (tp, mlp)


@pytest.mark.extended
def test_moshi_is_planned_fully_sharded():
    model, args, kwargs = build("moshi")
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        fc1 = dict(plan.params)["model.layers.0.mlp.fc1.weight"]
        assert [(g.size, g.parts) for g in fc1.segments] == [(64, tp), (64, tp)], fc1


RUNS = SPELLINGS + ["moshi"]
PARITY = Launches({}, extended={w: {"gates": (pattern_parity, RUNS, 3, False, "stacked_gate_models")} for w in (2, 4)})


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_stacked_gates_train_exactly_with_megatron_collectives(world: int):
    """3 AdamW steps: loss, gradients and parameters within 1e-5, every block cut, at most 1/tp + 0.12 of the
    parameters per rank; the hand-written LMs' step is Megatron's: forward per layer attention's and the MLP's
    all-reduce (b·s·h), the embedding's, the loss's max and two sums (b·s); backward per layer two f, and the
    head's."""
    bsh, bs = 2 * S * H, 2 * S
    for rank, by_kind in PARITY(world, "gates").items():
        assert list(by_kind) == RUNS, (rank, list(by_kind))
        for kind, r in by_kind.items():
            assert_exact(r, (rank, kind))
            assert_fully_sharded(r, world, (rank, kind))
            if kind == "moshi":
                continue
            assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * 5 + [("all_reduce", "max", bs)]
                                                  + [("all_reduce", "sum", bs)] * 2), (rank, kind, r["forward"])
            assert sorted(r["backward"]) == [("all_reduce", "sum", bsh)] * 5, (rank, kind, r["backward"])
