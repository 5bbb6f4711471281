"""Mamba-2 mixers (tests/support/mamba2_models.py), cut as Megatron cuts them: by groups of B/C states, each
rank holding whole groups and their heads. in_proj column-parallel per segment (z | x | B | C | dt), the
depthwise convolution per channel (x | B | C), ``dt_bias``, ``A_log`` and ``D`` by heads, the gated norm's
weight by channels (each group's norm local), out_proj row-parallel: one all-reduce forward and one backward
(f) per mixer. Two hand-written spellings (the scan as a loop, and in closed form from a ``cumsum`` with the
causal convolution's input left-padded by ``F.pad``) and Hugging Face's Bamba. Every test captures for tens
of seconds on a loaded 2-core host: extended run."""
from __future__ import annotations

import math

import pytest

from autotp.capture.tracer import capture
from autotp.errors import ShardingError
from autotp.plan.planner import make_plan
from mamba2_models import D_INNER, D_STATE, GROUPS, HEADS, build
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from pattern_models import H
from ranks import Launches

SPELLINGS = ["ssd_loop", "ssd_closed"]
GN = GROUPS * D_STATE


@pytest.mark.extended
@pytest.mark.parametrize("kind", SPELLINGS)
def test_mamba2_is_planned_by_groups(kind: str):
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    m = "blocks.0.mixer"
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        shards = dict(plan.params)
        held = sum(math.prod(shards[n].local_shape) if n in shards else p.numel() for n, p in model.named_parameters())
        assert held / sum(p.numel() for p in model.parameters()) <= 1 / tp + 0.12, tp
        cut = {n[len(m) + 1:]: (s.role, s.dim, [g.size for g in s.segments], s.local_shape)
               for n, s in plan.params if n.startswith(m)}
        conv = D_INNER + 2 * GN
        assert cut == {
            "in_proj.weight": ("column", 0, [D_INNER, D_INNER, GN, GN, HEADS], ((D_INNER + conv + HEADS) // tp, H)),
            "conv1d.weight": ("column", 0, [D_INNER, GN, GN], (conv // tp, 1, 4)),
            "conv1d.bias": ("column", 0, [D_INNER, GN, GN], (conv // tp,)),
            "dt_bias": ("column", 0, [HEADS], (HEADS // tp,)), "A_log": ("column", 0, [HEADS], (HEADS // tp,)),
            "D": ("column", 0, [HEADS], (HEADS // tp,)), "norm_weight": ("column", 0, [D_INNER], (D_INNER // tp,)),
            "out_proj.weight": ("row", 1, [D_INNER], (H, D_INNER // tp)),
        }, (tp, cut)
        mixer = sorted((c.op, c.direction, c.shape[-1]) for c in plan.collectives if c.module == m)
        assert mixer == [("sum", "backward", str(H)), ("sum", "forward", str(H))], (tp, mixer)


@pytest.mark.extended
def test_mamba2_with_one_group_is_not_cut():
    """One group (Mamba-2 2.7B's layout): its gated norm spans every head, so no rank can hold a part of it
    exactly (Megatron asks tp to divide the groups): the mixer is refused, never cut."""
    model, args, kwargs = build("ssd_one_group")
    gm = capture(model, args, kwargs)[0]
    try:
        plan = make_plan(gm, 2)
    except ShardingError as e:
        assert "blocks.0.mixer" in str(e), e
        return
    assert {m for m, _ in plan.replicated} == {"blocks.0.mixer", "blocks.1.mixer"}, plan.replicated
    assert not [n for n, s in plan.params if ".mixer." in n], plan.params


@pytest.mark.extended
def test_bamba_is_planned_by_groups():
    """Hugging Face's Bamba (8 SSM heads in 4 groups): every weight cut, the router-free plan fully sharded;
    its mixer's in_proj per segment z | x | B | C | dt."""
    model, args, kwargs = build("bamba")
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        shard = dict(plan.params)["model.layers.0.mamba.in_proj.weight"]
        assert [g.size for g in shard.segments] == [128, 128, 64, 64, 8], shard.segments
        assert shard.local_shape == (392 // tp, 64), shard


RUNS = {2: SPELLINGS + ["bamba"], 4: SPELLINGS + ["bamba"]}
PARITY = Launches({}, extended={w: {"mamba2": (pattern_parity, RUNS[w], 3, False, "mamba2_models")} for w in (2, 4)})


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_mamba2_trains_exactly_with_megatron_collectives(world: int):
    """3 AdamW steps: loss, gradients and parameters within 1e-5, every block cut, at most 1/tp + 0.12 of the
    parameters per rank; the hand-written spellings' step is Megatron's all-reduces: forward per mixer the
    output projection's (b·s·h), the embedding's, the loss's max and two sums (b·s); backward per mixer one f,
    and the head's."""
    bsh, bs = 2 * 8 * H, 2 * 8
    for rank, by_kind in PARITY(world, "mamba2").items():
        assert list(by_kind) == RUNS[world], (rank, list(by_kind))
        for kind, r in by_kind.items():
            assert_exact(r, (rank, kind))
            assert_fully_sharded(r, world, (rank, kind))
            if kind == "bamba":
                continue
            assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * 3 + [("all_reduce", "max", bs)]
                                                  + [("all_reduce", "sum", bs)] * 2), (rank, kind, r["forward"])
            assert sorted(r["backward"]) == [("all_reduce", "sum", bsh)] * 3, (rank, kind, r["backward"])
