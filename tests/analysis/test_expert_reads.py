"""Experts stored as 3-D parameters and read whole by a batched matmul (tests/support/expert_read_models.py):
``bmm(x [E, T, H], W [E, H, 2I])`` and its spellings, Llama 4's text experts. Megatron's expert tensor
parallelism: each expert's gate | up cut by columns per segment, its down-projection by rows, the experts'
partial sums (and a shared expert's) added before one all-reduce per MoE layer."""
from __future__ import annotations

import pytest
import torch

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from expert_read_models import E, HF_KINDS, I, KINDS, BatchedExperts, build
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from pattern_models import H, S
from ranks import Launches
from tiers import core_first

# (gate | up weight, down weight, the dim of each that holds the expert features) per spelling
WEIGHTS = {"bmm_chunk": ("blocks.0.moe.w_in", "blocks.0.moe.w_out", 2, 1),
           "matmul_split": ("blocks.0.moe.w_in", "blocks.0.moe.w_out", 2, 1),
           "bmm_transposed": ("blocks.0.moe.w_in", "blocks.0.moe.w_out", 1, 2),
           "llama4_text": ("model.layers.0.feed_forward.experts.gate_up_proj",
                           "model.layers.0.feed_forward.experts.down_proj", 2, 1)}


@pytest.fixture(scope="module", params=core_first(KINDS, []))
def captured(request):
    model, args, kwargs = build(request.param)
    return request.param, capture(model, args, kwargs)[0]


def _check_plan(kind: str, gm, tp: int) -> None:
    plan = make_plan(gm, tp)
    assert plan.replicated == (), (kind, tp, plan.replicated)
    assert all(w.reason.startswith(("router kept whole", "gate kept whole")) for w in plan.whole), plan.whole
    w_in, w_out, in_dim, out_dim = WEIGHTS[kind]
    gate_up, down = plan.param(w_in), plan.param(w_out)
    # every expert on every rank: gate and up each cut 1/tp (per segment), down by the same rows
    assert (gate_up.role, gate_up.dim, [(g.size, g.parts) for g in gate_up.segments]) == \
        ("column", in_dim, [(I, tp), (I, tp)]), (kind, tp, gate_up)
    assert (down.role, down.dim, down.local_shape[0]) == ("row", out_dim, E), (kind, tp, down)
    assert down.local_shape[out_dim] == I // tp, (kind, tp, down)
    # the routed experts' partial sums (and a shared expert's) added first: one all-reduce forward per layer
    moe = w_in.rsplit(".", 2)[0] if kind == "llama4_text" else "blocks.0.moe"
    forward = [c for c in plan.collectives if c.module.startswith(moe) and c.direction == "forward"]
    assert [c.op for c in forward] == ["sum"], (kind, tp, forward)


def test_experts_read_by_a_batched_matmul_are_cut_per_expert(captured):
    kind, gm = captured
    for tp in (2, 4):
        _check_plan(kind, gm, tp)


def test_the_layer_alone_is_cut_per_expert():
    """Llama 4's layer captured alone (the default tier's check; the LMs' plans in the extended run): gate | up
    by columns per segment, down by rows, the shared expert's output added in place joining the one
    all-reduce forward."""
    layer = BatchedExperts("bmm_chunk")
    gm = capture(layer, (torch.randn(2, S, H),), {})[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), plan.replicated
        cut = {n: (sh.role, sh.dim, sh.local_shape) for n, sh in plan.params if n.startswith("w_")}
        assert cut == {"w_in": ("column", 2, (E, H, 2 * I // tp)), "w_out": ("row", 1, (E, I // tp, H))}, cut
        assert [g.size for g in plan.param("w_in").segments] == [I, I]
        assert [c.shape for c in plan.collectives if c.direction == "forward"] == [("s95", "s85", str(H))], \
            plan.collectives


@pytest.mark.extended
@pytest.mark.parametrize("kind", HF_KINDS)
def test_hugging_face_experts_read_by_bmm_are_cut_per_expert(kind: str):
    """Llama 4's text MoE (a capture of ~20 s: extended run)."""
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        _check_plan(kind, gm, tp)


RUNS = Launches({}, extended={w: {"experts": (pattern_parity, [*KINDS, *HF_KINDS], 3, False, "expert_read_models")}
                              for w in (2, 4)})


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_experts_read_by_a_batched_matmul_train_exactly(world: int):
    """3 AdamW steps against the unsharded model: losses, gradients and parameters within 1e-5, nothing
    replicated, each rank holding at most 1/tp + 0.12 of the parameters; Megatron's all-reduces: forward the
    embedding's, one per attention and per MoE layer (b·s·h), the loss's max and two sums (b·s); backward one
    per attention and per MoE layer and the head's (b·s·h: the tokens enter before they are repeated per
    expert, with a shared expert's), and the routing scores' (E·b·s) per MoE layer. Llama 4 at 4 ranks has 2
    kv heads: the k and v weights' gradients are summed over the 2 ranks holding each (4 more)."""
    for rank, by_kind in RUNS(world, "experts").items():
        assert list(by_kind) == [*KINDS, *HF_KINDS], (rank, list(by_kind))
        for kind, r in by_kind.items():
            assert_exact(r, (rank, kind))
            assert_fully_sharded(r, world, (rank, kind))
            bsh, bs = (2 * 8 * 64, 2 * 8) if kind in HF_KINDS else (2 * S * H, 2 * S)
            assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * 5 + [("all_reduce", "max", bs)]
                                                  + [("all_reduce", "sum", bs)] * 2), (rank, kind, r["forward"])
            kv = 4 if kind == "llama4_text" and world == 4 else 0  # k_proj and v_proj at 16 x 64 per rank: 1024
            assert sorted(r["backward"]) == sorted([("all_reduce", "sum", bsh)] * (5 + kv)
                                                   + [("all_reduce", "sum", E * bs)] * 2), (rank, kind, r["backward"])
