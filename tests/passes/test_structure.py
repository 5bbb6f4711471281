"""Structural tests: run the planner and passes on captured graphs with no process group and inspect
which collectives were inserted, where, and which constants changed."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from autotp.capture.tracer import capture
from autotp.operators.collectives import ColumnGroup, EnterTP, LeaveTP
from autotp.errors import ShardingError
from autotp.passes import run_passes
from autotp.plan.planner import make_plan
from autotp.operators.vocab_ops import VocabCrossEntropy, VocabEmbedding, VocabOutput
from shared_graphs import SHARED, copy_graph, spelling
from small_models import MODELS

aten = torch.ops.aten
MATMULS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default}


def _graph(name: str) -> fx.GraphModule:
    """The shared capture (tests/support/shared_graphs.py): planned here, rewritten only as a copy."""
    return spelling("small_models" if name in MODELS else "toy_models", name)[3]


def _calls(gm: fx.GraphModule, kind: type) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), kind)]


@SHARED
@pytest.mark.parametrize("name", ["nanogpt", "gpt2", "llama"])
@pytest.mark.parametrize("tp", [2, 4])
def test_two_collectives_per_layer_around_the_pairs(name: str, tp: int):
    gm = _graph(name)
    plan = make_plan(gm, tp)
    gm = run_passes(copy_graph(gm), plan)
    layers = 2
    enters, leaves = _calls(gm, EnterTP), _calls(gm, LeaveTP)
    # one f per layer half, plus the LM head's; one g per layer half, plus the vocab-parallel embedding's
    assert len(enters) == 2 * layers + 1 and len(leaves) == 2 * layers + 1
    assert plan.replicated == ()
    fused = [f for f in enters if isinstance(gm.get_submodule(f.target), ColumnGroup)]
    # every pair's f is fused with its columns, and the LM head's with it (its all-reduce overlaps dW)
    assert len(fused) == 2 * layers + 1
    # the columns a group computes are those whose plain form the plan records (each keeps its name)
    assert {u.name for f in fused for u in f.users} == {form.node for form in plan.column_forms}
    for f in enters:  # f feeds only column matmuls of its pair (q, k, v share one f), or computes them itself
        assert f.users and all(u.target in MATMULS or (f in fused and u.target is operator.getitem) for u in f.users)
    for g in leaves:  # g follows a row matmul, or the masked vocab lookup
        (src,) = g.all_input_nodes
        assert src.target in MATMULS or isinstance(gm.get_submodule(src.target), VocabEmbedding)
    assert len(_calls(gm, VocabEmbedding)) == 1 and len(_calls(gm, VocabCrossEntropy)) == 1
    (out,) = _calls(gm, VocabOutput)
    assert out.next.op == "output"
    assert not [n for n in gm.graph.nodes if n.target is aten.cross_entropy_loss.default]
    by_name = {n.name: n for n in gm.graph.nodes}
    for pair in plan.pairs:
        row = by_name[pair.row]
        (g,) = row.users
        if pair.row_bias is not None:  # the bias moved after the all-reduce
            assert row.target in (aten.linear.default, aten.mm.default) and len(row.args) == 2
            (add,) = g.users
            assert add.target is aten.add.Tensor and add.args[1].target == pair.row_bias
    directions = [(c.direction, c.op) for c in plan.collectives]
    assert directions.count(("forward", "sum")) == 2 * layers + 1 + 2 and directions.count(("forward", "max")) == 1
    assert directions.count(("backward", "sum")) == 2 * layers + 1


@SHARED
def test_head_counts_and_split_sizes_are_rewritten():
    gm = _graph("nanogpt")
    plan = make_plan(gm, 2)
    changed = {(r.node, r.old, r.new) for r in plan.rewrites}
    assert ("split", 64, 32) in changed  # q|k|v split of the fused c_attn: 64 -> 32 per segment
    assert ("view", 4, 2) in changed  # 4 heads -> 2 per rank
    assert ("view_3", 64, 32) in changed  # (b, s, h) -> (b, s, h/t) before c_proj
    gm = run_passes(copy_graph(gm), plan)
    views = [n.args[1] for n in gm.graph.nodes if n.target is aten.view.default and len(n.args[1]) == 4]
    assert views and all(v[2] == 2 for v in views)


@SHARED
def test_fused_qkv_is_cut_per_segment():
    plan = make_plan(_graph("gpt2"), 2)
    shard = plan.param("transformer.h.0.attn.c_attn.weight")
    assert shard.role == "column" and shard.dim == 1  # Conv1D keeps W as [in, out]
    assert [(s.size, s.parts) for s in shard.segments] == [(64, 2)] * 3
    assert shard.local_shape == (64, 96)
    assert plan.param("transformer.h.0.attn.c_proj.weight").dim == 0
    assert plan.param("transformer.h.0.attn.c_proj.bias") is None  # row bias stays whole


@SHARED
def test_kv_heads_replicate_when_tp_exceeds_them():
    gm = _graph("llama")
    plan = make_plan(gm, 4)
    k = plan.param("model.layers.0.self_attn.k_proj.weight")
    q = plan.param("model.layers.0.self_attn.q_proj.weight")
    assert [(s.size, s.parts) for s in k.segments] == [(32, 2)]  # 2 kv heads, each on 2 ranks
    assert [(s.size, s.parts) for s in q.segments] == [(64, 4)]
    gm = run_passes(copy_graph(gm), plan)
    expands = [n.args[1] for n in gm.graph.nodes if n.target is aten.expand.default and len(n.args[1]) == 5]
    assert expands and all(e[1:3] == [1, 1] for e in expands)  # 1 local kv head, repeated once


@pytest.mark.extended
def test_one_kv_head_broadcast_over_query_heads_is_replicated_on_every_rank():
    """Multi-query attention fused with the queries (``q | k | v`` of widths ``(n·d, d, d)``, Falcon-7B's
    ``[b, s, n + 2, d]``), its one k and v head broadcast over the q heads: unexpanded into attention, in a
    written-out ``q @ k.transpose(-2, -1)``, by ``expand_as``, ``repeat`` or ``expand(-1, n, -1, -1)``, kept as
    ``(b, s, d)`` and unsqueezed, picked by ``f[..., -2, :]``, or split after an unsqueeze and repeated as Hugging
    Face's repeat_kv does (GPTBigCode). The q heads are split, the k and v head is held whole by every rank (its
    weight and bias blocks too: their gradients are summed), and an expand or repeat makes only this rank's q
    heads. A KV cache of that head is held whole too."""
    import copy

    from cache_models import build as build_cached
    from pattern_models import MQA, NH, build

    for kind in MQA:
        model, args, kwargs = build(kind)
        gm = capture(model, args, kwargs)[0]
        for tp in (2, 4):
            plan = make_plan(gm, tp)
            assert not plan.replicated and len(plan.pairs) == 4, (kind, tp, plan.replicated)
            for p in ("weight", "bias") if kind.endswith("_bias") else ("weight",):
                shard = plan.param(f"blocks.0.attn.qkv.{p}")
                assert [(s.size, s.parts) for s in shard.segments] == [(64, tp), (16, 1), (16, 1)], (kind, tp, p)
                assert shard.replicated_blocks(tp) and shard.local_shape[0] == 64 // tp + 2 * 16, (kind, tp, p)
            local = run_passes(copy.deepcopy(gm), plan)
            grown = [n.args[1][-3] for n in local.graph.nodes  # the heads of (b, [1,] heads, s, d)
                     if n.target in (aten.expand.default, aten.repeat.default) and len(n.args[1]) >= 4]
            made = kind in ("mqa_repeat", "mqa_unsqueeze", "bigcode_bias")
            assert grown == ([NH // tp] * 4 if made else []), (kind, tp, grown)

    with torch.no_grad():
        gm = capture(build_cached("mqa"), (torch.zeros(2, 5, dtype=torch.long), torch.arange(5)), {})[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert not plan.replicated and {n: b.local_shape for n, b in plan.buffers if n.startswith("attn.0")} == {
            "attn.0.kv_cache.k_cache": (2, 1, 16, 16), "attn.0.kv_cache.v_cache": (2, 1, 16, 16)}


@SHARED
@pytest.mark.parametrize("name,segments", [
    ("interleaved", [(192, 2)]),  # [heads, 3, d] per head: a contiguous cut is already right
    ("fused_gqa", [(64, 2), (32, 2), (32, 2)]),
    ("fused_mqa", [(64, 2), (16, 1), (16, 1)]),  # one kv head: every rank holds it
    ("handwritten", [(256, 2), (256, 2)]),  # chunked gate|up of x @ W.T
])
def test_unseen_layouts(name: str, segments):
    plan = make_plan(_graph(name), 2)
    (pair,) = plan.pairs
    shard = plan.param(pair.column_weights[0])
    assert [(s.size, s.parts) for s in shard.segments] == segments


@SHARED
def test_unshardable_region_is_replicated_with_the_reason():
    gm = _graph("head_mixing")
    plan = make_plan(gm, 2)
    assert plan.pairs == () and not [n for n, _ in plan.params if n.startswith("block.")]
    # the mean over heads is all-reduced fine, but then o's input is whole: no column→row pair
    assert any("not sharded on its contracted dim" in reason and module == "block" for module, reason in plan.replicated)
    gm = run_passes(copy_graph(gm), plan)
    # only the vocab-parallel embedding's g and the LM head's f remain
    assert len(_calls(gm, EnterTP)) == 1 and len(_calls(gm, LeaveTP)) == 1


@SHARED
def test_tp_one_plans_nothing():
    plan = make_plan(_graph("nanogpt"), 1)
    assert plan.pairs == () and plan.collectives == ()


def test_heads_not_divisible_name_module_sizes_and_tp():
    from nanogpt import GPT, GPTConfig

    model = GPT(GPTConfig(n_head=3, n_embd=48))
    gm = capture(model, (torch.zeros(2, 8, dtype=torch.long),), {})[0]
    with pytest.raises(ShardingError) as e:
        make_plan(gm, 2)
    msg = str(e.value)
    assert "transformer.h.0.attn.c_attn" in msg and "3" in msg and "tp=2" in msg and "144" in msg

    # fewer query heads than ranks (4 heads, tp 8): copies of a head would each be added by the row matmul
    from pattern_models import build

    model, args, kwargs = build("plain")
    with pytest.raises(ShardingError, match=r"blocks.0.attn: the 64 features .* 4 blocks of heads, fewer than tp=8"):
        make_plan(capture(model, args, kwargs)[0], 8)


@SHARED
def test_gpt2_vocab_is_padded_to_equal_shards():
    plan = make_plan(_graph("gpt2_50257"), 2)
    shard = plan.param("lm_head.weight")
    assert shard.role == "vocab" and shard.vocab.size == 50257
    assert shard.local_shape == (25129, 64)  # ceil(50257 / 2); rank 1 owns 25128 rows + 1 padding row
    assert (shard.vocab.owned(0), shard.vocab.owned(1)) == (25129, 25128)
    assert any(r.old == 50257 and r.new == 25129 for r in plan.rewrites)  # logits.view(-1, V)
    wide = make_plan(_graph("gpt2_50257"), 4, vocab_multiple=64)
    assert wide.param("lm_head.weight").local_shape == (12608, 64)  # ceil(50257/4)=12565 -> multiple of 64


class _Losses(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = torch.nn.Embedding(96, 32)
        self.head = torch.nn.Linear(32, 96)

    def forward(self, idx, targets):
        logits = self.head(self.emb(idx))
        flat, t = logits.flatten(0, 1), targets.flatten()
        if self.kind == "nll":
            return torch.nn.functional.nll_loss(torch.log_softmax(logits, -1).flatten(0, 1), t, reduction="sum")
        if self.kind == "smoothing":
            return torch.nn.functional.cross_entropy(flat, t, label_smoothing=0.1, reduction="none")
        return logits.argmax(-1)  # the logits are read whole: the head must stay replicated


@pytest.mark.parametrize("kind,reduction,smoothing", [("nll", 2, 0.0), ("smoothing", 0, 0.1)])
def test_every_cross_entropy_form_becomes_vocab_parallel(kind, reduction, smoothing):
    idx = torch.zeros(2, 5, dtype=torch.long)
    gm = capture(_Losses(kind), (idx, idx + 1), {})[0]
    plan = make_plan(gm, 2)
    (loss,) = plan.vocab.losses
    assert (loss.reduction, loss.label_smoothing) == (reduction, smoothing)
    assert (loss.log_softmax is not None) == (kind == "nll")
    gm = run_passes(gm, plan)
    assert not [n for n in gm.graph.nodes if n.target in (aten.log_softmax.int, aten.nll_loss_nd.default)]
    assert len(_calls(gm, VocabCrossEntropy)) == 1


def test_logits_read_whole_keep_the_head_replicated():
    idx = torch.zeros(2, 5, dtype=torch.long)
    gm = capture(_Losses("argmax"), (idx, idx), {})[0]
    plan = make_plan(gm, 2)
    assert plan.vocab.heads == () and plan.param("head.weight") is None
    assert any(m == "head" and "argmax" in reason for m, reason in plan.replicated)


@SHARED
def test_statistics_folded_heads_and_cache_buffers_are_planned_and_inserted():
    """A whole-width q/k norm gets one statistics all-reduce per norm and its weight sharded; heads folded
    under the batch get their own local ``b * heads`` size; a cache buffer written with sharded keys is
    sharded (no process group: structure only)."""
    import operator

    from autotp.operators.collectives import ShardedNorm
    from cache_models import build as build_cached

    gm = spelling("pattern_models", "qk_rmsnorm_width")[3]
    plan = make_plan(gm, 2)
    assert not plan.replicated and [s.kind for s in plan.stats] == ["rms_norm"] * 4
    assert plan.param("blocks.0.attn.q_norm.weight").local_shape == (32,)
    gm = run_passes(copy_graph(gm), plan)
    assert len(_calls(gm, ShardedNorm)) == 4 and not [n for n in gm.graph.nodes if n.target is aten.rms_norm.default
                                                      and n.args[1] == [64]]

    # hand-written: x.pow(2).mean(-1) over the width
    plan = make_plan(spelling("pattern_models", "qk_norm_width")[3], 4)
    assert [(s.kind, s.scale) for s in plan.stats] == [("mean", 0.25)] * 4

    gm = spelling("pattern_models", "baddbmm")[3]
    plan = make_plan(gm, 2)
    folded = [r for r in plan.rewrites if r.factor_of]
    assert not plan.replicated and folded and all((r.old, r.new) == (4, 2) for r in folded)
    gm = run_passes(copy_graph(gm), plan)
    assert any(n.target is operator.mul and n.args[1] == 2 for n in gm.graph.nodes)

    with torch.no_grad():
        gm = capture(build_cached("index_put"), (torch.zeros(2, 5, dtype=torch.long), torch.arange(5)), {})[0]
    plan = make_plan(gm, 4)
    assert {n: b.local_shape for n, b in plan.buffers if n.startswith("attn.0")} == {
        "attn.0.kv_cache.k_cache": (2, 1, 16, 16), "attn.0.kv_cache.v_cache": (2, 1, 16, 16)}
    assert len([c for c in plan.collectives if c.direction == "forward"]) == 5  # embedding + 2 per layer


@SHARED
def test_index_lists_read_as_slices_and_width_reductions_become_statistics():
    """``f[..., [-2], :]`` (consecutive positions) is captured as the slice it equals, a scattered list stays an
    index; var and p-norms over the whole projection width become one statistics all-reduce each."""
    from autotp.operators.collectives import ShardedReduction

    class Pick(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 24)

        def forward(self, x):
            f = self.proj(x).view(x.shape[0], x.shape[1], 6, 4)  # (b, s, 6 heads, 4)
            return f[..., [-2], :], f[..., [0, 2], :]

    gm = capture(Pick(), (torch.randn(2, 5, 4),), {})[0]
    picks = [n for n in gm.graph.nodes if n.target in (aten.slice.Tensor, aten.index.Tensor)]
    assert [n.args[1:] for n in picks if n.target is aten.slice.Tensor and n.args[1] == 2] == [(2, 4, 5)]
    assert [n.target for n in picks].count(aten.index.Tensor) == 1

    for kind, stats in (("qk_varnorm_width", ["mean", "var"] * 4), ("qk_l2norm_width", ["norm"] * 4)):
        gm = spelling("pattern_models", kind)[3]
        plan = make_plan(gm, 2)
        assert not plan.replicated and [s.kind for s in plan.stats] == stats, kind
        # the reductions' arguments travel in the plan: over the last (sharded) dim, kept; a var's correction 0,
        # a norm's order 2
        assert {(s.dims, s.keepdim, s.param) for s in plan.stats if s.kind != "mean"} == {
            ((-1,), True, 0.0 if "var" in stats else 2.0)}, kind
        gm = run_passes(copy_graph(gm), plan)
        reductions = [gm.get_submodule(n.target) for n in _calls(gm, ShardedReduction)]
        assert len(reductions) == stats.count("var") + stats.count("norm")
        assert all((m.dims, m.keepdim) == ([-1], True) for m in reductions)


@SHARED
@pytest.mark.parametrize("kind", ["grouped_index", "falcon_select", "mqa_unsqueeze", "offset_slices"])
def test_fused_segments_named_at_tp1_are_those_cut_at_tp2_and_4(kind: str):
    """A checkpoint names a fused projection's segments at every tp, so a tp-1 run must see the segments
    tp 2 and 4 cut: a group of kv heads and a single kv head look alike at tp 1 (one block each)."""
    from autotp.plan.planner import fused_segments

    def layout(seg):
        return seg.size, tuple(layout(i) for i in seg.inner)

    gm = spelling("pattern_models", kind)[3]
    at_1 = fused_segments(gm)
    assert at_1 and all(s.parts == 1 and all(i.parts == 1 for i in s.inner)
                        for shard in at_1.values() for s in shard.segments)
    for tp in (2, 4):
        cut = {n: shard for n, shard in make_plan(gm, tp).params if n in at_1}
        assert cut.keys() == at_1.keys()
        assert all(tuple(map(layout, cut[n].segments)) == tuple(map(layout, at_1[n].segments)) for n in at_1), kind
