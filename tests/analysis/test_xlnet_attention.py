"""Attention whose weights are raw ``(d_model, n_head, d_head)`` parameters read by einsum (XLNet's), cut by heads as
Megatron would (tests/support/xlnet_models.py: three hand-written spellings and Hugging Face's XLNet, plainly,
with its two streams and with two segments). Capture writes an einsum, ``tensordot`` or reshape by such a weight
as the matmul of a flattened weight (autotp/capture/weight_matrices.py); the weight is cut on its outermost merged
dim, the heads (autotp/analysis/matmuls.py's ``fold``): q, k, v and the relative-position key r column-parallel,
the per-head biases (and, given token_type_ids, the segment embeddings ``(2, n_head, d_head)``) with them, the
output ``(d_model, n_head, d_head)`` row-parallel over (heads, d_head). Where the query weight is read by two
streams and the keys and values by both streams' attention, the other stream's row joins the pair beside its own
(autotp/analysis/pairs.py's ``_joined_rows``): one all-reduce per stream through the output projection. The
position encoding, made from sizes alone, takes no gradient: no f of its own.

Before: XLNet kept 14 weights whole ("a 64→16 matmul outside every column→row pair whose output is read by
permute.default", the output "read by einsum.default, which no sharding rule reads as a weight").

XLNetLMHeadModel's plain training call (no ``perm_mask``/``target_mapping``) computes no query stream at all:
``output_g`` is None, every layer runs the one-stream branch, the loss reads the content stream. The query
stream runs only with ``target_mapping`` (``xlnet_two_stream`` here)."""
from __future__ import annotations

import math

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from parity_checks import assert_exact, assert_fully_sharded, assert_megatron_step
from parity_workers import pattern_parity
from pattern_models import H, HD, NH, S
from ranks import Launches
from xlnet_models import INDIVISIBLE, KINDS, build

HAND = ["einsum", "matmul", "stored_nd", "two_stream"]
HF = ["xlnet", "xlnet_two_stream", "xlnet_segments"]
# XLNet's segment weights, which a call without token_type_ids does not read
UNREAD = ("r_s_bias", "seg_embed")


def _plan_checks(kind: str, tps=(2, 4)) -> None:
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    attn = "transformer.layer.{}.rel_attn" if kind in HF else "blocks.{}.attn"
    heads = ("q", "k", "v", "r") if kind != "two_stream" else ("q", "k", "v")
    biases = ("r_w_bias", "r_r_bias") if kind != "two_stream" else ("r_w_bias",)
    streams = 2 if "two_stream" in kind else 1
    for tp in tps:
        plan = make_plan(gm, tp)
        assert plan.replicated == (), (kind, tp, plan.replicated)
        gaps = [(w.name, w.reason) for w in plan.whole if not w.name.endswith(UNREAD)]
        assert gaps == [], (kind, tp, gaps)
        assert all(w.reason.startswith("read by nothing") for w in plan.whole), (kind, tp, plan.whole)
        assert bool(plan.whole) == (kind.startswith("xlnet") and kind != "xlnet_segments"), (kind, tp, plan.whole)
        params = dict(plan.params)
        if kind == "xlnet_segments":  # the segment score's per-head weights, cut with the heads
            for i in range(2):
                a = attn.format(i)
                assert params[f"{a}.seg_embed"].local_shape == (2, NH // tp, HD), (tp, params[f"{a}.seg_embed"])
                assert params[f"{a}.r_s_bias"].local_shape == (NH // tp, HD), (tp, params[f"{a}.r_s_bias"])
        for i in range(2):
            a = attn.format(i)
            for w in heads:  # by heads: (h, n, d) -> (h, n/t, d)
                p = params[f"{a}.{w}"]
                assert (p.role, p.dim, p.local_shape) == ("column", 1, (H, NH // tp, HD)), (kind, tp, w, p)
            o = params[f"{a}.o"]
            assert (o.role, o.dim, o.local_shape) == ("row", 1, (H, NH // tp, HD)), (kind, tp, o)
            for b in biases:
                assert params[f"{a}.{b}"].local_shape == (NH // tp, HD), (kind, tp, b, params[f"{a}.{b}"])
            # forward one all-reduce per stream through o; backward one f per stream's input (the position
            # encoding, made from sizes, takes no gradient and has none)
            mine = sorted(c.direction for c in plan.collectives if c.module == a)
            assert mine == ["backward"] * streams + ["forward"] * streams, (kind, tp, i, mine)
            ffn = [c.direction for c in plan.collectives if c.module.startswith(a.rsplit(".", 1)[0] + ".ff")]
            assert sorted(ffn) == ["backward"] * streams + ["forward"] * streams, (kind, tp, i, ffn)
        held = sum(math.prod(params[n].local_shape) if n in params else p.numel() for n, p in model.named_parameters())
        assert held / sum(p.numel() for p in model.parameters()) <= 1 / tp + 0.12, (kind, tp, held)


@pytest.mark.parametrize("kind", ["einsum", "matmul", "two_stream", "xlnet"])
def test_einsum_weights_are_cut_by_heads(kind: str):
    """At tp 2 and 4: nothing replicated, no weight whole but those this call does not read, q, k, v (and r)
    cut on their head dim, o row-parallel on it, the per-head biases with them, at most 1/tp + 0.12 of the
    parameters per rank, Megatron's collectives per layer and stream."""
    _plan_checks(kind)


@pytest.mark.extended
@pytest.mark.parametrize("kind", ["xlnet_two_stream", "xlnet_segments"])
def test_xlnet_calls_are_cut_by_heads(kind: str):
    """Hugging Face's XLNet with ``perm_mask`` and ``target_mapping`` (both streams, the query weight read by
    each, the output projection row-parallel once per stream), and with ``token_type_ids`` (``r_s_bias`` and
    ``seg_embed`` read per head, cut with the heads: nothing whole)."""
    _plan_checks(kind)


def test_plain_xlnet_call_computes_no_query_stream():
    """XLNetLMHeadModel's training call without target_mapping: each layer's attention reads q once (the content
    stream's), and o once: no query stream at all."""
    model, args, kwargs = build("xlnet")
    gm = capture(model, args, kwargs)[0]
    for w in ("q", "o"):
        reads = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == f"transformer.layer.0.rel_attn.{w}"]
        assert [len(n.users) for n in reads] == [1], (w, reads)


# the default launch: the einsum spelling, Hugging Face's XLNet and the einsum spelling with 3 heads at world 2;
# every other run extended (each indivisible spelling at the world that does not split its heads)
PARITY = Launches({2: {"xlnet": (pattern_parity, ["einsum", "xlnet", "einsum:3"], 3, False, "xlnet_models")}},
                  extended={w: {"all": (pattern_parity, list(KINDS), 3, False, "xlnet_models"),
                                "indivisible": (pattern_parity, [k for k, t in INDIVISIBLE.items() if t == w], 3,
                                                False, "xlnet_models")} for w in (2, 4)})


def _check_whole_attention(r: dict, kind: str, world: int, where: tuple) -> None:
    """Heads ``world`` does not split: exact, each layer's attention replicated with the reason, and the
    collectives of a dense LM whose attention every rank computes whole: forward the embedding's, each
    feed-forward's (per stream) and the loss's, backward an f per feed-forward and stream (but the last layer's
    content stream's, which reaches no loss where the loss reads the query stream) and the head's."""
    assert_exact(r, where)
    n = int(kind.split(":")[1])
    assert len(r["replicated"]) == 2 and all(f"{n} heads are not divisible by tp={world}" in why
                                             for _, why in r["replicated"]), (*where, r["replicated"])
    b, s = 2, (8 if kind.startswith("xlnet") else S)
    bsh = b * s * (16 * n if kind.startswith("xlnet") else H)
    streams = 2 if "two_stream" in kind else 1
    forward = [("all_reduce", "sum", bsh)] * (1 + 2 * streams) + [
        ("all_reduce", "max", b * s), ("all_reduce", "sum", b * s), ("all_reduce", "sum", b * s)]
    assert sorted(r["forward"]) == sorted(forward), (*where, r["forward"])
    assert sorted(r["backward"]) == [("all_reduce", "sum", bsh)] * (2 + streams), (*where, r["backward"])


def _check(r: dict, kind: str, world: int, where: tuple) -> None:
    """Exact, fully sharded (the unread weights aside), and Megatron's all-reduces: one stream as a dense LM's
    step; two streams, per layer one through o and one through the feed-forward for each."""
    assert_exact(r, where)
    # the query stream's (1, 1, h) embedding is a vector, whole as a norm's weight is (the workers list every
    # parameter of two or more dims held whole)
    kept = [n for n in r["unexplained"] if not n.endswith((*UNREAD, "mask_emb"))]
    assert_fully_sharded({**r, "unexplained": kept}, world, where)
    b = 2
    s = S if kind in HAND else 8
    if "two_stream" not in kind:
        assert_megatron_step(r, b * s * H, b * s, 2, where)
        return
    g = s if kind == "two_stream" else 2  # the query stream's positions (XLNet's: its 2 targets)
    bsh, bgh = b * s * H, b * g * H
    forward = [("all_reduce", "sum", bsh)] * 5 + [("all_reduce", "sum", bgh)] * 4 + \
        [("all_reduce", "max", b * g), ("all_reduce", "sum", b * g), ("all_reduce", "sum", b * g)]
    assert sorted(r["forward"]) == sorted(forward), (*where, r["forward"])
    # backward: per layer an f per stream entering attention and the feed-forward, and the head's (of g); the
    # last layer's content stream reaches no loss (the loss reads the query stream; that layer's keys and values
    # read its input): its feed-forward's f gets no gradient and does not run
    backward = [("all_reduce", "sum", bsh)] * 3 + [("all_reduce", "sum", bgh)] * 5
    assert sorted(r["backward"]) == sorted(backward), (*where, r["backward"])


@pytest.mark.slow
def test_xlnet_trains_exactly_at_world_2():
    """3 AdamW steps at world 2, the einsum spelling and Hugging Face's XLNet: loss, gradients and parameters
    within 1e-5 of one device, every read weight cut, Megatron's collectives; the einsum spelling with 3 heads
    exact with its attention whole on every rank and its feed-forwards cut."""
    for rank, by_kind in PARITY(2, "xlnet").items():
        assert list(by_kind) == ["einsum", "xlnet", "einsum:3"], (rank, list(by_kind))
        for kind, r in by_kind.items():
            (_check_whole_attention if ":" in kind else _check)(r, kind, 2, (rank, kind))


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_heads_tp_does_not_split_train_exactly(world: int):
    """Every spelling with heads ``world`` does not split (3 at world 2, 2 at world 4): exact, attention whole."""
    kinds = [k for k, t in INDIVISIBLE.items() if t == world]
    for rank, by_kind in PARITY(world, "indivisible").items():
        assert list(by_kind) == kinds, (rank, list(by_kind))
        for kind, r in by_kind.items():
            _check_whole_attention(r, kind, world, (rank, kind))


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_every_spelling_trains_exactly(world: int):
    for rank, by_kind in PARITY(world, "all").items():
        assert list(by_kind) == list(KINDS), (rank, list(by_kind))
        for kind, r in by_kind.items():
            _check(r, kind, world, (rank, kind))


def test_weights_stored_heads_first_are_cut_on_their_heads():
    """Weights stored ``(n, d, h)`` (the merged dims leading, flattened ``(n·d, h)``): cut on dim 0, the heads,
    at tp 2 and 4; nothing replicated, nothing whole."""
    model, args, kwargs = build("stored_nd")
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        params = dict(plan.params)
        for i in range(2):
            for w, role in (("q", "column"), ("k", "column"), ("v", "column"), ("r", "column"), ("o", "row")):
                p = params[f"blocks.{i}.attn.{w}"]
                assert (p.role, p.dim, p.local_shape) == (role, 0, (NH // tp, HD, H)), (tp, w, p)


@pytest.mark.parametrize("kind", sorted(INDIVISIBLE))
def test_heads_tp_does_not_split_leave_attention_whole(kind: str):
    """3 heads at tp 2, 2 at tp 4 (the output projection's heads fewer than tp): each layer's attention is left
    replicated with the reason (the weight, its sizes, the heads and tp), every weight it reads whole with it (the
    per-head biases, and Hugging Face's segment weights ``r_s_bias`` and ``seg_embed``), the feed-forwards still
    cut; the plan is made, where the planner used to stop on a cut of the flattened weight that is not whole
    heads."""
    tp, n = INDIVISIBLE[kind], int(kind.split(":")[1])
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    plan = make_plan(gm, tp)
    hf = kind.startswith("xlnet")
    attn = "transformer.layer.{}.rel_attn" if hf else "blocks.{}.attn"
    width = 16 * n if hf else H
    assert [m for m, _ in plan.replicated] == [attn.format(i) for i in range(2)], (kind, plan.replicated)
    shape = (n, HD, width) if kind.startswith("stored_nd") else (width, n, HD)
    for m, why in plan.replicated:
        assert f"{m}." in why and str(shape) in why and f"{n} heads are not divisible by tp={tp}" in why, (kind, why)
    params = dict(plan.params)
    whole = {w.name: w.reason for w in plan.whole}
    for i in range(2):
        a = attn.format(i)
        mine = [name for name, p in model.named_parameters() if name.startswith(a + ".") and p.dim() >= 2]
        assert mine and all(name not in params and f"{n} heads are not divisible by tp={tp}" in whole[name]
                            for name in mine), (kind, i, mine, whole)
        if hf:
            assert {f"{a}.r_s_bias", f"{a}.seg_embed"} <= set(mine), mine
        ffn = attn.format(i).rsplit(".", 1)[0] + (".ff.layer_1.weight" if hf else ".ffn.fc1.weight")
        assert params[ffn].role == "column" and params[ffn].local_shape[0] * tp == model.get_parameter(ffn).shape[0], \
            (kind, ffn, params.get(ffn))
        assert [c.direction for c in plan.collectives if c.module == a] == [], (kind, a)
