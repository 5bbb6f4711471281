"""Hugging Face families that capture once their tiny configs are consistent and their call complete
(tests/support/captured_family_models.py): Kimi-Linear (its delta attention's q, k and v joined for one
convolution) and a hand-written spelling of that join, LongCat-Flash and X-MOD. Each is planned with nothing
replicated and every weight left whole whole by design (the hand-written block's plan in the default tier, the
LMs' in the extended run), and trains exactly at tp 2 and 4 (gloo ranks, 3 AdamW steps; extended run)."""
from __future__ import annotations

import pytest
import torch

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from captured_family_models import KINDS, S, H, JoinedConv, build
from parity_checks import assert_exact, assert_fully_sharded, assert_megatron_step
from parity_workers import pattern_parity
from ranks import Launches

RUNS = Launches({}, extended={w: {"families": (pattern_parity, list(KINDS), 3, False, "captured_family_models")}
                              for w in (2, 4)})
# what Megatron keeps whole too: routers, latent down-projections, position tables, an LM head's transform
BY_DESIGN = ("router kept whole", "down-projection kept whole", "position embedding", "head transform kept whole")


def test_q_k_v_joined_for_one_convolution_are_its_segments():
    """One block alone (a capture of about a second): q, k and v, each cut by heads, joined on the features
    are the three segments of a fused projection; the depthwise filters are cut per segment, ``chunk(3)``
    reads each rank's q, k and v back, and the block communicates as an attention block does."""
    torch.manual_seed(0)
    gm = capture(JoinedConv(), (torch.randn(2, S, H),), {})[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        cut = {n: (s.role, s.local_shape, [(g.size, g.parts) for g in s.segments]) for n, s in plan.params}
        assert cut == {**{f"{p}.weight": ("column", (H // tp, H), [(H, tp)]) for p in "qkv"},
                       "o.weight": ("row", (H, H // tp), [(H, tp)]),
                       "conv": ("column", (3 * H // tp, 1, 4), [(H, tp)] * 3)}, (tp, cut)
        assert sorted((c.op, c.direction) for c in plan.collectives) == [("sum", "backward"), ("sum", "forward")]


@pytest.mark.extended
@pytest.mark.parametrize("kind", KINDS)
def test_the_family_is_planned_fully_sharded(kind: str):
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), (tp, plan.replicated)
        assert all(w.reason.startswith(BY_DESIGN) for w in plan.whole), (tp, plan.whole)
        if kind == "kimi_linear":  # q | k | v joined: the depthwise filters cut per segment, as the projections
            conv = dict(plan.params)["model.layers.0.self_attn.conv1d.weight"]
            assert [(g.size, g.parts) for g in conv.segments] == [(64, tp)] * 3, (tp, conv)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_the_families_train_exactly(world: int):
    """3 AdamW steps at fp32: loss, gradients and parameters within 1e-5 of one device, nothing replicated,
    at most 1/tp + 0.12 of the parameters per rank; the hand-written LM with Megatron's all-reduces."""
    for rank, by_kind in RUNS(world, "families").items():
        assert list(by_kind) == list(KINDS), (rank, list(by_kind))
        for kind, r in by_kind.items():
            assert_exact(r, (rank, kind))
            assert_fully_sharded(r, world, (rank, kind))
            if kind == "joined_conv":  # the filters' cut adds nothing: Megatron's all-reduces of a dense LM
                assert_megatron_step(r, 2 * S * H, 2 * S, 2, (rank, kind))
