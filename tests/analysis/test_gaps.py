"""Weights that used to stay whole, silently or not: weights cast on their way to the matmul (mixed-precision
``Linear`` subclasses: ``F.linear(x, W.to(x.dtype))``, ``x @ W.type_as(x).mT``), value residuals (a value
embedding of the token ids added to v, gated per head by the input), and the completeness check that lists
every weight left whole with its reason."""
from __future__ import annotations

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from spelling_runs import SpellingRuns
from shared_graphs import SHARED, spelling
from gap_models import CASTS, VALUES, build
from pattern_models import HD, NH, H, S, V

KINDS = [*CASTS, *VALUES]
RUNS = SpellingRuns("gaps", "gap_models", KINDS, ["cast_bias", "value_lambda"])


def _megatron(kind: str, layers: int = 2) -> tuple[list, list]:
    """Megatron's collectives of one step (b = 2): forward the embedding's and 2 per layer all-reduces of b·s·h
    and the loss's max and 2 sums of b·s; backward one all-reduce of b·s·h entering attention and the MLP
    per layer and the LM head (a value gate's input, a slice of attention's, enters with it), and a value
    mix's two learned scalars (each rank's gradient covers its heads) one element each per layer."""
    bsh, bs = 2 * S * H, 2 * S
    forward = [("all_reduce", "sum", bsh)] * (2 * layers + 1) + [("all_reduce", "max", bs)] + \
        [("all_reduce", "sum", bs)] * 2
    backward = [("all_reduce", "sum", bsh)] * (2 * layers + 1)
    if kind == "value_lambda":
        backward += [("all_reduce", "sum", 1)] * 2 * layers
    return sorted(forward), sorted(backward)


@pytest.mark.slow
@pytest.mark.parametrize("world,part", RUNS.params)
def test_cast_weights_and_value_residuals_shard_exactly(world: int, part: str):
    results = RUNS(world, part)
    for rank, by_kind in results.items():
        assert list(by_kind) == RUNS.kinds(part)
        for kind, r in by_kind.items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert not r["replicated"], (kind, r["replicated"])
            assert r["quarter"] == [] and r["whole"] == {} and r["unexplained"] == [], (kind, r)
            forward, backward = _megatron(kind)
            assert sorted(r["forward"]) == forward, (kind, r["forward"])
            assert sorted(r["backward"]) == backward, (kind, r["backward"])


@SHARED
@pytest.mark.parametrize("kind", KINDS)
def test_every_weight_is_cut_or_listed_with_its_reason(kind: str):
    """The plan's completeness check: a cast between W and its matmul no longer hides the linear, and a value
    embedding is cut by its feature columns like v (no all-reduce of its output), not by vocab rows."""
    model, _, _, gm = spelling("gap_models", kind)
    plan = make_plan(gm, 2)
    params = dict(plan.params)
    assert plan.whole == () and plan.replicated == ()
    weights = [n for n, p in model.named_parameters() if p.dim() == 2]
    assert all(n in params for n in weights), [n for n in weights if n not in params]
    if kind in VALUES:
        ve = params["value_embeds.0.weight"]
        assert (ve.role, ve.dim, ve.local_shape) == ("column", 1, (V, H // 2))
        # none for the value embeddings or the gate; the mix's two learned scalars enter through f (2 per layer)
        assert len(plan.collectives) == 2 * 4 + 2 + 3 + (4 if kind == "value_lambda" else 0)
    if kind == "value_gate":
        gate = params["blocks.0.attn.gate.weight"]
        assert (gate.dim, gate.local_shape) == (0, (NH // 2, 12))
        assert plan.pairs[0].enter_via and len(plan.pairs[0].enter) == 1


def test_a_weight_left_whole_is_listed_with_the_reason():
    """A weight read by an op no rule reads as a weight is not silently kept: the plan lists it, and why."""
    import torch
    import torch.nn as nn

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, H)
            self.pos = nn.Embedding(S, H)
            self.mix = nn.Parameter(torch.randn(H, H))
            self.head = nn.Linear(H, V, bias=False)

        def forward(self, idx, targets):
            x = self.emb(idx) + self.pos(torch.arange(idx.shape[1]))
            x = torch.einsum("bsh,hk->bsk", x, torch.tanh(self.mix))  # the weight goes through tanh first
            logits = self.head(x)
            return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    model, (idx, targets) = Odd(), build("cast")[1]
    gm, _ = capture(model, (idx, targets), {})
    plan = make_plan(gm, 2)
    whole = {w.name: w.reason for w in plan.whole}
    assert set(whole) == {"pos.weight", "mix"}, whole
    assert "position embedding" in whole["pos.weight"]
    assert "tanh" in whole["mix"], whole["mix"]
    assert HD  # the pattern models' sizes are shared
