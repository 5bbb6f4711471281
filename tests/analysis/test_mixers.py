"""Channel-parallel mixers (tests/support/mixer_models.py): blocks that are not attention or a two-linear MLP, cut by
their inner width as Megatron cuts them. A Mamba-style mixer in four spellings (two as the reference
mamba_simple.py writes it, channels on dim 1 and the input and Δ projections' weights on the left, ``W @ x``,
its scan a loop or a ``cumprod``): the input and Δ projections
column-parallel (x | z per segment), the depthwise convolution, ``A_log`` and ``D`` per channel, the scan local,
the Δ/B/C projection row-parallel with one all-reduce of its b·s·(r + 2n) outputs forward and backward, the
output projection row-parallel. RecurrentGemma's recurrent block in two spellings: both input projections
column-parallel, the shifted-window convolution (windows left-padded with zeros made in the forward), the
block-diagonal gates by heads and ``a_param`` by channels, the recurrence local, the output row-parallel."""
from __future__ import annotations

import math

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from mixer_models import D_INNER, D_STATE, DT_RANK, KINDS, LRU_HEADS, MAMBA, RECURRENT, S, build
from parity_workers import pattern_parity
from pattern_models import H
from ranks import Launches


def _job(kinds) -> tuple:
    return pattern_parity, list(kinds), 3, False, "mixer_models"


# the default run trains the spellings whose scan is in closed form (fast to capture); the extended run those
# whose scan is a Python loop over time (each step captured) at tp 2, and every spelling at tp 4
CLOSED, LOOPS = ["mamba_cumsum", "hawk"], ["mamba_einsum", "griffin"]
LEFT = ["mamba_simple", "mamba_cumprod"]  # weights on the left of their matmuls (W @ x): extended only
PARTS = {"mixers": CLOSED, "mixers with loops": LOOPS, "mixers at tp 4": [k for k in KINDS if k not in LEFT],
         "left weights": LEFT, "left weights at tp 4": LEFT}
RUNS = Launches({2: {"mixers": _job(CLOSED)}},
                extended={2: {"mixers with loops": _job(LOOPS), "left weights": _job(LEFT)},
                          4: {"mixers at tp 4": _job(PARTS["mixers at tp 4"]), "left weights at tp 4": _job(LEFT)}})


def _held(model, plan) -> float:
    """The share of ``model``'s parameters one rank holds under ``plan``."""
    shards = dict(plan.params)
    held = sum(math.prod(shards[n].local_shape) if n in shards else p.numel() for n, p in model.named_parameters())
    return held / sum(p.numel() for p in model.parameters())


def _megatron(kind: str, layers: int = 2) -> tuple[list, list]:
    """One step's collectives (b = 2): forward the embedding's, per layer the output projection's (b·s·h) and a
    Mamba mixer's reducing projection's (b·s·(r + 2n)), the loss's max and 2 sums (b·s); backward per layer one
    entering the input projections and a Mamba mixer's of the reducing projection's outputs (read by every
    rank's channels), and the head's."""
    bsh, bsr, bs = 2 * S * H, 2 * S * (DT_RANK + 2 * D_STATE), 2 * S
    reduce = [("all_reduce", "sum", bsr)] * layers if kind in MAMBA else []
    forward = [("all_reduce", "sum", bsh)] * (layers + 1) + reduce + [("all_reduce", "max", bs)] + \
        [("all_reduce", "sum", bs)] * 2
    backward = [("all_reduce", "sum", bsh)] * (layers + 1) + reduce
    return sorted(forward), sorted(backward)


@pytest.mark.slow
@pytest.mark.parametrize("world,part", [pytest.param(2, "mixers", id="2"),
                                        pytest.param(2, "mixers with loops", id="2-loops", marks=pytest.mark.extended),
                                        pytest.param(4, "mixers at tp 4", id="4", marks=pytest.mark.extended),
                                        pytest.param(2, "left weights", id="2-left", marks=pytest.mark.extended),
                                        pytest.param(4, "left weights at tp 4", id="4-left",
                                                     marks=pytest.mark.extended)])
def test_mixers_shard_by_channels_exactly_with_megatron_collectives(world: int, part: str):
    results = RUNS(world, part)
    for rank, by_kind in results.items():
        assert list(by_kind) == PARTS[part]
        for kind, r in by_kind.items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert not r["replicated"] and not r["quarter"] and not r["whole"] and not r["unexplained"], (kind, r)
            assert r["fraction"] <= 1 / world + 0.12, (kind, r["fraction"])
            forward, backward = _megatron(kind)
            assert sorted(r["forward"]) == forward, (kind, r["forward"])
            assert sorted(r["backward"]) == backward, (kind, r["backward"])


@pytest.mark.parametrize("kind", MAMBA)
def test_mamba_is_planned_by_channels(kind: str):
    """Every weight cut by the channels at tp 2 and 4: in_proj per segment (x | z), x_proj by its input rows (the
    reduction, completed by a sum statistic), dt_proj, the convolution, A_log and D by channels; the input of
    dt_proj enters through no f of its own (the reduction's backward all-reduce sums its gradient)."""
    model, args, kwargs = build(kind)
    gm, _ = capture(model, args, kwargs)
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        assert _held(model, plan) <= 1 / tp + 0.12, (tp, _held(model, plan))
        params = dict(plan.params)
        m = "blocks.0.mixer."
        cut = {n[len(m):]: (s.role, s.dim, s.local_shape) for n, s in params.items() if n.startswith(m)}
        c = D_INNER // tp
        assert cut == {
            "in_proj.weight": ("column", 0, (2 * c, H)), "x_proj.weight": ("row", 1, (DT_RANK + 2 * D_STATE, c)),
            "dt_proj.weight": ("column", 0, (c, DT_RANK)), "dt_proj.bias": ("column", 0, (c,)),
            "conv1d.weight": ("column", 0, (c, 1, 4)), "conv1d.bias": ("column", 0, (c,)),
            "A_log": ("column", 0, (c, D_STATE)), "D": ("column", 0, (c,)), "out_proj.weight": ("row", 1, (H, c)),
        }, (tp, cut)
        assert [s.size for s in params[m + "in_proj.weight"].segments] == [D_INNER, D_INNER]  # x | z apart
        pair = plan.pairs[0]
        assert len(pair.columns) == 2 and len(pair.enter) == 1 and pair.also_enter == (), pair
        assert [(s.kind, s.scale) for s in plan.stats] == [("sum", 1.0)] * 2  # x_proj's sum, one per layer


@pytest.mark.parametrize("kind", RECURRENT)
def test_recurrent_block_is_planned_by_channels(kind: str):
    """At tp 2 and 4: the zeros padding each shifted window are made this rank's width, the convolution's
    ``w (4, channels)`` is cut on the channels each ``w[k]`` keeps, the gates' ``(heads, 32, 32)`` blocks by heads;
    one pair (no reduction) per block: Megatron's two all-reduces."""
    model, args, kwargs = build(kind)
    gm, _ = capture(model, args, kwargs)
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        assert _held(model, plan) <= 1 / tp + 0.12, (tp, _held(model, plan))
        m, c, heads = "blocks.0.mixer.", D_INNER // tp, LRU_HEADS // tp
        cut = {n[len(m):]: (s.role, s.dim, s.local_shape) for n, s in plan.params if n.startswith(m)}
        assert cut == {
            "linear_y.weight": ("column", 0, (c, H)), "linear_y.bias": ("column", 0, (c,)),
            "linear_x.weight": ("column", 0, (c, H)), "linear_x.bias": ("column", 0, (c,)),
            "conv_1d.w": ("column", 1, (4, c)), "conv_1d.b": ("column", 0, (c,)),
            "rg_lru.input_gate.w": ("column", 0, (heads, 32, 32)), "rg_lru.input_gate.b": ("column", 0, (heads, 32)),
            "rg_lru.a_gate.w": ("column", 0, (heads, 32, 32)), "rg_lru.a_gate.b": ("column", 0, (heads, 32)),
            "rg_lru.a_param": ("column", 0, (c,)), "linear_out.weight": ("row", 1, (H, c)),
        }, (tp, cut)
        assert len(plan.pairs) == 2 and plan.stats == ()
        zeros = [r for r in plan.rewrites if r.node.startswith(("zeros", "new_zeros")) and r.old == D_INNER]
        assert zeros and all(r.new == c for r in zeros), plan.rewrites
