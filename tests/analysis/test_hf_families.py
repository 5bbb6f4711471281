"""Hugging Face families that a rule added for them shards fully (tests/support/hf_family_models.py): planned with no
block left whole, and exact at tp 2 and 4: loss and gradients within 1e-5 of the unsharded model's (fp32).

After 3 AdamW steps the parameters agree within 1e-4, not 1e-5: AdamW divides each element's update by that
element's own gradient magnitude, and xLSTM has gradient elements as small as 2e-7, so the fp32 rounding of
a sharded sum (at most 1.5e-7 absolute, on gradients up to 0.45: 3e-7 relative) becomes an update difference
of up to 1.8e-5 over 3 steps (measured at tp 2)."""
from __future__ import annotations

import pytest
import torch

from autotp.capture.tracer import capture
from autotp.errors import ShardingError
from autotp.plan.planner import make_plan
from spelling_runs import SpellingRuns
from hf_family_models import KINDS, MIXER_KINDS, build
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from ranks import Launches
from tiers import core_first


@pytest.mark.parametrize("kind", core_first(KINDS, ["lfm3"]))
def test_the_family_is_planned_fully_sharded(kind: str):
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), plan.replicated


RUNS = SpellingRuns("hf", "hf_family_models", KINDS, ["lfm3"])


@pytest.mark.slow
@pytest.mark.parametrize("world,part", RUNS.params)
def test_the_family_trains_exactly(world: int, part: str):
    for rank, by_kind in RUNS(world, part).items():
        assert list(by_kind) == RUNS.kinds(part)
        for kind, r in by_kind.items():
            assert_exact(r, (rank, kind), param_tol=1e-4)
            assert_fully_sharded(r, world, (rank, kind), slack=0.2)


@pytest.fixture(scope="module")
def nemotron_h():
    model, args, kwargs = build("nemotron_h")
    return capture(model, args, kwargs)[0]


def test_nemotron_h_mamba2_is_planned_by_channels(nemotron_h):
    """Megatron's Mamba-2 cut at tp 2 and 4: in_proj column-parallel per segment (z | x | B | C | dt, the
    groups of B and C whole per rank), the conv1d filters (also read by a squeeze nothing uses), ``A_log``
    (its ``-exp`` also computed in a branch nothing reads), ``D``, ``dt_bias`` and the gated norm's weight by
    channels, out_proj row-parallel: one all-reduce forward (the output projection's) and one backward (f)."""
    m = "model.layers.0.mixer"
    for tp in (2, 4):
        plan = make_plan(nemotron_h, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        cut = {n[len(m) + 1:]: (s.role, s.dim, s.local_shape) for n, s in plan.params if n.startswith(m)}
        assert cut == {
            "in_proj.weight": ("column", 0, (392 // tp, 64)), "conv1d.weight": ("column", 0, (256 // tp, 1, 4)),
            "conv1d.bias": ("column", 0, (256 // tp,)), "A_log": ("column", 0, (8 // tp,)),
            "D": ("column", 0, (8 // tp,)), "dt_bias": ("column", 0, (8 // tp,)),
            "norm.weight": ("column", 0, (128 // tp,)), "out_proj.weight": ("row", 1, (64, 128 // tp)),
        }, (tp, cut)
        assert [g.size for g in dict(plan.params)[m + ".in_proj.weight"].segments] == [128, 128, 64, 64, 8]
        mixer = [(c.op, c.direction) for c in plan.collectives if c.module == m]
        assert sorted(mixer) == [("sum", "backward"), ("sum", "forward")], (tp, mixer)
        # B and C (b, s, 4 groups, 16) repeated to the 8 heads: each rank repeats its own groups for its own heads
        assert {(r.arg, r.old, r.new) for r in plan.rewrites if r.node.startswith("repeat_interleave")} == \
            {("output_size", 8, 8 // tp)}, (tp, plan.rewrites)
    assert nemotron_h.graph.find_nodes(op="call_function", target=torch.ops.aten.squeeze.dim)  # the unused read is there


@pytest.mark.extended
def test_nemotron_h_groups_fewer_than_ranks_name_the_mixer():
    """2 groups of B/C states cannot be cut by 4 ranks (a rank would hold part of a group's states)."""
    model, args, kwargs = build("nemotron_h_2_groups")
    gm = capture(model, args, kwargs)[0]
    assert make_plan(gm, 2).replicated == ()
    with pytest.raises(ShardingError, match=r"model\.layers\.0\.mixer: 2 heads are not divisible into 4 parts"):
        make_plan(gm, 4)


@pytest.mark.extended
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_gated_delta_net_is_planned_by_heads(kind: str):
    """Qwen3.5's gated-delta-net at tp 2 and 4 (a capture of tens of seconds: extended run): in_proj_qkv
    column-parallel per segment (q | k | v), z, b, a and the convolution (q | k | v channels), ``dt_bias`` and
    ``A_log`` by heads; the gated norm's output ``(b·s·h, d)`` unfolds to ``(b, s, h·d)`` with this rank's heads;
    out_proj row-parallel. One all-reduce forward (out_proj's) and backward f and the per-head norm's weight
    gradient (``(d,)``, read by every head)."""
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    m = "model.layers.0.linear_attn"
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), (tp, plan.replicated)
        cut = {n[len(m) + 1:]: (s.role, s.dim, [g.size for g in s.segments], s.local_shape)
               for n, s in plan.params if n.startswith(m)}
        assert cut == {
            "in_proj_qkv.weight": ("column", 0, [64, 64, 128], (256 // tp, 64)),
            "in_proj_z.weight": ("column", 0, [128], (128 // tp, 64)),
            "in_proj_b.weight": ("column", 0, [8], (8 // tp, 64)), "in_proj_a.weight": ("column", 0, [8], (8 // tp, 64)),
            "conv1d.weight": ("column", 0, [64, 64, 128], (256 // tp, 1, 4)),
            "dt_bias": ("column", 0, [8], (8 // tp,)), "A_log": ("column", 0, [8], (8 // tp,)),
            "out_proj.weight": ("row", 1, [128], (64, 128 // tp)),
        }, (tp, cut)
        mixer = sorted((c.op, c.direction, c.shape) for c in plan.collectives if c.module == m)
        assert mixer == [("sum", "backward", ("16",)), ("sum", "backward", ("s95", "s85", "64")),
                         ("sum", "forward", ("s95", "s85", "64"))], (tp, mixer)


@pytest.mark.extended
def test_gated_delta_net_with_key_heads_fewer_than_ranks_replicates_them_per_rank_group():
    """2 key heads repeated to 4 value heads at tp 4, as grouped-query attention's kv heads fewer than tp: each
    key head's q and k channels (in_proj_qkv's and the convolution's) are held by the 2 ranks whose value heads
    read it, v, z, b, a, ``dt_bias`` and ``A_log`` cut by the 4 value heads; each rank repeats its one key head
    for its one value head (repeat_interleave 2 -> 1), and the sequence split of q and k is torch's rule for 2
    blocks. The mixer's collectives are those of 4 key heads: out_proj's all-reduce, f backward and the per-head
    norm's weight gradient."""
    model, args, kwargs = build("qwen3_5_2_key_heads")
    gm = capture(model, args, kwargs)[0]
    m = "model.layers.0.linear_attn"
    assert make_plan(gm, 2).replicated == ()
    plan = make_plan(gm, 4)
    assert plan.replicated == (), plan.replicated
    cut = {n[len(m) + 1:]: ([(g.size, g.parts) for g in s.segments], s.local_shape)
           for n, s in plan.params if n.startswith(m)}
    assert cut == {
        "in_proj_qkv.weight": ([(32, 2), (32, 2), (64, 4)], (48, 64)), "in_proj_z.weight": ([(64, 4)], (16, 64)),
        "in_proj_b.weight": ([(4, 4)], (1, 64)), "in_proj_a.weight": ([(4, 4)], (1, 64)),
        "conv1d.weight": ([(32, 2), (32, 2), (64, 4)], (48, 1, 4)), "dt_bias": ([(4, 4)], (1,)),
        "A_log": ([(4, 4)], (1,)), "out_proj.weight": ([(64, 4)], (64, 16)),
    }, cut
    assert {(r.old, r.new) for r in plan.rewrites if r.node.startswith("repeat_interleave") and r.arg == 1} \
        == {(2, 1)}, plan.rewrites
    mixer = sorted((c.op, c.direction, c.shape[-1]) for c in plan.collectives if c.module == m)
    assert mixer == [("sum", "backward", "16"), ("sum", "backward", "64"), ("sum", "forward", "64")], mixer


@pytest.mark.extended
def test_hf_mamba_is_planned_by_channels():
    """Hugging Face's own Mamba (its reference path: the selective scan looped over time) at tp 2 and 4, cut as
    Megatron cuts it: in_proj column-parallel per segment (x | z), the depthwise conv1d, ``A_log`` (read as
    ``A[None, :, None, :]`` of ``-exp(A_log.float())``), ``D`` and dt_proj (``dt_proj.weight @ Δ``) by channels,
    x_proj row-parallel (one all-reduce of Δ | B | C each way), out_proj row-parallel (one all-reduce forward, f
    backward). A capture of ~10 s: extended run."""
    model, args, kwargs = build("mamba")
    gm = capture(model, args, kwargs)[0]
    m = "backbone.layers.0.mixer"
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        cut = {n[len(m) + 1:]: (s.role, s.dim, [g.size for g in s.segments], s.local_shape)
               for n, s in plan.params if n.startswith(m)}
        assert cut == {
            "in_proj.weight": ("column", 0, [128, 128], (256 // tp, 64)),
            "conv1d.weight": ("column", 0, [128], (128 // tp, 1, 4)), "conv1d.bias": ("column", 0, [128], (128 // tp,)),
            "A_log": ("column", 0, [128], (128 // tp, 16)), "D": ("column", 0, [128], (128 // tp,)),
            "dt_proj.weight": ("column", 0, [128], (128 // tp, 4)), "dt_proj.bias": ("column", 0, [128], (128 // tp,)),
            "x_proj.weight": ("row", 1, [128], (36, 128 // tp)), "out_proj.weight": ("row", 1, [128], (64, 128 // tp)),
        }, (tp, cut)
        mixer = sorted((c.op, c.direction, c.shape[-1]) for c in plan.collectives if c.module == m)
        assert mixer == [("sum", "backward", "36"), ("sum", "backward", "64"), ("sum", "forward", "36"),
                         ("sum", "forward", "64")], (tp, mixer)


# at 4 ranks also Qwen3.5 with 2 key heads (each held by the 2 ranks whose value heads read it)
MIXER_RUNS = {2: ["nemotron_h", "qwen3_5", "qwen3_5_moe"], 4: ["nemotron_h", "qwen3_5", "qwen3_5_moe",
                                                               "qwen3_5_2_key_heads"]}
MIXERS = Launches({}, extended={w: {"mixers": (pattern_parity, MIXER_RUNS[w], 3, False, "hf_family_models"),
                                    "mamba": (pattern_parity, ["mamba"], 3, False, "hf_family_models")}
                                for w in (2, 4)})


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_hybrid_mixers_train_exactly_with_megatron_collectives(world: int):
    """Nemotron-H and Qwen3.5 (dense and MoE; at 4 ranks also with 2 key heads): loss, gradients and parameters
    after 3 AdamW steps within 1e-5, every block cut; Nemotron-H's step is Megatron's all-reduces: forward per layer the row-parallel output's
    (b·s·h), the embedding's and the loss's max and two sums (b·s); backward per layer one f and the head's."""
    bsh, bs = 2 * 8 * 64, 2 * 8
    for rank, by_kind in MIXERS(world, "mixers").items():
        assert list(by_kind) == MIXER_RUNS[world], (rank, list(by_kind))
        for kind, r in by_kind.items():
            assert_exact(r, (rank, kind))
            assert_fully_sharded(r, world, (rank, kind))
            if kind != "nemotron_h":
                continue
            assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * 3 + [("all_reduce", "max", bs)]
                                                  + [("all_reduce", "sum", bs)] * 2), r["forward"]
            assert sorted(r["backward"]) == [("all_reduce", "sum", bsh)] * 3, r["backward"]


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_hf_mamba_trains_exactly_with_megatron_collectives(world: int):
    """Hugging Face's Mamba (2 layers, d_inner 128, 16 states, Δ rank 4, tied head): loss, gradients and
    parameters after 3 AdamW steps within 1e-5, every block cut; a step's all-reduces are Megatron's: forward
    per layer x_proj's Δ | B | C (b·s·36) and out_proj's (b·s·h), the embedding's, the loss's max and two sums
    (b·s); backward per layer x_proj's (every rank's channels read Δ, B, C) and one f, and the head's f."""
    bsh, bs, dbc = 2 * 8 * 64, 2 * 8, 2 * 8 * 36
    for rank, by_kind in MIXERS(world, "mamba").items():
        r = by_kind["mamba"]
        assert_exact(r, (rank, "mamba"))
        assert_fully_sharded(r, world, (rank, "mamba"))
        assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * 3 + [("all_reduce", "sum", dbc)] * 2
                                              + [("all_reduce", "max", bs)] + [("all_reduce", "sum", bs)] * 2), \
            (rank, r["forward"])
        assert sorted(r["backward"]) == sorted([("all_reduce", "sum", bsh)] * 3 + [("all_reduce", "sum", dbc)] * 2), \
            (rank, r["backward"])
