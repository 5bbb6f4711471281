"""Cross-entropy and NLL over (b, V, s) logits (class dim 1, as torch's N-d losses take them), in the
spellings of tests/loss_layout_models.py: vocab-parallel, with b·s communication as for 2-D logits, exact."""
from __future__ import annotations

import pytest

from autotp.capture.tracer import capture
from autotp.passes import run_passes
from autotp.plan.planner import make_plan
from autotp.operators.vocab_ops import VocabCrossEntropy
from distributed import Launches
from loss_layout_models import KINDS, build
from parity_workers import dense_step_collectives, pattern_parity
from pattern_models import H, S


@pytest.mark.parametrize("kind", KINDS)
def test_loss_over_class_dim_one_is_vocab_parallel(kind: str):
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), plan.replicated
        assert plan.param("head.weight").role == "vocab" and plan.param("emb.weight").role == "vocab"
        (loss,) = plan.vocab.losses
        assert (loss.log_softmax is not None) == kind.startswith("nll")
    sharded = run_passes(capture(*build(kind)[:2], {})[0], make_plan(gm, 2))
    assert sum(n.op == "call_module" and isinstance(sharded.get_submodule(n.target), VocabCrossEntropy)
               for n in sharded.graph.nodes) == 1
    assert not any("log_softmax" in str(n.target) for n in sharded.graph.nodes)  # folded into the loss


@pytest.fixture(scope="module")
def runs() -> Launches:
    return Launches({w: {"losses": (pattern_parity, list(KINDS), 3, False, "loss_layout_models")} for w in (2, 4)})


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_class_dim_one_losses_train_exactly_with_megatron_collectives(runs, world: int):
    bsh, layers = 2 * S * H, 2
    for rank, by_kind in runs(world, "losses").items():
        assert list(by_kind) == list(KINDS)
        for kind, r in by_kind.items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert not r["replicated"] and r["unexplained"] == [], (kind, r["replicated"], r["unexplained"])
            assert r["fraction"] <= 1 / world + 0.12, (kind, r["fraction"])
            # forward: the embedding and 2 per layer (b·s·h); the loss's max and two sums of b·s, never b·s·V
            forward, backward = dense_step_collectives(bsh, 2 * S, layers)
            assert sorted(r["forward"]) == forward, (kind, r["forward"])
            assert sorted(r["backward"]) == backward, (kind, r["backward"])
