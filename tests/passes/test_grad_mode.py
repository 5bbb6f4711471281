"""The model's own no-grad regions (tests/support/grad_mode_models.py: ``torch.no_grad()`` around recurrent
steps, ``@torch.no_grad()`` on a method, ``set_grad_enabled(False)``, ``enable_grad`` nested in one): the
sharded model trains exactly as the unsharded one, no gradient reaching a weight the model computes without
one; each block run has its two forward all-reduces, and only those run with gradients their two backward.
A block under ``torch.enable_grad()`` nested in a no-grad region is still left whole (export keeps it in a
``wrap_with_set_grad_enabled`` region), with that reason."""
from __future__ import annotations

import pytest
import torch

from grad_mode_models import APPLIED, KINDS
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import dense_step_collectives
from pattern_models import H, S
from spelling_runs import SpellingRuns
from shared_graphs import SHARED, spelling

aten = torch.ops.aten
RUNS = SpellingRuns("grad_mode", "grad_mode_models", KINDS, ["truncated"])


@SHARED
@pytest.mark.parametrize("kind", KINDS)
def test_each_region_ends_in_a_detach_where_its_value_leaves_it(kind: str):
    gm = spelling("grad_mode_models", kind)[3]
    detaches = [n for n in gm.graph.nodes if n.target is aten.detach.default]
    assert len(detaches) == {"truncated": 1, "decorated": 1, "set_grad": 1, "enable_inside": 1}[kind], detaches


@SHARED
def test_torchs_own_no_grad_inside_the_trace_is_not_the_models():
    """A block whose forward has no region of its own captures without a detach: torch's no-grad blocks inside
    export and autotp's own are not tagged."""
    gm = spelling("pattern_models", "plain")[3]
    assert not [n for n in gm.graph.nodes if n.target is aten.detach.default]


@pytest.mark.slow
@pytest.mark.parametrize("world,part", RUNS.params)
def test_no_grad_regions_train_exactly(world: int, part: str):
    results = RUNS(world, part)
    for rank, by_kind in results.items():
        assert list(by_kind) == RUNS.kinds(part)
        for kind, r in by_kind.items():
            where = (rank, kind)
            assert_exact(r, where)
            if kind == "enable_inside":  # the block under enable_grad: whole, with the reason (a gap)
                assert sorted(r["whole"]) == [f"blocks.1.{w}.weight" for w in
                                              ("attn.k", "attn.o", "attn.q", "attn.v", "mlp.down", "mlp.gate", "mlp.up")]
                assert all("wrap_with_set_grad_enabled" in why for why in r["whole"].values()), r["whole"]
            else:
                assert_fully_sharded(r, world, where)
            runs, with_grad = APPLIED[kind]
            assert sorted(r["forward"]) == dense_step_collectives(2 * S * H, 2 * S, runs)[0], (where, r["forward"])
            assert sorted(r["backward"]) == dense_step_collectives(2 * S * H, 2 * S, with_grad)[1], \
                (where, r["backward"])
