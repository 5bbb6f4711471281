"""A mixture-of-experts layer written as the reference data-dependent loop (tests/support/moe_island_models.py:
``if mask.any()`` with ``nonzero`` and ``index_add_``, ``torch.where(mask)`` with ``out[tok] += ...``, a
boolean mask with ``continue`` and a load-balancing loss) captures as an island in the model's graph; its
experts are cut column→row per module, one all-reduce at the layer's output; a layer that cannot be cut so
runs whole with the reason. At tp 2 (and 4) losses, logits, gradients and 3 AdamW steps equal one device's."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autotp.capture.islands import ISLANDS_KEY
from autotp.capture.tracer import capture_blocks
from autotp.parallel.islands import bind_islands, module_planner
from autotp.plan.islands import IslandPlan, plan_island
from moe_island_models import E, H, STYLES, MoE, build
from ranks import Launches
from value_check_workers import forward_parity


def _plan(block: nn.Module, tp: int = 2) -> IslandPlan:
    shapes = dict([*block.named_parameters(), *block.named_buffers()])
    return plan_island(block, "moe", (torch.randn(2, 8, H),), {}, tp, shapes, module_planner(tp))


@pytest.mark.parametrize("style", STYLES)
def test_the_loop_is_an_island_and_the_rest_a_graph(style: str):
    model, (x, y) = build(style)
    gm = capture_blocks(model, (x, y), {}, writes=True).whole()[0]
    assert set(gm.meta[ISLANDS_KEY]) == {"blocks.0.moe", "blocks.1.moe"}
    # the graph around the islands keeps its attention and head: their matmuls are in the graph
    assert sum(n.target is torch.ops.aten.linear.default for n in gm.graph.nodes) >= 5
    # run whole (no group), the islands call the blocks themselves: the model's own numbers
    bind_islands(gm, model, {p: IslandPlan(p, reason="test") for p in gm.meta[ISLANDS_KEY]}, None)
    got, want = gm(x, y), model(x, y)
    assert torch.allclose(got[0], want[0], atol=1e-6) and torch.allclose(got[1], want[1], atol=1e-6)


@pytest.mark.parametrize("style,outputs", [("nonzero", ("sum",)), ("where", ("sum",)), ("bool_mask", ("sum", "same"))])
def test_each_expert_is_cut_column_to_row_and_the_router_kept_whole(style: str, outputs: tuple):
    plan = _plan(MoE(style))
    assert plan.reason == "" and plan.outputs == outputs
    roles = {n: s.role for n, s in plan.params}
    assert len(roles) == E * 3  # (w1, w3 | up and its bias) column, (w2 | down) row
    assert all(r == ("row" if n.endswith(("w2.weight", "2.weight")) else "column") for n, r in roles.items()), roles
    assert plan.whole_params == ("moe.gate.weight",)


def test_a_layer_no_all_reduce_gives_stays_whole_with_the_reason():
    class Residual(MoE):
        def forward(self, x):  # the input added after the experts: a sum over ranks would count it tp times
            return super().forward(x) + x

    plan = _plan(Residual("nonzero"))
    assert plan.params == () and "neither a sum" in plan.reason

    biased = MoE("nonzero")
    for ex in biased.experts:  # a bias after the row matmul: each rank's slice would add it
        ex.w2 = nn.Linear(ex.w2.in_features, H, bias=True)
    plan = _plan(biased)
    assert plan.params == () and "column→row" in plan.reason


@pytest.fixture(scope="module")
def runs() -> Launches:
    # by default the boolean-mask loop alone (its load-balancing loss and its two outputs make it the fullest);
    # every style is planned in the fast tier above, and trained in the extended run
    return Launches({2: {"moe": (forward_parity, "moe_island_models", ["bool_mask"])}},
                    extended={2: {"others": (forward_parity, "moe_island_models", ["nonzero", "where"])},
                              4: {"moe": (forward_parity, "moe_island_models", STYLES)}})


@pytest.mark.slow
@pytest.mark.parametrize("world,batch", [(2, "moe"), pytest.param(2, "others", marks=pytest.mark.extended),
                                         pytest.param(4, "moe", marks=pytest.mark.extended)])
def test_moe_islands_train_as_on_one_device(runs, world: int, batch: str):
    for rank, by_style in runs(world, batch).items():
        for style, r in by_style.items():
            assert max(r["logits"], r["loss"], r["grad"], r["param"]) <= 1e-5, (rank, style, r)
            assert r["tokens"] and not r["grad_missing"] and r["state"] == [], (rank, style, r)
            assert r["fraction"] <= 1 / world + 0.12, (style, r["fraction"])
