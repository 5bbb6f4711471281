"""Image captioners (tests/support/vision_models.py: three hand-written spellings and Hugging Face's GIT): the vision
tower's attention and MLP cut as the text tower's (q, k, v column-parallel by heads, the output projection and the
MLP's second linear row-parallel), the stem that convolves the image into patches and the patch positions' table
whole on every rank (Megatron's ViT keeps its patch embedding and position embedding whole), the projection into
the text width whole between the vision tower's last all-reduce and the text tower's first column, the token
embedding vocab-parallel, its all-reduce before the image features meet the tokens (``cat`` along the sequence, or
an add), so every text pair reads whole values through f. GIT was reported with its projection left replicated
("cat of sharded and replicated tensors": its failed try as an LM head) and its stem as a gap ("read by
conv2d.default, which no sharding rule reads as a weight"). The plans are checked in the fast tier, one spelling
trains at world 2 by default; the rest is the extended run."""
from __future__ import annotations

import math

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from pattern_models import H
from ranks import Launches
from vision_models import P, S, build

SPELLINGS = ["prepended", "appended", "pooled"]
_GIT = "git.image_encoder.vision_model"

# name -> (parameter names of the stem, the patch positions' table, the projection, a vision block, a text block)
_NAMES = {
    "prepended": ("vision.patch.weight", "vision.pos.weight", "proj", "vision.blocks.{i}", "blocks.{i}"),
    "appended": ("vision.patch.weight", "vision.pos_embed", "proj", "vision.blocks.{i}", "blocks.{i}"),
    "pooled": ("vision.patch_w", "vision.pos_table", "proj", "vision.blocks.{i}", "blocks.{i}"),
    "git": (f"{_GIT}.embeddings.patch_embedding.weight", f"{_GIT}.embeddings.position_embedding.weight",
            "git.visual_projection.visual_projection.0", f"{_GIT}.encoder.layers.{{i}}", "git.encoder.layer.{i}"),
}


def _held(model, plan) -> float:
    params = dict(plan.params)
    held = sum(math.prod(params[n].local_shape) if n in params else p.numel() for n, p in model.named_parameters())
    return held / sum(p.numel() for p in model.parameters())


def _check_plan(kind: str, model, gm) -> None:
    """At tp 2 and 4: nothing replicated; whole only the stem, the position tables and the projection, each with
    its reason; the vision blocks' q, k, v by heads and their output projections by rows; at most 1/tp + 0.12 of
    the parameters per rank; per vision and text layer one all-reduce forward and one backward for attention and
    for the MLP."""
    stem, pos, proj, vision, text = _NAMES[kind]
    attn, mlp = (("self_attn.{}_proj", "mlp.fc{}") if kind == "git" else ("attn.{}", "fc{}"))
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), (tp, plan.replicated)
        whole = {w.name: w.reason for w in plan.whole}
        texts = {n: r for n, r in whole.items() if n not in (stem, pos, f"{proj}.weight")}
        assert all(r.startswith("position embedding") for r in texts.values()), (tp, texts)  # GIT's text positions
        assert whole[stem].startswith("input stem kept whole: its 64×3×4×4 filters convolve the call's input"), \
            (tp, whole[stem])
        assert whole[pos].startswith("position embedding"), (tp, whole[pos])
        block = vision.format(i=1)
        fc2 = f"{block}.{'mlp.fc2' if kind == 'git' else 'fc2'}"
        assert whole[f"{proj}.weight"].startswith(
            f"post-row linear kept whole: its {H}→{H} linear reads the all-reduced output of the row-parallel {fc2} "
            "whole"), (tp, whole[f"{proj}.weight"])
        params = dict(plan.params)
        for i in range(2):
            for name in ("q", "k", "v"):
                w = params[f"{vision.format(i=i)}.{attn.format(name)}.weight"]
                assert (w.role, w.local_shape) == ("column", (H // tp, H)), (tp, i, name, w)
            o = params[f"{vision.format(i=i)}.{attn.format('out' if kind == 'git' else 'o')}.weight"]
            assert (o.role, o.local_shape) == ("row", (H, H // tp)), (tp, i, o)
            fc1 = params[f"{vision.format(i=i)}.{mlp.format(1)}.weight"]
            assert (fc1.role, fc1.local_shape) == ("column", (2 * H // tp, H)), (tp, i, fc1)
        assert _held(model, plan) <= 1 / tp + 0.12, (tp, _held(model, plan))
        for tower in (vision, text):
            for i in range(2):
                layer = tower.format(i=i)
                found = sorted((c.op, c.direction) for c in plan.collectives
                               if c.module == layer or c.module.startswith(layer + "."))
                assert found == [("sum", "backward")] * 2 + [("sum", "forward")] * 2, (tp, layer, found)


@pytest.mark.parametrize("kind", SPELLINGS)
def test_captioner_cuts_both_towers_with_the_stem_and_projection_whole(kind: str):
    model, args, kwargs = build(kind)
    _check_plan(kind, model, capture(model, args, kwargs)[0])


def test_git_is_fully_sharded():
    """Hugging Face's GIT: its vision tower (a CLIP-style encoder, the class embedding prepended to the patches) and
    its text tower cut, the stem, the position tables and the visual projection whole by design."""
    model, args, kwargs = build("git")
    _check_plan("git", model, capture(model, args, kwargs)[0])


# the default launch: the GIT-like spelling at world 2; every other run extended
PARITY = Launches({2: {"vision": (pattern_parity, ["prepended"], 3, False, "vision_models")}},
                  extended={w: {"all": (pattern_parity, SPELLINGS + ["git"], 3, False, "vision_models")}
                            for w in (2, 4)})


def _check_hand_written(kind: str, r: dict, world: int, where: tuple) -> None:
    """Exact, fully sharded, and per step Megatron's all-reduces: forward per vision layer two of b·P·h, per text
    layer two of b·s'·h (s' = P + s where the image tokens join the sequence, s where the image is added), the
    embedding's of b·s·h, the loss's max and two sums of b·s; backward the same layers' two each and the head's."""
    b = 2
    seq = S if kind == "pooled" else P + S
    vision, text, tokens = b * P * H, b * seq * H, b * S * H
    assert_exact(r, where)
    assert_fully_sharded(r, world, where)
    assert sorted(r["whole"]) == sorted(_NAMES[kind][:2] + ("proj.weight",)), \
        (*where, r["whole"])
    assert sorted(r["forward"]) == sorted([("all_reduce", "sum", vision)] * 4 + [("all_reduce", "sum", text)] * 4
                                          + [("all_reduce", "sum", tokens), ("all_reduce", "max", b * S)]
                                          + [("all_reduce", "sum", b * S)] * 2), (*where, r["forward"])
    assert sorted(r["backward"]) == sorted([("all_reduce", "sum", vision)] * 4 + [("all_reduce", "sum", text)] * 4
                                           + [("all_reduce", "sum", tokens)]), (*where, r["backward"])


@pytest.mark.slow
def test_prepended_image_tokens_train_exactly():
    """3 AdamW steps at world 2: loss, gradients and parameters within 1e-5, Megatron's collectives."""
    for rank, by_kind in PARITY(2, "vision").items():
        _check_hand_written("prepended", by_kind["prepended"], 2, (rank, "prepended"))


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_captioners_train_exactly(world: int):
    """Every spelling and GIT, 3 AdamW steps: exact and fully sharded; the hand-written ones with Megatron's
    collectives (:func:`_check_hand_written`), GIT with one all-reduce per pair each way, the embedding's and the
    loss's forward and the head's backward."""
    for rank, by_kind in PARITY(world, "all").items():
        assert list(by_kind) == SPELLINGS + ["git"], (rank, list(by_kind))
        for kind, r in by_kind.items():
            if kind != "git":
                _check_hand_written(kind, r, world, (rank, kind))
                continue
            assert_exact(r, (rank, kind))
            assert_fully_sharded(r, world, (rank, kind))
            forward = sorted(n for _, op, n in r["forward"] if op == "sum")
            assert len(r["forward"]) == 8 + 1 + 3 and len(r["backward"]) == 8 + 1, (rank, r["forward"], r["backward"])
            assert forward.count(2 * (P + 1) * H) == 4 and forward.count(2 * (P + 1 + S) * H) == 4, (rank, forward)
