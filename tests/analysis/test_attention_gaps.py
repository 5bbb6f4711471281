"""Attention spellings that used to stay whole (tests/support/attention_gap_models.py): scores masked by
``torch.where`` with a Python scalar, grouped-query attention over heads folded under the batch whose kv heads
are folded to a size computed at run time, and a parallel block's one fused ``q | k | v | ff`` projection with
a single shared k and v head (segments of unequal sizes, the one-head segments whole on every rank). Each is cut by heads at tp 2 and 4 (structural tests, no
processes) and trains exactly with Megatron's collectives (gloo ranks: tp 2 by default, tp 4 extended)."""
from __future__ import annotations

import math

import pytest
import torch

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from attention_gap_models import FF, FOLDS, KINDS, NKV, PARALLEL, FoldedGQA
from parity_workers import pattern_parity
from pattern_models import HD, H, S, LMWith, build_with
from ranks import Launches
from shared_graphs import SHARED, spelling

RUNS = Launches({2: {"attention gaps": (pattern_parity, list(KINDS), 3, False, "attention_gap_models")}},
                extended={4: {"attention gaps": (pattern_parity, list(KINDS), 3, False, "attention_gap_models"),
                              "parallel blocks": (pattern_parity, list(PARALLEL), 3, False, "attention_gap_models")},
                          2: {"parallel blocks": (pattern_parity, list(PARALLEL), 3, False, "attention_gap_models"),
                              "parallel blocks sp": (pattern_parity, list(PARALLEL), 3, True, "attention_gap_models")}})


def _plan(kind: str, tp: int):
    """The spelling's plan at ``tp``, of its one capture (tests/support/shared_graphs.py)."""
    return make_plan(spelling("attention_gap_models", kind)[3], tp)


def _held(kind: str, plan) -> float:
    """The share of the spelling's parameters one rank holds under ``plan``."""
    shards, model = dict(plan.params), spelling("attention_gap_models", kind)[0]
    held = sum(math.prod(shards[n].local_shape) if n in shards else p.numel() for n, p in model.named_parameters())
    return held / sum(p.numel() for p in model.parameters())


@SHARED
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_each_spelling_is_cut_by_heads(kind: str, tp: int):
    plan = _plan(kind, tp)
    assert plan.replicated == () and plan.whole == (), (plan.replicated, plan.whole)
    assert _held(kind, plan) <= 1 / tp + 0.12, _held(kind, plan)
    params = dict(plan.params)
    for i in range(2):
        q, o = params[f"blocks.{i}.attn.q.weight"], params[f"blocks.{i}.attn.o.weight"]
        assert (q.role, q.local_shape) == ("column", (H // tp, H)) and (o.role, o.local_shape) == ("row", (H, H // tp))
    if kind in FOLDS:
        # k and v folded to floordiv(4·b, 2) rows per layer: each view infers this rank's size from its elements
        inferred = [r for r in plan.rewrites if r.inferred is not None]
        assert len(inferred) == 4 and {(r.old, r.new) for r in inferred} == {(4, -1)}, inferred
        # the repeat to the query heads: 2 per kv head at tp 2, 1 at tp 4 (each kv head on 2 ranks)
        reps = {r.new for r in plan.rewrites if r.node.startswith("repeat_interleave")}
        assert reps == (set() if tp == 2 else {1}), plan.rewrites


@SHARED
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", PARALLEL)
def test_a_parallel_blocks_fused_projection_is_read_in_its_unequal_segments(kind: str, tp: int):
    """``q | k | v | ff`` with one shared k and v head: q and ff (PaLM's ff itself SwiGLU's gate | up) cut by
    tp, the one-head k and v whole on every rank (``rotate_half``'s halves of k read as one whole head). The
    feed-forward's output projection is a second row of the one fused column: row-parallel beside attention's,
    and the two partial sums, added, are completed by one all-reduce for the block (GPT-NeoX's parallel
    residual; Megatron's parallel block reduces each row apart, two)."""
    from autotp.analysis.column_layout import column_segments
    from autotp.analysis.shapes import Fingerprinter

    gm = spelling("attention_gap_models", kind)[3]
    fused = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default
             and n.args[1].target == "blocks.0.attn.fused.weight"]
    segments = column_segments(fused[0], Fingerprinter(gm), tp, "fused")
    ff = [(FF, tp)] * (2 if kind == "palm_swiglu" else 1)
    assert [(g.size, g.parts) for g in segments] == [(H, tp), (HD, 1), (HD, 1), *ff], segments
    plan = make_plan(gm, tp)
    assert plan.replicated == () and plan.whole == (), (plan.replicated, plan.whole)
    assert _held(kind, plan) <= 1 / tp + 0.12, _held(kind, plan)
    params = dict(plan.params)
    for i in range(2):
        attn_out, ff_out = params[f"blocks.{i}.attn.attn_out.weight"], params[f"blocks.{i}.attn.ff_out.weight"]
        assert (attn_out.role, attn_out.local_shape) == ("row", (H, H // tp)), attn_out
        assert (ff_out.role, ff_out.local_shape) == ("row", (H, FF // tp)), ff_out
    # per block: one forward all-reduce of the two rows' summed partial outputs, one backward entering the
    # fused column; the MLP's pair its own two
    attn = [(c.direction, c.node) for c in plan.collectives if c.module == "blocks.0.attn"]
    add = [p.leave_at for p in plan.pairs if p.module == "blocks.0.attn"]
    assert len(add) == 2 and add[0] == add[1] is not None, plan.pairs
    assert sorted(d for d, _ in attn) == ["backward", "forward"] and ("forward", add[0]) in attn, attn


class _TwoRunTimeSizes(FoldedGQA):
    """The kv heads folded by ``reshape(qf.shape[0] // n_rep, s, -1)``: the head dim already inferred."""

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, HD).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, HD).transpose(1, 2)
        qf = q.reshape(b * self.heads, s, HD)
        kf = k.reshape(qf.shape[0] // self.n_rep, s, -1).repeat_interleave(self.n_rep, dim=0)
        y = torch.bmm(torch.softmax(torch.bmm(qf, kf.transpose(1, 2)), -1), kf).view(b, self.heads, s, HD)
        return self.o(y.transpose(1, 2).reshape(b, s, H))


def test_a_run_time_size_beside_an_inferred_one_is_left_whole_with_the_reason():
    """A view infers one size only: a run-time size of the folded dim beside a ``-1`` keeps attention whole."""
    torch.manual_seed(0)
    model, args, kwargs = build_with(LMWith("fold_from_q", _TwoRunTimeSizes))
    plan = make_plan(capture(model, args, kwargs)[0], 2)
    assert [m for m, _ in plan.replicated] == ["blocks.0.attn", "blocks.1.attn"], plan.replicated
    assert all("the size of the sharded dim is computed at run time" in why for _, why in plan.replicated)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_parallel_blocks_train_exactly_with_one_all_reduce_per_block(world: int):
    """The parallel blocks cut whole (q and ff by tp, the one k and v head on every rank), trained 3 AdamW steps:
    per layer two forward all-reduces of b·s·h (the parallel block's attention and feed-forward rows summed,
    then the MLP's), where one per row would be three."""
    results = RUNS(world, "parallel blocks")
    bsh, bs, layers = 2 * S * H, 2 * S, 2
    for rank, by_kind in results.items():
        assert list(by_kind) == list(PARALLEL)
        for kind, r in by_kind.items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert not r["replicated"] and r["whole"] == {} and r["unexplained"] == [], (kind, r)
            assert r["fraction"] <= 1 / world + 0.12, (kind, r["fraction"])
            assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * (2 * layers + 1) + [
                ("all_reduce", "max", bs), ("all_reduce", "sum", bs), ("all_reduce", "sum", bs)]), (kind, r["forward"])
            # backward: entering the fused column and the MLP per layer, the LM head; the one shared k and v head,
            # held by every rank, has its weight gradient (h·d each) summed over them
            assert [c for c in r["backward"] if c[2] == bsh] == [("all_reduce", "sum", bsh)] * (2 * layers + 1), kind
            assert [c for c in r["backward"] if c[2] != bsh] == [("all_reduce", "sum", HD * H)] * 2 * layers, \
                (kind, r["backward"])


@pytest.mark.slow
@pytest.mark.extended
def test_parallel_blocks_train_exactly_with_sequence_parallelism():
    """With sequence parallelism each of a parallel block's two rows is reduce-scattered along the sequence
    (Megatron's parallel block: one per row), the MLP's and the embedding's too: 3 per layer + 1, exact."""
    results = RUNS(2, "parallel blocks sp")
    for rank, by_kind in results.items():
        for kind, r in by_kind.items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert not r["replicated"] and r["whole"] == {}, (kind, r)
            assert [c[0] for c in r["forward"]].count("reduce_scatter") == 3 * 2 + 1, (kind, r["forward"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_attention_gaps_train_exactly_with_megatron_collectives(world: int):
    results = RUNS(world, "attention gaps")
    bsh, bs, layers = 2 * S * H, 2 * S, 2
    for rank, by_kind in results.items():
        assert list(by_kind) == list(KINDS)
        for kind, r in by_kind.items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert not r["replicated"] and r["whole"] == {} and r["unexplained"] == [], (kind, r)
            assert r["fraction"] <= 1 / world + 0.12, (kind, r["fraction"])
            # forward: the embedding's and 2 per layer all-reduces of b·s·h (3 in a parallel block: its attention's
            # and its feed-forward's rows, then the MLP's), the loss's max and 2 sums of b·s
            rows = 3 if kind in PARALLEL else 2
            assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * (rows * layers + 1) + [
                ("all_reduce", "max", bs), ("all_reduce", "sum", bs), ("all_reduce", "sum", bs)]), (kind, r["forward"])
            # backward: one entering attention (the fused projection) and one entering the MLP per layer, one for
            # the LM head; kv heads held by several ranks (2 kv heads at tp 4, the one shared head of a parallel
            # block) have their k and v weight gradients summed over those ranks, one head of h each
            assert [c for c in r["backward"] if c[2] == bsh] == [("all_reduce", "sum", bsh)] * (2 * layers + 1), kind
            shared = kind in PARALLEL or (kind in FOLDS and world > NKV)
            assert [c for c in r["backward"] if c[2] != bsh] == [("all_reduce", "sum", HD * H)] * 2 * layers * shared, \
                (kind, r["backward"])
