"""Hybrid families' mixers (tests/support/hybrid_models.py), cut as Megatron cuts them.

A Mamba-1 mixer whose Δ, B and C are RMS-normalized after the reducing projection (Jamba's): ``x_proj``
row-parallel by channels with one all-reduce of its ``b·s·(r + 2n)`` output forward and backward, the norms run
whole on every rank, their weights' gradients summed (each rank's channels give a part: one all-reduce of
``r``, ``n`` and ``n`` elements), ``dt_proj`` column-parallel by channels. Two hand-written spellings and Hugging
Face's Jamba.

Linear-attention mixers whose heads are regrouped under the batch (a gated delta rule from one fused projection
of unequal segments, and gated linear attention in closed form), cut by heads as Megatron cuts Qwen3.5's
gated-delta-net. Every test captures for tens of seconds on a loaded 2-core host: extended run."""
from __future__ import annotations

import math

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from hybrid_models import D_INNER, D_STATE, DT_RANK, DK, DV, LINEAR, NL, NORMED, S, build
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from pattern_models import H
from ranks import Launches


@pytest.mark.extended
@pytest.mark.parametrize("kind", NORMED)
def test_normed_mamba_is_planned_by_channels(kind: str):
    """At tp 2 and 4 every weight of the mixer cut by its channels (the norms' weights whole), and its
    collectives Megatron's: forward the reduction's and the output projection's all-reduces; backward the
    reduction's, one f entering the input projection, and the norms' weights' gradients."""
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    m = "blocks.0.mixer"
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        c = D_INNER // tp
        cut = {n[len(m) + 1:]: (s.role, s.dim, s.local_shape) for n, s in plan.params if n.startswith(m)}
        assert cut == {
            "in_proj.weight": ("column", 0, (2 * c, H)), "x_proj.weight": ("row", 1, (DT_RANK + 2 * D_STATE, c)),
            "dt_proj.weight": ("column", 0, (c, DT_RANK)), "dt_proj.bias": ("column", 0, (c,)),
            "conv1d.weight": ("column", 0, (c, 1, 4)), "conv1d.bias": ("column", 0, (c,)),
            "A_log": ("column", 0, (c, D_STATE)), "D": ("column", 0, (c,)), "out_proj.weight": ("row", 1, (H, c)),
        }, (tp, cut)
        mixer = sorted((c.direction, c.shape[-1]) for c in plan.collectives if c.module == m)
        assert mixer == sorted([("forward", str(H)), ("forward", str(DT_RANK + 2 * D_STATE)), ("backward", str(H)),
                                ("backward", str(DT_RANK + 2 * D_STATE)), ("backward", str(DT_RANK)),
                                ("backward", str(D_STATE)), ("backward", str(D_STATE))]), (tp, mixer)


@pytest.mark.extended
@pytest.mark.parametrize("kind", LINEAR)
def test_linear_attention_is_planned_by_heads(kind: str):
    """Heads regrouped under the batch (``(b·h, s, d)``) at tp 2 and 4: the input projections column-parallel by
    heads (the fused one per segment, its segments of unequal sizes q | k | v | z | β | a), the convolution over
    q | k | v and the per-head decay parameters by heads, the output projection row-parallel; the gated norm's
    ``(d_v,)`` weight, read by every head, whole. Per mixer one all-reduce forward (the output's), one f
    backward and the norm weight's gradient (d_v). At most 1/tp + 0.12 of the parameters per rank."""
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    m = "blocks.0.mixer"
    params = dict(model.named_parameters())
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        cut = {n[len(m) + 1:]: (s.role, s.dim, [g.size for g in s.segments], s.local_shape)
               for n, s in plan.params if n.startswith(m)}
        qk, v, h = NL * DK, NL * DV, NL
        if kind == "delta_loop":
            sizes = [qk, qk, v, v, h, h]
            want = {"in_proj.weight": ("column", 0, sizes, (sum(sizes) // tp, H)),
                    "conv1d.weight": ("column", 0, [qk, qk, v], ((2 * qk + v) // tp, 1, 4)),
                    "dt_bias": ("column", 0, [h], (h // tp,)), "A_log": ("column", 0, [h], (h // tp,)),
                    "out_proj.weight": ("row", 1, [v], (H, v // tp))}
        else:
            want = {**{f"{p}_proj.weight": ("column", 0, [qk], (qk // tp, H)) for p in "qk"},
                    **{f"{p}_proj.weight": ("column", 0, [v], (v // tp, H)) for p in "vg"},
                    "gk_proj.weight": ("column", 0, [h], (h // tp, H)), "gk_proj.bias": ("column", 0, [h], (h // tp,)),
                    "o_proj.weight": ("row", 1, [v], (H, v // tp))}
        assert cut == want, (tp, cut)
        mixer = sorted((c.direction, c.shape[-1]) for c in plan.collectives if c.module == m)
        assert mixer == [("backward", str(DV)), ("backward", str(H)), ("forward", str(H))], (tp, mixer)
        shards = dict(plan.params)
        held = sum(math.prod(shards[n].local_shape) if n in shards else p.numel() for n, p in params.items())
        assert held / sum(p.numel() for p in params.values()) <= 1 / tp + 0.12, tp


RUNS = [*NORMED, *LINEAR, "jamba"]
PARITY = Launches({}, extended={w: {"hybrid": (pattern_parity, RUNS, 3, False, "hybrid_models")} for w in (2, 4)})


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_hybrid_mixers_train_exactly_with_megatron_collectives(world: int):
    """3 AdamW steps: loss, gradients and parameters within 1e-5, every block cut, at most 1/tp + 0.12 of the
    parameters per rank; the hand-written spellings' step is Megatron's all-reduces: forward per mixer the
    reduction's (b·s·(r + 2n)) and the output projection's (b·s·h), the embedding's, the loss's max and two
    sums (b·s); backward per mixer the reduction's, one f (b·s·h) and the norms' weights' (r, n, n), and the
    head's. The linear-attention mixers' likewise without a reduction: forward per mixer the output's, backward
    per mixer one f and the gated norm weight's (d_v)."""
    bsh, bsr, bs = 2 * S * H, 2 * S * (DT_RANK + 2 * D_STATE), 2 * S
    for rank, by_kind in PARITY(world, "hybrid").items():
        assert list(by_kind) == RUNS, (rank, list(by_kind))
        for kind, r in by_kind.items():
            assert_exact(r, (rank, kind))
            assert_fully_sharded(r, world, (rank, kind))
            if kind in LINEAR:
                assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * 3 + [("all_reduce", "max", bs)]
                                                      + [("all_reduce", "sum", bs)] * 2), (rank, kind, r["forward"])
                backward = [("all_reduce", "sum", bsh)] * 3 + [("all_reduce", "sum", DV)] * 2
                assert sorted(r["backward"]) == sorted(backward), (rank, kind, r["backward"])
            if kind not in NORMED:
                continue
            s = [("all_reduce", "sum", n) for n in (bsh, bsr, bsh, bsr, bsh, bs, bs)]
            assert sorted(r["forward"]) == sorted(s + [("all_reduce", "max", bs)]), (rank, kind, r["forward"])
            weights = [("all_reduce", "sum", n) for n in (DT_RANK, D_STATE, D_STATE)] * 2
            s = [("all_reduce", "sum", n) for n in (bsh, bsr, bsh, bsr, bsh)]
            assert sorted(r["backward"]) == sorted(s + weights), (rank, kind, r["backward"])
