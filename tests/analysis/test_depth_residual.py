"""Layers that read attention over the earlier layers' outputs (a block attention residual: Inkling 2's), with short
convolutions of their keys and values written with ``unfold`` (tests/support/depth_residual_models.py: two
hand-written spellings and Hugging Face's Inkling 2). Each attention is cut by heads (q, k, v column-parallel, the
convolutions' taps ``(K, C)`` by channels, read per head through a transpose and a view, the output projection
row-parallel), each MLP or expert column→row, the router whole; the mixes over depth read the all-reduced layer
outputs whole, their few queries whole by design as a router's gate is. Two things kept Inkling 2's layers
replicated: ``aten.unfold`` had no rule (torch has no sharding strategy for it), and the static taps, read as
``taps.t().view(heads, d, K)``, were refused as a replicated value depending on a parameter; its first attention
pair then failed, and the failed tries of the next layer's projections as rows of the experts were reported
("aten.topk.default needs add_22 whole"). The plans of the spellings are checked in the fast tier, one spelling
trains at world 2 by default, the rest (and the Hugging Face families' plans, which capture slowly) in the
extended run."""
from __future__ import annotations

import math

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from depth_residual_models import HD, NH, H, I, K, KINDS, S, TOP, build
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from ranks import Launches

HAND = ["listed", "stacked"]
HF = [k for k in KINDS if k not in HAND]
WHOLE_BY_DESIGN = ("gate kept whole", "router kept whole", "filter kept whole", "head-shared weight kept whole")


def _queries(kind: str) -> list[str]:
    mixes = [f"layers.{i}.{m}" for i in range(2) for m in ("attn_input", "mlp_input")] + ["final_input"]
    return [f"{m}.query" for m in mixes]


@pytest.mark.parametrize("kind", HAND)
def test_layers_are_cut_by_heads_with_the_depth_mixes_whole(kind: str):
    """Nothing replicated; q, k, v column-parallel with their convolutions' taps cut by channels, o row-parallel,
    the MLP (experts) column→row; the mixes' queries whole by design (and the residual stream's depthwise filters,
    the router); at most 1/tp + 0.12 of the parameters per rank. Per layer one all-reduce of b·s·h forward for
    attention and one for the MLP (experts); backward one f per distinct input of attention's columns (the
    stacked spelling's q | k read one mix, v the other) and the MLP's (the experts' also one of the b·s·k routing
    weights)."""
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    stacked = kind == "stacked"
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), (tp, plan.replicated)
        params = dict(plan.params)
        for i in range(2):
            attn = f"layers.{i}.attn"
            for name in ("q", "k", "v"):
                w = params[f"{attn}.{name}.weight"]
                assert (w.role, w.local_shape) == ("column", (H // tp, H)), (tp, name, w)
            assert params[f"{attn}.o.weight"].local_shape == (H, H // tp), tp
            for conv in ("k_conv", "v_conv"):
                assert params[f"{attn}.{conv}.taps"].local_shape == (K, NH * HD // tp), (tp, conv)
                if stacked:  # the per-token taps: one per head and tap
                    assert params[f"{attn}.{conv}.weight_proj.weight"].local_shape == (NH * K // tp, H), tp
            if stacked:  # every expert column→row (expert tensor parallelism)
                for w, shape in (("w1", (4, I // tp, H)), ("w3", (4, I // tp, H)), ("w2", (4, H, I // tp))):
                    assert params[f"layers.{i}.mlp.{w}"].local_shape == shape, (tp, w, params[f"layers.{i}.mlp.{w}"])
            else:
                assert params[f"layers.{i}.mlp.down.weight"].local_shape == (H, 2 * H // tp), tp
        whole = {w.name: w.reason for w in plan.whole}
        assert all(r.startswith(WHOLE_BY_DESIGN) for r in whole.values()), (tp, whole)
        for q in _queries(kind):
            assert whole[q].startswith("gate kept whole"), (tp, q, whole.get(q))
        if stacked:
            assert {f"layers.{i}.post_conv.weight" for i in range(2)} <= whole.keys(), (tp, whole)
            assert all(whole[f"layers.{i}.mlp.router.weight"].startswith("router kept whole") for i in range(2))
        held = sum(math.prod(params[n].local_shape) if n in params else p.numel() for n, p in model.named_parameters())
        assert held / sum(p.numel() for p in model.parameters()) <= 1 / tp + 0.12, (tp, held)
        for i in range(2):
            got = sorted((c.direction, c.shape[-1]) for c in plan.collectives if c.module == f"layers.{i}.attn")
            assert got == [("backward", "64")] * (1 + stacked) + [("forward", "64")], (tp, i, got)
            got = sorted((c.direction, c.shape[-1]) for c in plan.collectives if c.module == f"layers.{i}.mlp")
            extra = [("backward", str(TOP))] if stacked else []
            assert got == sorted([("backward", "64"), ("forward", "64")] + extra), (tp, i, got)


@pytest.mark.extended
@pytest.mark.parametrize("kind", HF)
def test_inkling2_is_fully_sharded(kind: str):
    """Hugging Face's Inkling 2 (its sliding and its full layer) at tp 2 and 4: nothing replicated, every weight
    whole only by design: the queries of its block attention residuals (gate), the routers, the filters of the
    residual stream's short convolutions, the relative logits' shared profiles (head-shared); each layer's
    attention cut by heads (the full layer's dynamic short convolutions of k and v by channels), its experts
    column→row."""
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), (tp, plan.replicated)
        whole = {w.name: w.reason for w in plan.whole}
        assert all(r.startswith((*WHOLE_BY_DESIGN, "read by nothing")) for r in whole.values()), (tp, whole)
        assert whole["model.layers.1.attention_input.query"].startswith("gate kept whole"), (tp, whole)
        params = dict(plan.params)
        for i in range(2):
            attn = f"model.layers.{i}.self_attn"
            assert params[f"{attn}.q_proj.linear.weight"].role == "column", (tp, i)
            assert params[f"{attn}.o_proj.linear.weight"].role == "row", (tp, i)
        for conv in ("k_proj", "v_proj"):
            taps = params[f"model.layers.1.self_attn.{conv}.sconv.static_weight"]
            assert taps.role == "column" and taps.local_shape[0] == 4, (tp, conv, taps)
        for i in range(2):  # the experts' one all-reduce forward, of (b, s, h) once their k slots are combined
            fwd = [c.shape for c in plan.collectives if c.module == f"model.layers.{i}.mlp.experts"
                   and c.direction == "forward"]
            assert len(fwd) == 1 and len(fwd[0]) == 3 and fwd[0][-1] == "64", (tp, i, fwd)


# the one default launch: the stacked spelling at world 2; every other run extended
PARITY = Launches({2: {"stacked": (pattern_parity, ["stacked"], 3, False, "depth_residual_models")}},
                  extended={w: {"all": (pattern_parity, list(KINDS) if w == 4 else ["listed", *HF], 3, False,
                                        "depth_residual_models")} for w in (2, 4)})


def _check_hand_written(r: dict, kind: str, world: int, where: tuple) -> None:
    """Exact, fully sharded, and per step Megatron's forward (per layer attention's and the MLP's all-reduce of
    b·s·h, the embedding's, the loss's max and two sums of b·s) and backward (per layer an f per distinct input of
    attention's columns and the MLP's, the experts' routing weights b·s·k, and the head's)."""
    bsh, bs = 2 * S * H, 2 * S
    assert_exact(r, where)
    assert_fully_sharded(r, world, where)
    assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * 5 + [("all_reduce", "max", bs)]
                                          + [("all_reduce", "sum", bs)] * 2), (*where, r["forward"])
    backward = [("all_reduce", "sum", bsh)] * (5 + 2 * (kind == "stacked"))
    backward += [("all_reduce", "sum", bs * TOP)] * 2 * (kind == "stacked")
    assert sorted(r["backward"]) == sorted(backward), (*where, r["backward"])


@pytest.mark.slow
def test_stacked_depth_residual_trains_exactly():
    """3 AdamW steps of the stacked spelling at world 2: loss, gradients and parameters within 1e-5, fully
    sharded, Megatron's collectives."""
    for rank, by_kind in PARITY(2, "stacked").items():
        _check_hand_written(by_kind["stacked"], "stacked", 2, (rank, "stacked"))


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_depth_residuals_train_exactly(world: int):
    """3 AdamW steps: the hand-written LMs exact with Megatron's collectives (:func:`_check_hand_written`);
    Hugging Face's Inkling 2 exact and fully sharded."""
    for rank, by_kind in PARITY(world, "all").items():
        assert list(by_kind) == (list(KINDS) if world == 4 else ["listed", *HF]), (rank, list(by_kind))
        for kind, r in by_kind.items():
            if kind in HF:  # b·s·h = 2·8·64: per layer attention's and the experts' all-reduce, the experts'
                # after they are combined (not of the b·s·k·h rows before), and backward the b·s·k routing weights
                assert_exact(r, (rank, kind))
                assert_fully_sharded(r, world, (rank, kind))
                assert sorted(r["forward"]) == sorted([("all_reduce", "sum", 1024)] * 5 + [("all_reduce", "max", 16)]
                                                      + [("all_reduce", "sum", 16)] * 2), (rank, kind, r["forward"])
                assert r["backward"].count(("all_reduce", "sum", 32)) == 2, (rank, kind, r["backward"])
                continue
            _check_hand_written(r, kind, world, (rank, kind))
