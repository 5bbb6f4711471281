"""Attention spellings of encoder-style and unusual Hugging Face families, and hand-written spellings of the same
patterns (tests/support/attention_family_models.py): each is cut by heads at tp 2 and 4 (structural tests, no
processes; one capture of a few seconds each: two spellings and one refusal by default, the rest and the
Hugging Face families in the extended run) and trains exactly with Megatron's collectives
(gloo ranks at 2 and 4, extended run); where no exact cut exists the plan names the block and the reason."""
from __future__ import annotations

import pytest

from attention_family_models import HF_KINDS, KINDS, build
from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from parity_checks import assert_exact, assert_fully_sharded, assert_megatron_step
from parity_workers import pattern_parity
from pattern_models import HD, H, S
from ranks import Launches
from shared_graphs import spelling
from tiers import core_first

BY_DESIGN = ("position embedding", "head transform kept whole")  # what Megatron keeps whole too
# spellings whose plan must leave the attention replicated, with the reason
SEEN = {"fill_inplace_stale": "writes into its input", "head_scale_stray": "is also read where it is not cut alike"}
# Hugging Face families that keep a block whole, with the blocks (none: Dory's per-vocab-entry logit scale is cut
# along the vocab with its LM head's rows)
HF_WHOLE: dict[str, list[str]] = {}
RUN_KINDS = [*KINDS, *SEEN, *HF_KINDS]
RUNS = Launches({}, extended={w: {"families": (pattern_parity, RUN_KINDS, 3, False, "attention_family_models")}
                              for w in (2, 4)})


def _plan(kind: str, tp: int):
    """The spelling's plan at ``tp``, of its one capture (tests/support/shared_graphs.py)."""
    return make_plan(spelling("attention_family_models", kind)[3], tp)


@pytest.mark.parametrize("kind", core_first(KINDS, ["fill_inplace", "head_scale_looped"]))
def test_each_spelling_is_cut_by_heads(kind: str):
    for tp in (2, 4):
        plan = _plan(kind, tp)
        assert plan.replicated == (), (tp, plan.replicated)
        assert all(w.reason.startswith("position embedding") for w in plan.whole), (tp, plan.whole)
        params = dict(plan.params)
        for i in range(2):
            q, o = params[f"blocks.{i}.attn.q.weight"], params[f"blocks.{i}.attn.o.weight"]
            assert (q.role, q.local_shape) == ("column", (H // tp, H)), (tp, q)
            assert (o.role, o.local_shape) == ("row", (H, H // tp)), (tp, o)
            if kind == "head_scale_flat":  # the flat per-head scales cut with the heads they meet
                for name in ("sqk", "s_gate"):
                    w = params[f"blocks.{i}.attn.{name}"]
                    assert (w.dim, w.local_shape) == (0, (H // tp,)), (tp, name, w)


@pytest.mark.parametrize("kind", core_first(SEEN, ["head_scale_stray"]))
def test_a_write_another_node_sees_or_a_stray_read_leaves_the_attention_replicated_with_the_reason(kind: str):
    """The scores written in place after a view of them was taken, that view read after the write: the in-place
    op is not its functional form there. A flat per-head scale also read whole outside the region: cut, that
    read would see a shard. Either way the attention stays whole, named with the reason."""
    plan = _plan(kind, 2)
    assert [m for m, _ in plan.replicated] == ["blocks.0.attn", "blocks.1.attn"], plan.replicated
    assert all(SEEN[kind] in why for _, why in plan.replicated), plan.replicated


@pytest.mark.extended
@pytest.mark.parametrize("kind", HF_KINDS)
def test_the_family_is_planned_fully_sharded(kind: str):
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert [m for m, _ in plan.replicated] == HF_WHOLE.get(kind, []), (tp, plan.replicated)
        assert all(w.reason.startswith(BY_DESIGN) or w.name.startswith(tuple(HF_WHOLE.get(kind, ())))
                   for w in plan.whole), (tp, plan.whole)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_the_families_train_exactly_with_megatron_collectives(world: int):
    """3 AdamW steps at fp32: loss, gradients and parameters within 1e-5 of one device; each hand-written spelling
    communicates as Megatron does (per layer one all-reduce of b·s·h each way for attention and for the MLP, the
    embedding's, the LM head's and the loss's max and two sums of b·s); the Hugging Face families hold at most
    1/tp + 0.12 of the parameters per rank with nothing replicated."""
    results = RUNS(world, "families")
    for rank, by_kind in results.items():
        assert list(by_kind) == RUN_KINDS, (rank, list(by_kind))
        for kind, r in by_kind.items():
            assert_exact(r, (rank, kind))
            if kind in SEEN:
                assert [m for m, _ in r["replicated"]] == ["blocks.0.attn", "blocks.1.attn"], (rank, kind)
                continue
            if kind in HF_WHOLE:
                assert [m for m, _ in r["replicated"]] == HF_WHOLE[kind], (rank, kind, r["replicated"])
                assert r["fraction"] <= 1 / world + 0.3, (rank, kind, r["fraction"])  # the whole head: 128 x 64
                continue
            assert_fully_sharded(r, world, (rank, kind))
            if kind in KINDS:
                # a learned rotary table: per layer its sin and its cos half, (1, 1, s, HD) each, read by every
                # rank's heads, have their gradients summed
                extra = [("all_reduce", "sum", S * HD)] * 4 if kind == "rope_table_learned" else []
                layers = 4 if kind == "head_scale_looped" else 2  # 2 blocks applied twice: 4 of each all-reduce
                assert_megatron_step(r, 2 * S * H, 2 * S, layers, (rank, kind), extra)
