"""A Python check on the real value of the model's own state (tests/support/value_check_models.py: a rotary
table's first entry compared with zero, the same with ``.item()``, a flag buffer, a plain tensor attribute's
``.sum() > 0``) is answered from the real model at capture, guarded at call time, and a call whose state
answers otherwise is captured again: at tp 2 (and 4) training, sampling and every ``__dict__`` entry equal the
unsharded model's."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autotp.capture.tracer import capture_blocks
from autotp.capture.values import CHECKS_KEY, checks_hold
from autotp.errors import CaptureError
from ranks import Launches
from value_check_models import STYLES, build
from value_check_workers import forward_parity
from tiers import core_first


@pytest.mark.parametrize("style,asked", core_first([("zero_check", True), ("item_check", 0.0), ("flag", False),
                                                     ("step_sum", False)], [("item_check", 0.0)]))
def test_each_check_is_answered_from_the_real_model_and_guards_the_graph(style: str, asked: object):
    model, (x, y) = build(style)
    cg = capture_blocks(model, (x, y), {}, writes=True)
    checks = cg.gm.meta[CHECKS_KEY]
    assert [c.value for c in checks] == [asked] * len(checks) and checks, [c.expr.describe() for c in checks]
    assert cg.copies is None  # each block's check is its own: no block is copied from another's graph
    assert checks_hold(model, checks)  # capture left the state as it was
    model(x, y)  # one device's first call fills the tables, sets the flag: the graph's answers no longer hold
    assert not checks_hold(model, checks)
    again = capture_blocks(model, (x, y), {}, writes=True).gm
    assert checks_hold(model, again.meta[CHECKS_KEY])
    got, want = again(x, y), model(x, y)
    assert torch.allclose(got[0], want[0], atol=1e-6)


def test_a_check_on_a_parameter_or_on_state_changed_before_it_is_not_answered():
    class OnWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):  # a rank holds a shard of the weight at call time: never answered
            return self.lin(x) * 2 if self.lin.weight.sum() > 0 else self.lin(x)

    class Changed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("seen", torch.zeros(1))

        def forward(self, x):
            self.seen.add_(x.sum())  # from the input: the model's value is not what the check reads
            return self.lin(x) * 2 if self.seen.sum() > 0 else self.lin(x)

    for model in (OnWeight(), Changed()):
        with pytest.raises(CaptureError, match="data-dependent"):
            capture_blocks(model, (torch.randn(2, 4),), {}, writes=True)


@pytest.fixture(scope="module")
def runs() -> Launches:
    return Launches({2: {"checks": (forward_parity, "value_check_models", STYLES)}},
                    extended={4: {"checks": (forward_parity, "value_check_models", STYLES)}})


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_checks_on_state_values_train_and_sample_as_on_one_device(runs, world: int):
    for rank, by_style in runs(world, "checks").items():
        for style, r in by_style.items():
            assert r["state"] == [], (rank, style, r["state"][:5])
            assert max(r["logits"], r["loss"], r["grad"], r["param"]) <= 1e-5, (rank, style, r)
            assert r["tokens"] and not r["grad_missing"], (rank, style, r)
            assert r["fraction"] <= 1 / world + 0.12, (style, r["fraction"])
            # the state before the first call, then after it (training and sampling signatures)
            assert r["graphs"] <= 4, (style, r["graphs"])
