"""LM heads padded past the vocabulary and cropped in the model (``lm_head(x)[..., :V]``, ``narrow``, tied,
with rows past the classes on whole ranks) stay vocab-parallel over all their rows, exactly; what cannot fold
into the padding keeps the head whole with its reason; small gates and routers are reported as what they are,
not as LM heads (tests/support/vocab_gap_models.py)."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from autotp.capture.tracer import capture
from autotp.passes import run_passes
from autotp.plan.plan import Plan
from autotp.plan.planner import make_plan
from autotp.shard_spec import VocabRows, vocab_shard, vocab_unshard
from autotp.operators.vocab_ops import VocabCrossEntropy, VocabOutput
from ranks import launch
from vocab_gap_models import CLASSES, EXPERTS, GATES, H, KINDS, NOT_CROPS, PADDED, ROUTERS, S, build, gap_parity
from shared_graphs import copy_graph
from tiers import core_first

LAYERS = 2


def _calls(gm, kind: type) -> list:
    return [gm.get_submodule(n.target) for n in gm.graph.nodes
            if n.op == "call_module" and isinstance(gm.get_submodule(n.target), kind)]


def test_cropped_layout_treats_the_rows_past_the_classes_as_padding():
    """128 rows cropped to 60 at tp 4: ranks 2 and 3 hold rows but no class; the weight keeps every row."""
    layout = dataclasses.replace(VocabRows.make(PADDED, 4), classes=60)
    rows, classes = layout, layout.logits()
    assert [(rows.start(r), rows.owned(r)) for r in range(4)] == [(0, 32), (32, 32), (64, 32), (96, 32)]
    assert [(classes.start(r), classes.owned(r)) for r in range(4)] == [(0, 32), (32, 28), (60, 0), (60, 0)]
    w = torch.arange(PADDED * 2.0).view(PADDED, 2)
    assert torch.equal(vocab_unshard([vocab_shard(w, 0, rows, r) for r in range(4)], 0, rows), w)
    logits = torch.randn(3, 60)
    local = [vocab_shard(logits, 1, classes, r) for r in range(4)]
    assert [x.shape[1] for x in local] == [32] * 4 and not local[2].any()  # zero columns past the classes
    assert torch.equal(vocab_unshard(local, 1, classes), logits)
    # plans written before the field read back as uncropped
    old = {k: v for k, v in dataclasses.asdict(rows).items() if k != "classes"}
    assert VocabRows(**old).classes is None and VocabRows(**old).logits() == VocabRows(**old)


@pytest.mark.parametrize("kind", core_first(list(CLASSES), ["crop_slice"]))
def test_plan_folds_the_crop_into_the_vocab_padding(kind: str):
    """No process group: the head is vocab-parallel over all 128 rows, the crop's size becomes each rank's
    local width (the identity there), the loss and the returned logits know the classes, and the plan
    round-trips through JSON (an older plan without the field too)."""
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    for tp, multiple in ((2, 1), (4, 1), (4, 64)):
        plan = make_plan(gm, tp, vocab_multiple=multiple)
        local = max(PADDED // tp, multiple)
        assert not plan.replicated, plan.replicated
        head = plan.param("head.weight")
        assert head.role == "vocab" and head.full_shape == (PADDED, H) and head.local_shape == (local, H)
        assert head.vocab.classes == CLASSES[kind] and head.vocab.size == PADDED
        (loss,) = plan.vocab.losses
        assert loss.rows.classes == CLASSES[kind]
        assert [rows.classes for _, _, rows in plan.vocab.outputs] == [CLASSES[kind]]
        crop = [r for r in plan.rewrites if r.old == CLASSES[kind] and r.new == local]
        assert crop and crop[0].arg == 3, plan.rewrites  # slice's end / narrow's length -> the local width
        assert Plan.from_json(plan.to_json()) == plan
        d = json.loads(plan.to_json())
        d["vocab"]["losses"][0]["rows"].pop("classes")
        assert Plan.from_dict(d).vocab.losses[0].rows.classes is None
    sharded = run_passes(copy_graph(gm), make_plan(gm, 2))  # the one capture, copied for the passes
    (ce,) = _calls(sharded, VocabCrossEntropy)
    (out,) = _calls(sharded, VocabOutput)
    assert ce.rows.size == out.size == CLASSES[kind]


@pytest.mark.parametrize("kind", list(NOT_CROPS))
def test_cuts_that_are_not_vocab_padding_keep_the_head_whole(kind: str):
    """A cut that does not start at class 0, a cut of log-probabilities (the rows cut off were normalised
    over), and logits returned uncropped next to a cropped loss: the head stays whole, with the reason."""
    model, args, kwargs = build(kind)
    plan = make_plan(capture(model, args, kwargs)[0], 2)
    assert plan.param("head.weight") is None and not plan.vocab.heads
    (reason,) = [r for m, r in plan.replicated if m == "head"]
    assert reason.startswith("LM head kept whole: ") and re.search(NOT_CROPS[kind], reason), reason


# at tp 4 the crops (two ranks hold no class of crop_past_ranks) and one MoE model (its experts' one all-reduce
# of the router-weighted sum), in the extended run; what a gate or router is called does not depend on tp
WORLDS = {2: (list(KINDS), list(CLASSES)),
          4: ([*CLASSES, "router_softmax_topk"], ["crop_narrow_tied", "crop_past_ranks"])}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_cropped_heads_train_exactly_and_gates_are_named(world: int):
    """3 AdamW steps against the unsharded model; the cropped heads vocab-parallel with exactly the collectives
    of an uncropped one; gates and routers whole, each reported as what it is; the returned logits with V
    classes, read whole and generate-style; checkpoints with all 128 rows."""
    results = launch(gap_parity, world, *WORLDS[world])
    bsh, rows = 2 * S * H, 2 * S
    loss = [("all_reduce", "max", rows), ("all_reduce", "sum", rows), ("all_reduce", "sum", rows)]
    for rank, res in results.items():
        for kind, r in res["parity"].items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert not [x for x in r["replicated"] if "LM head" in x[1]], (kind, r["replicated"])
            # attention, MLP (and the experts of a MoE layer: one all-reduce of their router-weighted sum forward,
            # one of their shared input's gradient backward, and one of the router weights' gradient, b·s·E)
            blocks = LAYERS * (3 if kind in ROUTERS else 2)
            # forward: the embedding's all-reduce and one per block, then the vocab-parallel loss's max and two sums
            assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * (blocks + 1) + loss), kind
            # backward: one entering each block, and the LM head's input
            router = [("all_reduce", "sum", rows * EXPERTS)] * LAYERS if kind in ROUTERS else []
            assert sorted(r["backward"]) == sorted([("all_reduce", "sum", bsh)] * (blocks + 1) + router), \
                (kind, r["backward"])
            if kind in CLASSES:  # every 2-D weight at 1/tp, the padded head's 128 rows included
                assert r["quarter"] == [] and r["replicated"] == [] and r["unexplained"] == [], (kind, r)
                continue
            word, (where, op) = ("gate", GATES[kind]) if kind in GATES else ("router", ROUTERS[kind])
            # what is whole is exactly the gates or the routers, each with its own reason
            assert r["quarter"] == sorted(m + ".weight" for m in where) and r["unexplained"] == [], (kind, r)
            # whole by design, not a gap: no warning, nothing in plan.replicated, the reason in plan.whole
            assert r["replicated"] == [], (kind, r["replicated"])
            for m in where:
                reason = r["whole"][m + ".weight"]
                assert reason.startswith(f"{word} kept whole: its ") and op in reason, r["whole"]
        for kind, g in res["gathered"].items():
            tp, classes = world, CLASSES[kind]
            assert g["shape"] == g["ref_shape"] == [2, S, classes] and g["last_shape"] == [2, classes], (kind, g)
            assert g["logits_diff"] <= 1e-5 and g["last_diff"] <= 1e-5, (kind, g)
            assert g["local"] == [2, S, PADDED // tp] and g["head_local"] == [PADDED // tp, H], (kind, g)
            # checkpoints keep the padded rows, stepped as the unsharded model steps them (weight decay moved them)
            assert g["state_shapes"]["head.weight"] == [PADDED, H], (kind, g)
            assert g["state_diff"] <= 1e-5 and g["dead_rows_moved"] > 1e-5, (kind, g)
