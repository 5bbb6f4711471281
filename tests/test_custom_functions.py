"""The model's own autograd Functions (tests/function_models.py): captured with their forward's ops tagged
(:mod:`autotp.capture.functions`), called again by the sharded graph (:mod:`autotp.runtime.functions`) so
their backward is the model's, never sharded through (the reason names the Function), and exact at tp 2 and 4.
"""
from __future__ import annotations

import pytest
import torch

from autotp.capture.functions import call_of
from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from autotp.runtime.functions import CustomFunction, outline_functions
from distributed import Launches
from function_models import KINDS, RoundSTE, build
from parity_workers import dense_step_collectives, pattern_parity
from pattern_models import H, S


def _grads(module, args) -> dict[str, torch.Tensor]:
    module.zero_grad()
    out = module(*args)
    out[1].backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", KINDS)
def test_the_graph_calls_the_models_function_again_and_keeps_its_backward(kind: str):
    model, args, _ = build(kind)
    apply = torch.autograd.Function.__dict__["apply"]
    gm = capture(model, args, {})[0]
    assert torch.autograd.Function.__dict__["apply"] is apply  # the capture puts torch back as it was
    calls = {call_of(n) for n in gm.graph.nodes} - {None}
    assert len(calls) == 2  # one per layer
    want = _grads(model, args)
    inlined = _grads(gm, args)
    if kind == "ste":  # the traced forward alone differentiates round(): no gradient reaches the attention
        assert torch.count_nonzero(inlined["blocks.0.attn.qkv.weight"]) == 0
        assert torch.count_nonzero(want["blocks.0.attn.qkv.weight"]) > 0
    assert outline_functions(gm) == 2
    assert sum(isinstance(m, CustomFunction) for m in gm.modules()) == 2
    got = _grads(gm, args)
    assert want.keys() == got.keys()
    for name, g in want.items():
        assert torch.equal(got[name], g), name


def test_a_function_in_a_region_leaves_it_whole_with_its_name():
    model, args, _ = build("ste")
    gm = capture(model, args, {})[0]
    for tp in (2, 4):
        reasons = dict(make_plan(gm, tp).replicated)
        assert set(reasons) == {"blocks.0.attn", "blocks.1.attn"}, reasons
        assert all(f"custom autograd Function {RoundSTE.__module__}.RoundSTE" in r for r in reasons.values())


@pytest.fixture(scope="module")
def runs() -> Launches:
    return Launches({w: {"functions": (pattern_parity, list(KINDS), 3, False, "function_models")} for w in (2, 4)})


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_models_with_their_own_functions_train_exactly(runs, world: int):
    bsh, layers = 2 * S * H, 2
    for rank, by_kind in runs(world, "functions").items():
        assert list(by_kind) == list(KINDS)
        for kind, r in by_kind.items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert r["unexplained"] == [], (kind, r)
            if kind == "outside":  # the Function is outside every region: Megatron's collectives, all sharded
                forward, backward = dense_step_collectives(bsh, 2 * S, layers)
                assert not r["replicated"] and sorted(r["forward"]) == forward, (kind, r)
                assert sorted(r["backward"]) == backward, (kind, r["backward"])
            else:  # the attention the Function sits in is whole; the MLPs are sharded
                assert [m for m, _ in r["replicated"]] == ["blocks.0.attn", "blocks.1.attn"], (kind, r)
