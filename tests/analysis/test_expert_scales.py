"""A norm after each expert whose weight is one row per expert, picked per routed slot
(tests/support/expert_scale_models.py; Ergo's post-expert norm). The slot's output is normalized over the
hidden width, so the experts' partial sums are all-reduced per slot before the norm (T·k·h), and the norm's
``(E, h)`` weight scales replicated values: whole by design, as Megatron keeps a norm's weight whole; the
experts are cut per expert, gate | up by columns, down by rows."""
from __future__ import annotations

import pytest
import torch

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from expert_scale_models import E, HF_KINDS, I, K, KINDS, NormedExperts, build
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from pattern_models import H, S
from ranks import Launches
from tiers import core_first

# the scale's and the experts' names, and the dim of gate | up that holds the expert features, per spelling
NAMES = {kind: ("blocks.0.moe", "scale", "w_in", "w_out", 2) for kind in KINDS}
NAMES["ergo"] = ("model.layers.1.mlp.experts", "post_expert_norm.weight", "up_proj", "down_proj", 2)


def _check_plan(kind: str, gm, tp: int) -> None:
    plan = make_plan(gm, tp)
    assert plan.replicated == (), (kind, tp, plan.replicated)
    module, scale, w_in, w_out, in_dim = NAMES[kind]
    (whole,) = [w for w in plan.whole if w.name == f"{module}.{scale}"]
    assert whole.reason.startswith(f"scale kept whole: its {E} rows of 64 are picked per token by "), whole
    assert all(w.reason.startswith(("scale kept whole", "router kept whole")) for w in plan.whole), plan.whole
    up, down = plan.param(f"{module}.{w_in}"), plan.param(f"{module}.{w_out}")
    assert (up.role, up.dim, up.local_shape[0]) == ("column", in_dim, E), (tp, up)
    assert up.local_shape[in_dim] == sum(g.size for g in up.segments) // tp and up.segments[0].size == I, (tp, up)
    assert (down.role, down.dim, down.local_shape[1]) == ("row", 1, I // tp), (tp, down)
    # each slot's output whole before its norm: one all-reduce of the T·k slots forward; f at the T tokens
    forward = [c.shape for c in plan.collectives if c.module == module and c.direction == "forward"]
    backward = [c.shape for c in plan.collectives if c.module == module and c.direction == "backward"]
    assert len(forward) == 1 and forward[0][0].startswith(f"{K}*") and forward[0][-1] == "64", (tp, forward)
    assert len(backward) == 1 and f"{K}*" not in "".join(backward[0]) and backward[0][-1] == "64", (tp, backward)


@pytest.fixture(scope="module", params=core_first(KINDS, []))
def captured(request):
    model, args, kwargs = build(request.param)
    return request.param, capture(model, args, kwargs)[0]


def test_a_per_expert_norm_weight_is_whole_by_design(captured):
    kind, gm = captured
    for tp in (2, 4):
        _check_plan(kind, gm, tp)


def test_the_layer_alone_keeps_its_scale_whole():
    """The layer captured alone (the default tier's check; the LMs' plans in the extended run): the scale whole
    by design, the experts cut, the slots' outputs all-reduced before their norm."""
    gm = capture(NormedExperts("index_scale"), (torch.randn(2, S, H),), {})[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), plan.replicated
        assert [(w.name, w.reason.split(":")[0]) for w in plan.whole] == \
            [("scale", "scale kept whole"), ("router.weight", "router kept whole")], plan.whole
        assert plan.param("w_out").local_shape == (E, I // tp, H), plan.param("w_out")
        assert [c.shape[0] for c in plan.collectives if c.direction == "forward"] == [f"{K}*s85*s95"], \
            plan.collectives


@pytest.mark.extended
@pytest.mark.parametrize("kind", HF_KINDS)
def test_ergo_post_expert_norm_is_whole_by_design(kind: str):
    """Ergo (a capture of ~40 s on 2 loaded cores: extended run)."""
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        _check_plan(kind, gm, tp)


RUNS = Launches({}, extended={w: {"scales": (pattern_parity, [*KINDS, *HF_KINDS], 3, False, "expert_scale_models")}
                              for w in (2, 4)})


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_per_expert_norms_train_exactly(world: int):
    """3 AdamW steps against the unsharded model: losses, gradients and parameters within 1e-5, nothing
    replicated, each rank holding at most 1/tp + 0.12 of the parameters; the hand-written spellings' forward
    all-reduces are Megatron's with the MoE layer's per slot: the embedding's and the attention layers' (b·s·h),
    each MoE layer's T·k·h, the loss's max and two sums (b·s)."""
    bsh, bs = 2 * S * H, 2 * S
    for rank, by_kind in RUNS(world, "scales").items():
        assert list(by_kind) == [*KINDS, *HF_KINDS], (rank, list(by_kind))
        for kind, r in by_kind.items():
            assert_exact(r, (rank, kind))
            assert_fully_sharded(r, world, (rank, kind))
            if kind in KINDS:
                assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * 3 + [("all_reduce", "max", bs)]
                                                      + [("all_reduce", "sum", bs)] * 2
                                                      + [("all_reduce", "sum", K * bsh)] * 2), (rank, kind, r["forward"])
