"""LM heads tied to the token embedding by a matmul with its weight (``x @ emb.weight.t()``, ``.T``, einsum,
``F.linear``, ``matmul`` of its transpose; tests/support/tied_head_models.py): vocab-parallel, tied by identity (one
shard serves both uses), reported as the LM head, exact with Megatron's collectives."""
from __future__ import annotations

import pytest
import torch

from autotp.plan.planner import make_plan
from spelling_runs import SpellingRuns
from shared_graphs import SHARED, spelling
from parity_checks import assert_patterns_train_exactly
from pattern_models import H, S
from tied_head_models import KINDS, V


@SHARED
@pytest.mark.parametrize("kind", KINDS)
def test_matmul_tied_head_is_vocab_parallel(kind: str):
    model, args, _, gm = spelling("tied_head_models", kind)
    assert torch.equal(gm(*args)[1], model(*args)[1])  # an einsum read as the matmul it is: the same values
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), plan.replicated
        w = plan.param("tok_emb.weight")
        assert w.role == "vocab" and w.local_shape == (V // tp, H)
        assert len(plan.vocab.heads) == 1 and len(plan.vocab.embeddings) == 1 and len(plan.vocab.losses) == 1


RUNS = SpellingRuns("tied", "tied_head_models", KINDS, ["T_property", "einsum"])


@pytest.mark.slow
@pytest.mark.parametrize("world,part", RUNS.params)
def test_matmul_tied_heads_train_exactly_with_megatron_collectives(world: int, part: str):
    assert_patterns_train_exactly(RUNS(world, part), RUNS.kinds(part), world, bsh=2 * S * H, tokens=2 * S)
