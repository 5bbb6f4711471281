"""Attention written with einsum (tests/einsum_models.py): captured as the batched matmuls it is
(:mod:`autotp.capture.einsum`), sharded by heads with Megatron's collectives, exact at tp 2 and 4."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from distributed import Launches
from einsum_models import KINDS, build
from parity_workers import dense_step_collectives, pattern_parity
from pattern_models import HD, H, S

aten = torch.ops.aten


@pytest.mark.parametrize("kind", KINDS)
def test_einsum_attention_is_captured_as_matmuls_and_planned_by_heads(kind: str):
    model, args, _ = build(kind)
    gm = capture(model, args, {})[0]
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


@pytest.fixture(scope="module")
def runs() -> Launches:
    return Launches({w: {"einsum": (pattern_parity, list(KINDS), 3, False, "einsum_models")} for w in (2, 4)})


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_einsum_attention_trains_exactly_with_megatron_collectives(runs, world: int):
    bsh, layers = 2 * S * H, 2
    for rank, by_kind in runs(world, "einsum").items():
        assert list(by_kind) == list(KINDS)
        for kind, r in by_kind.items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert not r["replicated"] and r["unexplained"] == [], (kind, r)
            forward, backward = dense_step_collectives(bsh, 2 * S, layers)
            assert sorted(r["forward"]) == forward, (kind, r["forward"])
            # multi-query: the k and v head every rank holds have their weight gradients summed over the group
            kv = [("all_reduce", "sum", HD * H)] * 2 * layers if kind == "mqa" else []
            assert sorted(r["backward"]) == sorted(backward + kv), (kind, r["backward"])
            if kind != "mqa":
                assert r["fraction"] <= 1 / world + 0.12, (kind, r["fraction"])


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
