"""Attention written with einsum (tests/support/einsum_models.py): captured as the batched matmuls it is
(:mod:`autotp.capture.einsum`), sharded by heads with Megatron's collectives, exact at tp 2 and 4."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from spelling_runs import SpellingRuns
from shared_graphs import SHARED, spelling
from einsum_models import KINDS
from parity_checks import assert_megatron_step, assert_patterns_train_exactly
from pattern_models import HD, H, S

aten = torch.ops.aten


@SHARED
@pytest.mark.parametrize("kind", KINDS)
def test_einsum_attention_is_captured_as_matmuls_and_planned_by_heads(kind: str):
    model, args, _, gm = spelling("einsum_models", kind)
    targets = [n.target for n in gm.graph.nodes]
    assert aten.einsum.default not in targets and targets.count(aten.matmul.default) == 4  # 2 per layer
    with torch.no_grad():
        assert torch.equal(gm(*args)[0], model(*args)[0])
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and not plan.whole, (plan.replicated, plan.whole)
        for i in range(2):
            assert plan.param(f"blocks.{i}.attn.to_q.weight").role == "column"
            assert plan.param(f"blocks.{i}.attn.to_out.weight").role == "row"


RUNS = SpellingRuns("einsum", "einsum_models", KINDS, ["heads_after_seq", "mqa"])


@pytest.mark.slow
@pytest.mark.parametrize("world,part", RUNS.params)
def test_einsum_attention_trains_exactly_with_megatron_collectives(world: int, part: str):
    layers = 2
    results = RUNS(world, part)
    # multi-query: the k and v head every rank holds have their weight gradients summed over the group
    assert_patterns_train_exactly(results, RUNS.kinds(part), world, bsh=2 * S * H, tokens=2 * S, layers=layers,
                                  extra_backward=lambda kind: [("all_reduce", "sum", HD * H)] * 2 * layers
                                  if kind == "mqa" else [], sharded=lambda kind: kind != "mqa")
    for rank, by_kind in results.items():  # mqa: its k and v heads are whole on every rank, so not 1/tp
        if "mqa" not in by_kind:
            continue
        r, where = by_kind["mqa"], (rank, "mqa")
        assert not r["replicated"] and r["unexplained"] == [], (*where, r)
        assert_megatron_step(r, 2 * S * H, 2 * S, layers, where, [("all_reduce", "sum", HD * H)] * 2 * layers)


class _One(nn.Module):
    def __init__(self, eq: str):
        super().__init__()
        self.eq = eq

    def forward(self, a, b):
        return torch.einsum(self.eq, a, b)


@pytest.mark.parametrize("eq, shapes, rewritten", [
    ("bhid,bhjd->bhij", [(2, 3, 4, 5), (2, 3, 6, 5)], True),
    ("b h i j, b h j d -> b h i d", [(2, 3, 4, 6), (2, 3, 6, 5)], True),
    ("...id,...jd->...ij", [(2, 3, 4, 5), (2, 3, 6, 5)], True),
    ("...id,...jd->...ij", [(3, 4, 5), (2, 3, 6, 5)], True),  # ellipses of different ranks broadcast
    ("bihd,bjhd->bhij", [(2, 4, 3, 5), (2, 6, 3, 5)], True),
    ("bhij,bjhd->bihd", [(2, 3, 4, 6), (2, 6, 3, 5)], True),
    ("bhid,bjd->bhij", [(2, 3, 4, 5), (2, 6, 5)], True),  # one operand without the head dim
    ("bid,bjd->bji", [(2, 4, 5), (2, 6, 5)], True),  # output in another order
    ("ij,ij->i", [(4, 5), (4, 5)], False),  # no free letter in the second operand
    ("bij,bjk->b", [(2, 3, 4), (2, 4, 5)], False),  # letters summed that are not contracted
    ("bhid,bhjd->bhi", [(2, 3, 4, 5), (2, 3, 6, 5)], False),
])
def test_einsums_between_activations_become_matmuls(eq: str, shapes: list, rewritten: bool):
    torch.manual_seed(0)
    a, b = (torch.randn(*s) for s in shapes)
    gm = capture(_One(eq), (a, b), {})[0]
    assert (aten.einsum.default not in [n.target for n in gm.graph.nodes]) == rewritten
    torch.testing.assert_close(gm(a, b)[0] if isinstance(gm(a, b), (tuple, list)) else gm(a, b),
                               torch.einsum(eq, a, b), rtol=1e-6, atol=1e-6)
