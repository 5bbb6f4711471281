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
from ranks import Launches
from written_state_models import STYLES, build
from written_state_workers import written_state_parity


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


# every spelling at tp 2; at tp 4 the complex table in a submodule and the caches
AT = {2: STYLES, 4: ["complex_sub", "lazy_caches"]}


@pytest.fixture(scope="module")
def runs() -> Launches:
    return Launches({world: {"written": (written_state_parity, AT[world])} for world in (2, 4)},
                    extended={4: {"rest": (written_state_parity, [s for s in STYLES if s not in AT[4]])}})


@pytest.mark.slow
@pytest.mark.parametrize("world,part", [(2, "written"), (4, "written"),
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
