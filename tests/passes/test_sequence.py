"""Sequence parallelism (Megatron-SP): the plan, the rewritten graph, and multi-process parity."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from autotp.capture.tracer import capture
from autotp.operators.collectives import ColumnGroup, EnterTP, LeaveTP
from autotp.passes import run_passes
from autotp.plan.plan import SEQ_PARAMS
from autotp.plan.planner import make_plan
from autotp.operators.seq_ops import AllGatherSeq, GatherSeq, ReduceScatterSeq, SeqColumnGroup, SliceSeq, SumGrads
from ranks import launch, reusing
from small_models import MODELS
from shared_graphs import SHARED, copy_graph, spelling
from pattern_models import KINDS, S

# model -> (b, s, h, layers, parameters applied to sequence slices: norms and row biases)
SHAPES = {"nanogpt": (4, 32, 64, 2, (5 * 2 + 4) * 64), "gpt2": (4, 16, 64, 2, (5 * 2 + 4) * 64),
          "llama": (4, 16, 64, 2, 5 * 64)}


def _graph(name: str) -> fx.GraphModule:
    """The shared capture (tests/support/shared_graphs.py): planned here, rewritten only as a copy."""
    return spelling("small_models", name)[3]


def _calls(gm: fx.GraphModule, kind: type) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), kind)]


@SHARED
@pytest.mark.parametrize("name", list(SHAPES))
def test_plan_and_graph(name: str):
    gm = _graph(name)
    plan = make_plan(gm, 2, sequence_parallel=True)
    seq = plan.sequence
    layers = 2
    assert seq.length is not None and seq.length[1] == 1  # the token ids' dim 1, found from attention
    assert len(seq.leaves) == 2 * layers + 1 and len(seq.enters) == 2 * layers + 1  # + embedding, LM head
    assert all(e.regather for e in seq.enters) and not seq.gathers and not seq.notes
    # GPT-2's Conv1D reads the activations flat ([b·s, h]): gathered before the view, reduce-scattered after
    assert all(e.flatten == (name == "gpt2" and e.module != "lm_head") for e in seq.enters)
    kinds = [(c.direction, c.kind) for c in plan.collectives if c.op != "max"]
    assert kinds.count(("forward", "reduce_scatter")) == kinds.count(("forward", "all_gather")) == 2 * layers + 1
    assert kinds.count(("backward", "reduce_scatter")) == 2 * layers + 1
    assert kinds.count(("backward", "all_gather")) == 2 * (2 * layers + 1) + (name != "llama")  # + positions
    big = [c for c in plan.collectives if c.kind == "all_reduce" and len(c.shape) == 3]
    assert big == []  # no all-reduce of b·s·h is left
    (grads,) = [c for c in plan.collectives if c.module == SEQ_PARAMS]
    assert grads.shape == (str(SHAPES[name][4]),)

    gm = run_passes(copy_graph(gm), plan)
    fused = _calls(gm, SeqColumnGroup)
    assert len(fused) == 2 * layers + 1 and not _calls(gm, ColumnGroup) and not _calls(gm, AllGatherSeq)
    assert len(_calls(gm, ReduceScatterSeq)) == 2 * layers + 1
    assert not _calls(gm, LeaveTP) and not _calls(gm, EnterTP)
    (sum_grads,) = _calls(gm, SumGrads)
    assert sum(p.meta["val"].numel() for p in sum_grads.args) == SHAPES[name][4]
    for rs in _calls(gm, ReduceScatterSeq):
        (src,) = rs.all_input_nodes  # a row matmul, the view that unflattens one, or the masked lookup
        assert src.target in (torch.ops.aten.linear.default, torch.ops.aten.mm.default,
                              torch.ops.aten.view.default) or src.op == "call_module"
    for rs in _calls(gm, ReduceScatterSeq):  # a row bias is added after the reduce-scatter, to s/t positions
        for u in rs.users:
            bias = u.args[1] if u.target is torch.ops.aten.add.Tensor else None
            if isinstance(bias, fx.Node) and bias.target is operator.getitem:
                assert bias.args[0] is sum_grads
    if name != "llama":  # learned positions: this rank's slice
        (cut,) = _calls(gm, SliceSeq)
        assert cut.args[0].target is torch.ops.aten.embedding.default or cut.args[0].target.__name__.startswith("to")


@SHARED
@pytest.mark.parametrize("name", list(SHAPES))
def test_collectives_match_the_formula_count_for_count(name: str):
    """The report's Megatron-SP formula counts every collective the plan runs, learned position tables
    included: their s/t slice's gradient is one all-gather of s·h backward (was reported as 11 against 10)."""
    from autotp.reports.sharding import build_report

    model, _, _, gm = spelling("small_models", name)
    plan = make_plan(gm, 2, sequence_parallel=True)
    b, s, h = SHAPES[name][:3]
    report = build_report(plan, model.named_parameters(remove_duplicate=False), b, s)
    for line in report.comm:
        assert line.count == line.formula_count and line.elements == line.formula_elements, line
    gathers = next(line for line in report.comm if (line.direction, line.kind) == ("backward", "all_gather"))
    positions = name != "llama"  # rotary tables are buffers: sliced, no gradient to gather
    assert gathers.count == 2 * (2 * 2 + 1) + positions
    assert gathers.elements == 2 * (2 * 2 + 1) * b * s * h + positions * s * h


@SHARED
@pytest.mark.parametrize("kind", KINDS)
def test_attention_spellings_find_the_sequence(kind: str):
    plan = make_plan(spelling("pattern_models", kind)[3], 2, sequence_parallel=True)
    seq = plan.sequence
    assert not seq.notes and not seq.gathers, (seq.notes, seq.gathers)
    assert len(seq.leaves) == len(plan.pairs) + 1  # every pair's output and the embedding reduce-scatter
    # every pair's input is gathered (side by side, attention and MLP each gather the one norm's output)
    assert len(seq.enters) == sum(len(p.enter) for p in plan.pairs) + 1
    assert {d for x in seq.leaves for d in [x.dim]} == {1}


@SHARED
def test_without_sequence_parallel_the_plan_is_unchanged():
    gm = _graph("nanogpt")
    assert make_plan(gm, 2).sequence is None
    plain, sp = make_plan(gm, 2), make_plan(gm, 2, sequence_parallel=True)
    assert plain.params == sp.params and plain.pairs == sp.pairs and plain.rewrites == sp.rewrites


def test_ops_that_need_the_whole_sequence_get_it_gathered():
    model, (idx, _), _ = MODELS["nanogpt"]()
    gm = capture(model, (idx,), {})[0]  # no targets: the LM head reads x[:, [-1], :] only
    plan = make_plan(gm, 2, sequence_parallel=True)
    (g,) = plan.sequence.gathers
    assert g.dim == 1 and "index" in g.reason
    head = [e for e in plan.sequence.enters if e.module == "lm_head"]
    assert head == []  # the head reads a replicated value: plain f
    gm = run_passes(gm, plan)
    assert len(_calls(gm, GatherSeq)) == 1 and len(_calls(gm, SeqColumnGroup)) == 2 * 2


def test_a_sequence_of_one_plans_plain_tensor_parallelism():
    model, (idx, _), _ = MODELS["nanogpt"]()
    plan = make_plan(capture(model, (idx[:, :1],), {})[0], 2, sequence_parallel=True)
    assert plan.sequence.leaves == () and "plain tensor parallelism" in plan.sequence.notes[0]
    assert [c.kind for c in plan.collectives if len(c.shape) == 3] == ["all_reduce"] * 2 * (2 * 2 + 1)


# every model at tp 2; at tp 4 Llama (its kv heads fewer than 4), nanoGPT and GPT-2 in the extended run
AT = {(2, False): list(SHAPES), (4, False): ["llama"], (4, True): ["nanogpt", "gpt2"]}


@pytest.mark.slow
@pytest.mark.parametrize("world,rest", [(2, False), pytest.param(4, False, marks=pytest.mark.extended),
                                        pytest.param(4, True, marks=pytest.mark.extended)])
def test_sequence_parallel_parity(world: int, rest: bool):
    # the other calls and dropout streams at tp 2 only: they are about plans, not the group's size
    results = launch(reusing(__import__("parity_workers").sequence_parallel_parity), world, AT[world, rest], world == 2)
    for rank, r in results.items():
        for name, (b, s, h, layers, sp_params) in ((n, SHAPES[n]) for n in AT[world, rest]):
            m = r[name]
            assert m["loss_diff"] <= 1e-5 and m["logits_diff"] <= 1e-5 and m["grad_diff"] <= 1e-5, (name, m)
            assert m["param_diff"] <= 1e-5, (name, m["param_diff"])  # after 3 AdamW steps
            bsh = b * s * h
            fwd = [c for c in m["forward_collectives"] if c[2] == bsh]
            bwd = [c for c in m["backward_collectives"] if c[2] == bsh]
            # per layer: attention and MLP each all-gather their input and reduce-scatter their output;
            # the embedding reduce-scatters, the LM head all-gathers; nothing of b·s·h is all-reduced
            assert sorted(fwd) == sorted([("all_gather", "", bsh)] * (2 * layers + 1) +
                                         [("reduce_scatter", "sum", bsh)] * (2 * layers + 1)), (name, fwd)
            # backward, the mirror (reduce-scatter of the inputs' gradients, all-gather of the outputs'), and
            # each column group's input all-gathered again for its weight gradients (only s/t of it is kept)
            assert sorted(bwd) == sorted([("reduce_scatter", "sum", bsh)] * (2 * layers + 1) +
                                         [("all_gather", "", bsh)] * (2 * (2 * layers + 1))), (name, bwd)
            small = [c for c in m["backward_collectives"] if c[2] != bsh]
            assert ("all_reduce", "sum", sp_params) in small  # norm weights and row biases, summed at once
            if name != "llama":
                assert ("all_gather", "", s * h) in small  # the learned positions' gradient
            ce = [c for c in m["forward_collectives"] if c[2] != bsh]
            assert [c[1] for c in ce] == ["max", "sum", "sum"] and {c[2] for c in ce} == {b * s}
        if world != 2:
            continue
        o = r["other_calls"]
        assert o["last_position_diff"] <= 1e-5 and o["odd_length_diff"] <= 1e-5
        assert any("index" in g for g in o["gathers"])
        assert any("not divisible by tp" in w for w in o["warnings"])
        assert o["odd_length_calls"] and all(k == "all_reduce" for k, _, _ in o["odd_length_calls"])
        for kind, p in r["patterns"].items():
            assert p["loss_diff"] <= 1e-5 and p["grad_diff"] <= 1e-5 and p["param_diff"] <= 1e-5, (kind, p)
            assert not p["replicated"], (kind, p["replicated"])
            assert not [c for c in p["forward"] if c[0] == "all_reduce" and c[2] > 2 * S]  # only b·s-sized
        d = r["dropout"]
        assert d["split_random_ops"] == 1 + 2 * 2  # embedding dropout and two residual dropouts per layer
        assert d["masks_differ"] and d["default_stream_identical"]
        assert 0.05 < d["dropped_fraction"] < 0.15
