"""Reasons that are true: a linear left whole is called an LM head only when its output reaches the logits
the loss or the output reads, and a reason names the op, module and source line that stopped the sharding."""
from __future__ import annotations

import re

import torch
import torch.nn as nn

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan


class _Stopped(nn.Module):
    """q → an op no rule shards along the features (cumsum over them, spelled ``dim=-1``: torch's rule is asked
    about the dim it names, not the spelling) → o: the pair cannot be made."""

    def __init__(self):
        super().__init__()
        self.emb, self.q, self.o, self.head = nn.Embedding(32, 16), nn.Linear(16, 16), nn.Linear(16, 16), \
            nn.Linear(16, 32)

    def forward(self, idx):
        x = self.emb(idx)
        a = torch.cumsum(self.q(x), dim=-1)  # the line the reason names
        return self.head(x + self.o(a))


def test_a_projection_left_whole_is_not_called_an_lm_head_and_names_the_line():
    gm = capture(_Stopped(), (torch.randint(0, 32, (2, 4)),), {})[0]
    plan = make_plan(gm, 2)
    reasons = dict(plan.replicated)
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if "the line the reason names" in text)
    assert "LM head" not in reasons["q"], reasons["q"]
    assert reasons["q"].startswith("linear kept whole: its 16→16 linear is outside every column→row pair"), reasons
    for module in ("q", "o"):
        assert re.search(rf"aten\.cumsum\.default needs linear whole, not sharded on dim 2: torch's rule would move data "
                         rf"between ranks \(at cumsum, top level, test_reasons\.py:{line}\)",
                         reasons[module]), reasons[module]
    assert plan.param("head.weight").role == "vocab"  # the real head is still vocab-parallel
