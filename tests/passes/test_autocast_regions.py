"""Regions the model runs under ``torch.autocast`` (tests/support/autocast_models.py): looked into by analysis (the
capture inlines export's ``wrap_with_autocast`` bodies), sharded like the same ops outside, and run again
under the same autocast, so an outer bf16 autocast still meets the model's fp32 regions; exact in fp32."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from autotp.capture.structure import flatten, unflatten
from autotp.capture.tracer import capture
from autotp.passes.split_units import split_units
from autotp.operators.pieces import PieceCall, bind_pieces
from autotp.passes import outline_autocast, run_passes
from autotp.plan.planner import make_plan
from autotp.operators.autocast import Autocast, AutocastRegion, region_of
from autocast_models import KINDS, WIDTH_NORM, build
from spelling_runs import SpellingRuns
from shared_graphs import SHARED, spelling
from parity_workers import dense_step_collectives
from pattern_models import H, S


def _copy(gm):
    """A copy of a captured graph, for a second use of the same capture (a capture costs more)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own copy of the graph's pytree specs
        return copy.deepcopy(gm)


def _hops(gm) -> list:
    return [n for n in gm.graph.nodes if "wrap_with_autocast" in str(n.target)]


@SHARED
@pytest.mark.parametrize("kind", KINDS)
def test_autocast_bodies_are_analysed_and_sharded(kind: str):
    gm = spelling("autocast_models", kind)[3]
    fresh = _copy(gm)  # the capture as it was, for the passes (a graph planned stays unrewritten)
    assert _hops(gm) == []  # inlined
    tagged = [region_of(n) for n in gm.graph.nodes if region_of(n) is not None]
    assert tagged and all(isinstance(r, AutocastRegion) and not r.enabled for r in tagged)
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), plan.replicated
        assert all(plan.param(f"blocks.{i}.attn.{p}.weight").role in ("column", "row")
                   for i in range(2) for p in "qkvo")
    sharded = run_passes(fresh, make_plan(gm, 2))
    assert outline_autocast(sharded) >= 1
    regions = [sharded.get_submodule(n.target) for n in sharded.graph.nodes
               if n.op == "call_module" and isinstance(sharded.get_submodule(n.target), Autocast)]
    assert regions and all(r.settings.enabled is False for r in regions)


@pytest.mark.parametrize("kind", KINDS)
def test_the_regions_run_under_their_autocast_again(kind: str):
    """Captured under an outer bf16 autocast (as parallelize captures a call made under one), inlined and
    outlined again (no sharding): the graph computes what the model computes, to the bit. Without the regions
    the fp32 matmul of the rotary tables would run in bf16."""
    model, args, _ = build(kind)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gm = capture(model, args, {})[0]
    plain = _copy(gm)  # the same capture, its regions left inlined
    assert outline_autocast(gm) >= 1
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, got, without = model(*args)[0], gm(*args)[0], plain(*args)[0]
    assert want.dtype == got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    if kind == "rope_matmul_with":
        assert not torch.equal(without, want)


def test_the_regions_of_fsdp_units_run_under_their_autocast_again():
    """Split into FSDP units' pieces (as parallelize splits for fully_shard), each piece outlines its own
    regions: under an outer bf16 autocast the pieces compute what the model computes, to the bit."""
    model, args, _ = build("rope_matmul_with")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gm, spec = capture(model, args, {})
    plan = make_plan(gm, 1)
    top = run_passes(run_passes(gm, plan), plan, (split_units,))
    pieces = [m for m in top.modules() if isinstance(m, PieceCall)]
    blocks = [p for p in pieces if (p.unit or "").startswith("blocks.")]
    assert [p.unit for p in blocks] == ["blocks.0", "blocks.1"]
    assert outline_autocast(top) == 2  # the rotary tables' region of each block, inside its piece
    assert all(any(isinstance(m, Autocast) for m in p.piece.modules()) for p in blocks)
    bind_pieces(top, model)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = unflatten(top(*flatten((args, {}))[0]), spec)[0]
        want = model(*args)[0]
    assert torch.equal(got, want)


RUNS = SpellingRuns("autocast", "autocast_models", KINDS, ["qk_norm_decorated", "rope_matmul_with"])


@pytest.mark.slow
@pytest.mark.parametrize("world,part", RUNS.params)
def test_autocast_regions_train_exactly_with_megatron_collectives(world: int, part: str):
    bsh, layers = 2 * S * H, 2
    for rank, by_kind in RUNS(world, part).items():
        assert list(by_kind) == RUNS.kinds(part)
        for kind, r in by_kind.items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert not r["replicated"] and r["unexplained"] == [] and r["whole"] == {}, (kind, r)
            assert r["fraction"] <= 1 / world + 0.12, (kind, r["fraction"])
            forward, backward = dense_step_collectives(bsh, 2 * S, layers)
            stats = [("all_reduce", "sum", 2 * S)] * 2 * layers if kind in WIDTH_NORM else []
            assert sorted(r["forward"]) == sorted(forward + stats), (kind, r["forward"])
            assert sorted(r["backward"]) == sorted(backward + stats), (kind, r["backward"])
