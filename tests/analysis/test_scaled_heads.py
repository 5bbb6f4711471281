"""LM heads whose logits are multiplied by a learned scale per vocabulary entry (tests/support/scaled_head_models.py,
Dory's head spelled by hand): the scale is cut along the vocab with the head's rows (each rank's slice meets its own
logits: no communication of its own), at tp 2 and 4, also with a vocabulary padded to tp. A scale also read whole
elsewhere, or one learned temperature shared by every entry, keeps the head whole, named with the reason. One
spelling is planned in the default tier (one capture); the others, and 3 AdamW steps on gloo ranks at world 2 and 4
(exact within 1e-5, Megatron's all-reduces), in the extended run."""
from __future__ import annotations

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from parity_checks import assert_patterns_train_exactly
from parity_workers import pattern_parity
from pattern_models import H, S
from ranks import Launches
from scaled_head_models import KINDS, REFUSED, build

RUN_KINDS = [*KINDS, *REFUSED]
RUNS = Launches({}, extended={w: {"heads": (pattern_parity, RUN_KINDS, 3, False, "scaled_head_models")}
                              for w in (2, 4)})


def _plans(kind: str, blocks: int = 2):
    model, args, kwargs = build(kind, blocks)
    gm = capture(model, args, kwargs)[0]
    return model.vocab, {tp: make_plan(gm, tp) for tp in (2, 4)}


def _assert_cut_with_the_head(kind: str, vocab: int, plans) -> None:
    head = "tok_emb.weight" if kind == "scale_viewed_tied" else "head.weight"
    for tp, plan in plans.items():
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        local = -(-vocab // tp)  # rows per rank, the last rank's padded
        w, scale = plan.param(head), plan.param("scale")
        assert (w.role, w.local_shape) == ("vocab", (local, H)), (tp, w)
        assert (scale.role, scale.dim, scale.local_shape, scale.vocab) == ("vocab", 0, (local,), w.vocab), (tp, scale)


@pytest.fixture(scope="module")
def elementwise():
    return _plans("scale_elementwise", blocks=0)  # the head alone: what is asked of the plan is the head's


def test_dorys_spelling_cuts_the_scale_with_the_heads_rows(elementwise):
    """``head(x).float() * (scale.float() * c)`` over 98 classes: the scale (98,) cut as the head's 98 rows, 49 per
    rank at tp 2, 25 at tp 4 (the last rank's 2 rows padding, as the head's)."""
    _assert_cut_with_the_head("scale_elementwise", *elementwise)


@pytest.mark.extended
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "scale_elementwise"])
def test_each_spelling_cuts_the_scale_with_the_heads_rows(kind: str):
    _assert_cut_with_the_head(kind, *_plans(kind))


@pytest.mark.extended
@pytest.mark.parametrize("kind", list(REFUSED))
def test_a_scale_read_elsewhere_or_a_shared_temperature_keeps_the_head_whole_with_the_reason(kind: str):
    _, plans = _plans(kind)
    for tp, plan in plans.items():
        assert [m for m, _ in plan.replicated] == ["head"], (tp, plan.replicated)
        assert plan.replicated[0][1].startswith("LM head kept whole") and REFUSED[kind] in plan.replicated[0][1], \
            (tp, plan.replicated)
        assert plan.param("head.weight") is None and plan.param("tok_emb.weight").role == "vocab", tp


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_scaled_heads_train_exactly_with_megatron_collectives(world: int):
    """3 AdamW steps at fp32: loss, gradients and parameters within 1e-5 of one device; the cut spellings hold at
    most 1/tp + 0.12 of the parameters per rank with Megatron's all-reduces (the scale adds none); the refused
    ones are exact with the head whole."""
    results = RUNS(world, "heads")
    assert_patterns_train_exactly(results, RUN_KINDS, world, bsh=2 * S * H, tokens=2 * S,
                                  sharded=lambda kind: kind in KINDS)
    for rank, by_kind in results.items():
        for kind in REFUSED:
            assert [m for m, _ in by_kind[kind]["replicated"]] == ["head"], (rank, kind)
