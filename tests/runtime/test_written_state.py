"""State a forward writes on its model is written by the parallel model too (tests/support/written_state_models.py:
the loss kept on the model, caches built on first use, a dict cache with a length and a flag, a complex rotary
table re-assigned to itself at the root or in a submodule): capture records each write, a buffer re-assigned
to itself writes nothing in the graph, and at tp 2 and 4 training from ``model.last_loss``, sampling and a
method reading the caches leave every ``__dict__`` entry equal to the unsharded model's."""
from __future__ import annotations

import math

import pytest
import torch

from autotp.capture.tracer import capture_blocks
from autotp.capture.writes import WRITES_KEY
from autotp.parallel.writeback import state_difference
from ranks import Launches, launch
from written_state_models import PIPELINE_STYLES, STYLES, build
from written_state_workers import pipeline_written_state, written_state_parity


def _writes(style: str):
    model, (x, y) = build(style)
    cg = capture_blocks(model, (x, y), {}, writes=True)
    return cg.gm, cg.gm.meta.get(WRITES_KEY)


@pytest.mark.parametrize("style", ["complex_root", "complex_sub"])
def test_buffer_assigned_to_itself_writes_nothing_in_the_graph(style: str):
    gm, writes = _writes(style)
    copies = [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert copies == [], [n.format_node() for n in copies]
    # the loss kept on the model is the one write left: nothing rebinds the table
    assert [(w.where, w.kind) for w in writes.items] == [("last_loss", "attr")]


def test_each_write_is_recorded_with_how_to_replay_it():
    _, writes = _writes("dict_cache")
    got = {w.where: (w.kind, w.value.kind) for w in writes.items}
    assert got == {"caches['rope']": ("item", "tensor"), "seq_len_cached": ("attr", "size"),
                   "ready": ("attr", "const"), "last_loss": ("attr", "tensor")}, got
    assert writes.named == ()
    _, lazy = _writes("lazy_caches")
    assert [w.where for w in lazy.items] == ["rope_cache", "mask_cache", "last_loss"]
    model, (x, y) = build("lazy_caches")
    capture_blocks(model, (x, y), {}, writes=True)
    assert model.rope_cache is None and model.last_loss is None  # capture itself still leaves the model as it was


def test_a_list_grown_in_place_is_named():
    class Logged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.seen: list[int] = []

        def forward(self, x):
            self.seen.append(1)
            return self.lin(x)

    cg = capture_blocks(Logged(), (torch.randn(2, 4),), {}, writes=True)
    assert [n.split(":")[0] for n in cg.gm.meta[WRITES_KEY].named] == ["seen"]


def test_state_difference_names_the_piece_that_differs():
    a, (x, y) = build("dict_cache")
    b = build("dict_cache")[0]
    a(x, y), b(x, y)
    state = [("", "last_loss", "attr", None), ("", "caches", "item", "rope"), ("", "seq_len_cached", "attr", None)]
    assert state_difference(a, b, state) == (0.0, "")
    b.caches["rope"] = b.caches["rope"] + 0.5
    diff, at = state_difference(a, b, state)
    assert diff == pytest.approx(0.5, abs=1e-6) and at == "caches['rope']"
    b.seq_len_cached = 3
    assert state_difference(a, b, state) == (math.inf, "seq_len_cached")


# at tp 2 by default: a complex table in a submodule, caches made on first use, a counter (the fast tier above
# records the writes of the table on the root and of the dict cache too, which train at tp 2 in the extended
# run); at tp 4, extended (four ranks on CI's two cores cost the most of any launch), the table in a submodule
# and the caches, then the rest
AT = {2: ["complex_sub", "lazy_caches", "counter"], 4: ["complex_sub", "lazy_caches"]}


@pytest.fixture(scope="module")
def runs() -> Launches:
    return Launches({2: {"written": (written_state_parity, AT[2])}},
                    extended={2: {"rest": (written_state_parity, [s for s in STYLES if s not in AT[2]])},
                              4: {"written": (written_state_parity, AT[4]),
                                  "rest": (written_state_parity, [s for s in STYLES if s not in AT[4]])}})


@pytest.mark.slow
@pytest.mark.parametrize("world,part", [(2, "written"), pytest.param(2, "rest", marks=pytest.mark.extended),
                                        pytest.param(4, "written", marks=pytest.mark.extended),
                                        pytest.param(4, "rest", marks=pytest.mark.extended)])
def test_written_state_equals_the_unsharded_models(runs, world: int, part: str):
    for rank, by_style in runs(world, part).items():
        for style, r in by_style.items():
            assert r["state"] == [], (rank, style, r["state"][:5])
            assert max(r["logits"], r["loss"], r["grad"], r["param"]) <= 1e-5, (rank, style, r)
            assert r["tokens"], (rank, style)
            assert r["fraction"] <= 1 / world + 0.12, (style, r["fraction"])
            # train (loss None, then kept), sample (kept, then None): each state captured once, then cheap
            assert r["graphs"] <= 4, (style, r["graphs"])


# -- pipeline stages: which stage keeps what, and how micro-batches make the whole batch's value ----------
@pytest.fixture(scope="module")
def kept_split():
    """kept_outputs (logits per sample, the ids, the loss on the model) captured and cut into 2 stages."""
    from autotp.operators.stages import wire_stages
    from autotp.parallel.stage_writes import mark_outputs, output_facts, output_stages, written_loss
    from autotp.passes import run_passes, split_stages
    from autotp.plan.planner import make_plan
    from autotp.plan.stages import StageRequest

    model, (x, y) = build("kept_outputs")
    gm = capture_blocks(model, (x, y), {}, writes=True, static=True).gm
    writes = gm.meta[WRITES_KEY]
    facts = output_facts(gm)
    top = run_passes(gm, make_plan(gm, 1, stages=StageRequest(2)), (split_stages,))
    mark_outputs(top, facts)
    loss = written_loss(top, writes)
    owner = output_stages(top, [w.results for w in wire_stages(top, loss)])
    return top, writes, loss, owner


def test_pipeline_stages_keep_what_the_forward_writes(kept_split):
    from autotp.parallel.stage_writes import stage_writes

    top, writes, loss, owner = kept_split
    at = {w.where: w.value.value for w in writes.items}
    # the forward returns only logits: the loss it keeps on the model is what the last stage ends in
    assert loss == at["last_loss"]
    sw = stage_writes(top, writes, loss, owner, cut={0, 1})
    how = dict(sw.how)
    assert how[at["last_loss"]] == ("loss", torch.float32)  # every rank writes the step's loss
    assert how[at["last_logits"]] == "batch"  # per sample: the micro-batches' concatenated
    assert how[at["last_idx"]] == ("input", 0)  # the step's own input
    assert set(sw.keep(1)) == {at["last_logits"], at["last_loss"]} and sw.keep(0) == ()
    # with nothing cut into micro-batches (a batch of one), the logits are the same on every micro-batch
    assert dict(stage_writes(top, writes, loss, owner, cut=set()).how)[at["last_logits"]] == "same"


def test_micro_batches_make_the_whole_batch_value_or_none():
    from autotp.parallel.stage_writes import _combine

    a, b = torch.arange(6.).view(2, 3), torch.arange(6., 12.).view(2, 3)
    assert torch.equal(_combine([a, b], "batch", 2), torch.cat([a, b]))
    assert torch.equal(_combine([a, b], "same", 2), b)
    # a mean over the batch kept on the model has no whole-batch value from the micro-batches': not written
    assert _combine([a.mean(), b.mean()], "batch", 2) is None


# pp 2 (1F1B, 2 micro-batches): the first stage computes the caches and the counter, the last the logits; every
# rank writes the loss (the step's, which each rank has) and the ids. What each pipeline rank does not hold:
ELSEWHERE = {0: {"kept_outputs": {"last_logits"}},
             1: {"lazy_caches": {"rope_cache", "mask_cache"}, "dict_cache": {"caches"}, "counter": {"calls"}}}
PIPELINED = {1: PIPELINE_STYLES, 2: ["lazy_caches", "counter", "kept_outputs"]}


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("tp", [1, 2])
def test_pipelined_written_state_equals_the_unsharded_models(tp: int):
    """After each of 3 training steps and an eval_step, every ``__dict__`` entry of each rank's model equals the
    unsharded model's, but for the pieces another pipeline rank's stage computes (left as they were)."""
    for rank, by_style in launch(pipeline_written_state, 2 * tp, PIPELINED[tp], tp).items():
        for style, r in by_style.items():
            assert max(r["loss"], r["param"], r["eval"]) <= 1e-5, (rank, style, r)
            assert r["stages"] == [rank // tp]
            for phase, differs in enumerate(r["phases"]):
                assert set(differs) == ELSEWHERE[rank // tp].get(style, set()), (rank, style, phase, differs)


def test_blocks_are_copied_where_the_writes_are_outside_them():
    """Capture exports a few blocks and copies the rest unless the copies would have to write state too: a
    write on a block's module, a number the forward may have counted over its blocks, or one not replayed."""
    from autotp.capture.structure import Spec
    from autotp.capture.tracer import _writes_outside
    from autotp.capture.writes import Write, Writes

    loss, flag = Write("", "last_loss", "attr", Spec("tensor", 1)), Write("", "ready", "attr", Spec("const", True))
    assert _writes_outside(Writes(1, (loss, flag)), "blocks")
    assert not _writes_outside(Writes(1, (Write("blocks.2.attn", "kv", "attr", Spec("tensor", 1)),)), "blocks")
    assert not _writes_outside(Writes(1, (Write("", "n_run", "attr", Spec("const", 4)),)), "blocks")
    assert not _writes_outside(Writes(1, (loss,), ("seen: a list changed in place",)), "blocks")


@pytest.mark.slow
@pytest.mark.extended
def test_written_state_with_copied_blocks_equals_the_unsharded_models():
    """4 blocks (capture exports a few and copies the rest) with the loss, lazy caches and per-sample
    logits written outside them: the copying stays on, and every ``__dict__`` entry equals the unsharded model's."""
    for rank, by_style in launch(written_state_parity, 2, ["lazy_caches", "kept_outputs"], 3, 4).items():
        for style, r in by_style.items():
            assert r["state"] == [], (rank, style, r["state"][:5])
            assert max(r["logits"], r["loss"], r["grad"], r["param"]) <= 1e-5, (rank, style, r)
            assert r["tokens"] and any(r["copied"]), (rank, style, r)
