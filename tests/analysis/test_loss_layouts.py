"""Cross-entropy and NLL over (b, V, s) logits (class dim 1, as torch's N-d losses take them), in the
spellings of tests/support/loss_layout_models.py: vocab-parallel, with b·s communication as for 2-D logits, exact."""
from __future__ import annotations

import pytest

from autotp.passes import run_passes
from autotp.plan.planner import make_plan
from autotp.operators.vocab_ops import VocabCrossEntropy
from spelling_runs import SpellingRuns
from shared_graphs import SHARED, copy_graph, spelling
from loss_layout_models import KINDS
from parity_checks import assert_patterns_train_exactly
from pattern_models import H, S


@SHARED
@pytest.mark.parametrize("kind", KINDS)
def test_loss_over_class_dim_one_is_vocab_parallel(kind: str):
    gm = spelling("loss_layout_models", kind)[3]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), plan.replicated
        assert plan.param("head.weight").role == "vocab" and plan.param("emb.weight").role == "vocab"
        (loss,) = plan.vocab.losses
        assert (loss.log_softmax is not None) == kind.startswith("nll")
    sharded = run_passes(copy_graph(gm), make_plan(gm, 2))
    assert sum(n.op == "call_module" and isinstance(sharded.get_submodule(n.target), VocabCrossEntropy)
               for n in sharded.graph.nodes) == 1
    assert not any("log_softmax" in str(n.target) for n in sharded.graph.nodes)  # folded into the loss


RUNS = SpellingRuns("losses", "loss_layout_models", KINDS, ["ce_transpose", "nll_dim1"])


@pytest.mark.slow
@pytest.mark.parametrize("world,part", RUNS.params)
def test_class_dim_one_losses_train_exactly_with_megatron_collectives(world: int, part: str):
    # forward: the embedding and 2 per layer (b·s·h); the loss's max and two sums of b·s, never b·s·V
    assert_patterns_train_exactly(RUNS(world, part), RUNS.kinds(part), world, bsh=2 * S * H, tokens=2 * S)
