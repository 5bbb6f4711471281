"""Copying rewritten blocks (autotp.capture.repeats.Copies after the passes, as a later call signature does):
the graph equals the whole graph rewritten, node for node; a rewrite that groups several blocks' values in one
node is refused, never copied wrong. Structural: no process group, the graphs are not run."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from autotp.capture.tracer import capture_blocks
from autotp.passes import run_passes
from autotp.plan.planner import make_plan
from later_workers import MODELS
from small_models import llama


def _ops(gm) -> Counter:
    """What the graph runs: each call's target (collectives are call_module nodes named by their pair)."""
    return Counter(str(n.target) if n.op == "call_function" else type(gm.get_submodule(n.target)).__name__
                   for n in gm.graph.nodes if n.op in ("call_function", "call_module"))


def _models():
    model, args, kwargs = llama(layers=5)
    yield "llama with a cache", model.eval(), args, {k: v for k, v in kwargs.items() if k != "use_cache"}
    for name in ("alternating", "dense_first_dropout"):
        model, args, kwargs = MODELS[name]()
        yield name, model, args, kwargs


@pytest.mark.parametrize("case", [pytest.param(c, id=c[0], marks=() if c[0] == "llama with a cache" else pytest.mark.extended)
                                  for c in _models()])
def test_rewritten_blocks_copied_equal_the_whole_graph_rewritten(case):
    _, model, args, kwargs = case
    cut = capture_blocks(model, args, kwargs)
    assert cut.copies is not None
    plan = make_plan(cut.gm, 2)
    gm = run_passes(cut.gm, plan)
    spec = cut.copies.apply(gm)

    whole_gm, whole_spec = capture_blocks(model, args, kwargs).whole()
    whole_plan = make_plan(whole_gm, 2)
    whole_gm = run_passes(whole_gm, whole_plan)
    assert spec == whole_spec
    assert _ops(gm) == _ops(whole_gm)
    # the cut plan names the exported blocks' parameters; with the copies' names it names the whole plan's
    cuts = dict(plan.params)
    for name, shard in plan.params:
        for copy, module in zip(cut.copies.names(name), cut.copies.names(shard.module)):
            cuts[copy] = shard.__class__(**{**shard.__dict__, "module": module})
    assert cuts == dict(whole_plan.params)
    # every copied get_attr reads its own block's tensor
    targets = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert sorted(set(targets)) == sorted({n.target for n in whole_gm.graph.nodes if n.op == "get_attr"})


def test_a_node_over_several_blocks_is_refused():
    """Sequence parallelism sums its norms' weight gradients in one node over every block: the copies would
    read the exported blocks' weights through it, so copying is refused (the graph untouched)."""
    model, args, kwargs = llama(layers=5)
    cut = capture_blocks(model, args, kwargs)
    plan = make_plan(cut.gm, 2, sequence_parallel=True)
    assert plan.sequence is not None and plan.sequence.grads
    gm = run_passes(cut.gm, plan)
    before = len(gm.graph.nodes)
    assert cut.copies.apply(gm) is None
    assert len(gm.graph.nodes) == before


def test_names_of_copies():
    model, args, kwargs = MODELS["alternating"]()  # g l g l g l: block 1 (l) and 2 (g) are the templates
    copies = capture_blocks(model, args, kwargs).copies
    assert copies.rep.keep == 3
    assert copies.names("h.1.qkv.weight") == ["h.3.qkv.weight", "h.5.qkv.weight"]
    assert copies.names("h.2.ln1") == ["h.4.ln1"]
    assert copies.names("h.2") == ["h.4"]
    assert copies.names("h.0.qkv.weight") == [] and copies.names("wte.weight") == []
    assert torch.equal(copies.state["h.5.qkv.weight"], model.h[5].qkv.weight)


def _later(model, args, kwargs, **options):
    """A TPState that holds the first signature's shards (as parallelize leaves it, no group needed) and a
    later signature's cut capture of ``model``."""
    from autotp.options import Options
    from autotp.state import RankIdentity, TPState

    gm, _ = capture_blocks(model, args, kwargs).whole()
    first = make_plan(gm, 2)
    st = TPState(RankIdentity(None, 2, 0, torch.device("cpu")), Options(), type(model), None)
    st.shards, st.cached = {**dict(first.params), **dict(first.buffers)}, first
    model.eval()
    return st, capture_blocks(model, args, kwargs), first


def _planned(st, model, args, kwargs, sequence_parallel: bool):
    """A later signature of ``model`` captured and planned as parallelize's ``_build`` does (the exported
    blocks alone, where the job lets them be copied)."""
    from autotp.parallel.planning import capture_and_plan, job_of

    return capture_and_plan(model, args, kwargs, job_of(st.tp, st.options, sequence_parallel=sequence_parallel),
                            blocks=True)


def test_rewrite_copies_a_later_signature_and_checks_every_copy_by_its_own_name(monkeypatch):
    from autotp.errors import ShardingError
    from autotp.parallel import rewrite as rw

    model, args, kwargs = MODELS["dense_first_dropout"]()
    st, cut, first = _later(model, args, kwargs)
    done = rw.rewrite(st, _planned(st, model, args, kwargs, False), stacklevel=2)
    assert done.copied and len(done.plan.params) < len(first.params)
    whole = rw.rewrite(st, _planned(st, model, args, kwargs, True), stacklevel=2)  # sequence parallel: whole
    assert not whole.copied

    # a copy cut differently from its template's cut: named by its own name
    name, kept = "h.4.fc.weight", st.shards["h.4.fc.weight"]
    st.shards[name] = kept.__class__(**{**kept.__dict__, "dim": 1})
    with pytest.raises(ShardingError, match=r"h\.4\.fc\.weight is sharded as"):
        rw.rewrite(st, _planned(st, model, args, kwargs, False), stacklevel=2)
    st.shards[name] = kept

    # copies refused after the passes: the whole model is exported and rewritten instead
    cut = capture_blocks(model, args, kwargs)
    monkeypatch.setattr(type(cut.copies), "apply", lambda self, gm: None)
    done = rw.rewrite(st, _planned(st, model, args, kwargs, False), stacklevel=2)
    assert not done.copied and dict(done.plan.params) == dict(first.params)
