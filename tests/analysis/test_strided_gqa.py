"""Grouped-query attention whose kv heads are repeated head-minor (tests/support/strided_gqa_models.py): query
head h reads kv head h % n_kv, so the query projection is cut with that stride — each rank holds, in every one
of the n_rep groups of query heads, those of its own kv heads — and the output projection's rows alike. The
repeat, the tile, the cat and the expand keep their counts; each rank tiles its own kv heads. Structural tests (no
processes) at tp 2 and 4, the reason where kv heads are fewer than tp, and the training parity with Megatron's
collectives (gloo ranks, extended: tp 2 and 4)."""
from __future__ import annotations

import functools
import math

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from autotp.shard_spec import Segment, local_indices
from parity_workers import pattern_parity
from pattern_models import H, S
from ranks import Launches
from strided_gqa_models import HD, KINDS, NKV, NQ, build
from tiers import core_first

RUNS = Launches({}, extended={w: {"strided gqa": (pattern_parity, list(KINDS), 3, False, "strided_gqa_models")}
                              for w in (2, 4)})


@functools.cache
def _graph(kind: str):
    """One capture per spelling, planned by each test (planning leaves the graph as it is)."""
    return capture(*build(kind))[0]


# the default run plans the spellings of a repeat, an expand and a cat; the extended run also the interleaved
# rotary pairs tiled by torch.tile (one einsum capture more)
CASES = core_first(KINDS, ["minor_repeat", "minor_expand", "minor_cat"])


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("tp", [2, 4])
def test_query_heads_are_cut_with_the_kv_heads_stride(kind: str, tp: int):
    plan = make_plan(_graph(kind), tp)
    assert plan.replicated == () and plan.whole == (), (kind, plan.replicated)
    params = dict(plan.params)
    strided = (Segment(NQ * HD, 1, (Segment(NKV * HD, tp),)),)
    for i in range(2):
        q, k, o = (params[f"blocks.{i}.attn.{p}.weight"] for p in "qko")
        assert (q.role, q.local_shape, q.segments) == ("column", (NQ * HD // tp, H), strided), (kind, q)
        assert (o.role, o.local_shape, o.segments) == ("row", (H, NQ * HD // tp), strided), (kind, o)
        assert (k.local_shape, k.segments) == ((NKV * HD // tp, H), (Segment(NKV * HD, tp),)), (kind, k)
    for rank in range(tp):
        # each query head this rank holds reads a kv head this rank holds (h % n_kv), every head once overall
        q_heads = {int(i) // HD for i in local_indices(params["blocks.0.attn.q.weight"].segments, tp, rank)}
        kv_heads = {int(i) // HD for i in local_indices(params["blocks.0.attn.k.weight"].segments, tp, rank)}
        assert len(q_heads) == NQ // tp and {h % NKV for h in q_heads} == kv_heads, (kind, rank, q_heads)
    # the tiling counts stay n_rep on every rank: only head counts of views and expands change
    assert not [r for r in plan.rewrites if r.node.startswith(("repeat", "cat", "tile"))], (kind, plan.rewrites)
    model = build(kind)[0]
    held = sum(math.prod(params[n].local_shape) if n in params else p.numel() for n, p in model.named_parameters())
    assert held / sum(p.numel() for p in model.parameters()) <= 1 / tp + 0.12, (kind, tp)


@pytest.mark.parametrize("kind", CASES)
def test_kv_heads_fewer_than_tp_stay_whole_with_the_reason(kind: str):
    """At tp 8 each of the 4 kv heads is held by 2 adjacent ranks, whose query heads (h and h + 4) a stride
    cannot give both: attention stays whole, exact, saying why."""
    plan = make_plan(_graph(kind), 8)
    assert [m for m, _ in plan.replicated] == ["blocks.0.attn", "blocks.1.attn"], (kind, plan.replicated)
    assert all(f"{NKV} kv heads repeated head-minor (query head h reads kv head h % {NKV}) are fewer than tp=8"
               in why for _, why in plan.replicated), (kind, plan.replicated)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_strided_gqa_trains_exactly_with_megatron_collectives(world: int):
    results = RUNS(world, "strided gqa")
    bsh, bs, layers = 2 * S * H, 2 * S, 2
    for rank, by_kind in results.items():
        assert list(by_kind) == list(KINDS)
        for kind, r in by_kind.items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert not r["replicated"] and r["whole"] == {} and r["unexplained"] == [], (kind, r)
            assert r["fraction"] <= 1 / world + 0.12, (kind, r["fraction"])
            # forward: the embedding's and 2 per layer all-reduces of b·s·h, the loss's max and 2 sums of b·s
            assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * (2 * layers + 1) + [
                ("all_reduce", "max", bs), ("all_reduce", "sum", bs), ("all_reduce", "sum", bs)]), (kind, r["forward"])
            # backward: one entering attention and one entering the MLP per layer, one for the LM head; nothing else
            assert r["backward"] == [("all_reduce", "sum", bsh)] * (2 * layers + 1), (kind, r["backward"])


def test_checkpoint_keys_of_a_strided_query_are_the_parameters_own():
    """A grouped segment of one inner segment (the query cut with the stride of kv heads repeated head-minor)
    is no fusion: checkpoints name the parameter itself at every tp, so a tp 2 × FSDP checkpoint of
    Hugging Face's Llama (4 q / 2 kv heads) resumes at tp 1 × FSDP 4 and tp 4."""
    from autotp.capture.tracer import capture
    from autotp.plan.planner import fused_segments
    from fsdp_workers import _model

    model, args, kwargs = _model("llama")
    assert fused_segments(capture(model, args, kwargs)[0]) == {}
