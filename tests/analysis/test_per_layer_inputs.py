"""Per-layer inputs (Gemma 3n's and Gemma 4's; tests/support/per_layer_input_models.py: two hand-written spellings
and Hugging Face's Gemma 4): each layer's gate ``h -> d_pl`` column-parallel and its projection ``d_pl -> h``
row-parallel, a pair like an MLP's; the layer's per-layer input ``(b, s, d_pl)``, whole on every rank, multiplies
the gate's ``(b, s, d_pl/t)`` elementwise, so it enters the pair through f and each rank reads its own slice: one
all-reduce of ``b·s·d_pl`` backward per layer, none forward. The per-layer inputs are made whole: the per-layer
embedding vocab-parallel, the projection of the token embeddings ``h -> L·d_pl`` whole by design (its output is
normed over ``d_pl``). It was left replicated: that projection was tried as a column of each layer's pair, its
output cut by layers, and the select of a layer was one of the sharded dim."""
from __future__ import annotations

import math

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from pattern_models import H, S, V
from per_layer_input_models import DPL, HF, L, SPELLINGS, build
from ranks import Launches


def _fraction(model, plan) -> float:
    """The share of the parameters the call reads that one rank holds (Gemma 4's vision tower is not read)."""
    params = dict(plan.params)
    unread = {w.name for w in plan.whole if w.reason.startswith("read by nothing")}
    held = [(n, p) for n, p in model.named_parameters() if n not in unread]
    local = sum(math.prod(params[n].local_shape) if n in params else p.numel() for n, p in held)
    return local / sum(p.numel() for _, p in held)


@pytest.mark.parametrize("kind", SPELLINGS)
def test_per_layer_inputs_enter_each_layer_through_f(kind: str):
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), (tp, plan.replicated)
        whole = [(w.name, w.reason.split(":")[0]) for w in plan.whole]
        assert whole == ([("model_proj.weight", "input kept whole")] if kind == "embedded" else []), (tp, whole)
        params = dict(plan.params)
        for i in range(L):
            gate, proj = params[f"blocks.{i}.gate.weight"], params[f"blocks.{i}.proj.weight"]
            assert (gate.role, gate.local_shape) == ("column", (DPL // tp, H)), (tp, gate)
            assert (proj.role, proj.local_shape) == ("row", (H, DPL // tp)), (tp, proj)
        if kind == "embedded":  # normed over d_pl after the projection is added: looked up whole, vocab-parallel
            assert params["emb_pl.weight"].role == "vocab", (tp, params["emb_pl.weight"])
        else:  # split per layer and read by nothing across d_pl: cut with the gates, each rank its d_pl/tp of
            # every layer's block (a table the layers' pairs share), so it needs no collective of its own
            emb = params["emb_pl.weight"]
            assert (emb.role, emb.dim, emb.local_shape) == ("column", 1, (V, L * DPL // tp)), (tp, emb)
        if kind == "table":  # its row l scales layer l's gate: cut with the gate's features
            assert (params["table"].dim, params["table"].local_shape) == (1, (L, DPL // tp)), (tp, params["table"])
        assert _fraction(model, plan) <= 1 / tp + 0.12, (tp, _fraction(model, plan))
        whole_input = kind == "embedded"
        for i in range(L):  # per layer: the MLP's and the per-layer pair's all-reduce forward; backward their
            # inputs' f and, where the per-layer input is whole, its own (b·s·d_pl)
            block = sorted((c.direction, c.shape[-1]) for c in plan.collectives if c.module == f"blocks.{i}")
            assert block == [("backward", str(DPL))] * whole_input + [("backward", str(H)), ("backward", str(H)),
                                                                     ("forward", str(H)), ("forward", str(H))], \
                (tp, i, block)
        embeddings = sorted((c.module, c.direction, c.shape[-1]) for c in plan.collectives
                            if c.module.startswith("emb"))
        assert embeddings == [("emb", "forward", str(H))] + [("emb_pl", "forward", str(L * DPL))] * whole_input, \
            (tp, embeddings)


def _hf_plans(family: str) -> None:
    model, args, kwargs = build(family)
    gm = capture(model, args, kwargs)[0]
    layers = "model.language_model.layers" if family == "gemma4" else "model.layers"
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), (tp, plan.replicated)
        # the vision tower's weights, which a call on text does not read, are whole too
        whole = [w.reason.split(":")[0] for w in plan.whole if not w.reason.startswith("read by nothing")]
        assert whole == ["input kept whole"], (tp, whole)
        params = dict(plan.params)
        for i in range(2):
            assert params[f"{layers}.{i}.per_layer_input_gate.weight"].local_shape == (32 // tp, 64)
            assert params[f"{layers}.{i}.per_layer_projection.weight"].local_shape == (64, 32 // tp)
            f = [c.shape[-1] for c in plan.collectives if c.module == f"{layers}.{i}" and c.direction == "backward"]
            assert sorted(f) == ["32", "64"], (tp, i, f)  # the per-layer input's f and the gate input's
        assert _fraction(model, plan) <= 1 / tp + 0.12, (tp, _fraction(model, plan))


def test_gemma4_text_per_layer_inputs_are_cut():
    """Gemma 4's text model: nothing replicated at tp 2 and 4, only per_layer_model_projection whole (by
    design); each layer's per-layer gate and projection cut, one f of b·s·d_pl per layer beside the gate's."""
    _hf_plans("gemma4_text")


@pytest.mark.extended
def test_gemma4_lm_head_is_vocab_parallel():
    """Gemma 4 with its vision tower, called on text: its tied token table is read as ``E[pad]`` into a
    ``torch.where`` whose result nothing reads, which kept the LM head and the embedding whole; now both are
    vocab-parallel and the plan is as the text model's."""
    model, args, kwargs = build("gemma4")
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        params = dict(make_plan(gm, tp).params)
        assert params["lm_head.weight"].role == "vocab", (tp, params.get("lm_head.weight"))
    _hf_plans("gemma4")


RUNS = [*SPELLINGS, *HF]
PARITY = Launches({2: {"pli": (pattern_parity, ["embedded"], 3, False, "per_layer_input_models")}},
                  extended={2: {"pli_rest": (pattern_parity, RUNS[1:], 3, False, "per_layer_input_models")},
                            4: {"pli": (pattern_parity, RUNS, 3, False, "per_layer_input_models")}})


def _check(r: dict, kind: str, world: int, where: tuple) -> None:
    """Exact, fully sharded, and for the hand-written spellings Megatron's all-reduces: forward per layer the
    MLP's and the per-layer pair's (b·s·h), the embeddings' (b·s·h, b·s·L·d_pl), the loss's max and two sums
    (b·s); backward per layer the MLP's and the gate's f (b·s·h) and the per-layer input's (b·s·d_pl), and the
    head's."""
    # the family's parameters within 1e-4 after 3 steps, as tests/analysis/test_hf_families.py
    assert_exact(r, where, param_tol=1e-4 if kind in HF else 1e-5)
    assert_fully_sharded(r, world, where)
    if kind in HF:
        return
    bsh, bs = 2 * S * H, 2 * S
    whole_input = kind == "embedded"  # "table": the per-layer embedding is cut with the gates, no collective
    forward = [("all_reduce", "sum", bsh)] * (2 * L + 1) + [("all_reduce", "sum", bs * L * DPL)] * whole_input \
        + [("all_reduce", "max", bs)] + [("all_reduce", "sum", bs)] * 2
    assert sorted(r["forward"]) == sorted(forward), (*where, r["forward"])
    backward = [("all_reduce", "sum", bsh)] * (2 * L + 1) + [("all_reduce", "sum", bs * DPL)] * L * whole_input
    assert sorted(r["backward"]) == sorted(backward), (*where, r["backward"])


@pytest.mark.slow
def test_per_layer_inputs_train_exactly():
    """World 2, the Gemma-style spelling: 3 AdamW steps within 1e-5 of the unsharded model."""
    for rank, by_kind in PARITY(2, "pli").items():
        assert list(by_kind) == ["embedded"], (rank, list(by_kind))
        _check(by_kind["embedded"], "embedded", 2, (rank, "embedded"))


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_every_per_layer_input_spelling_trains_exactly(world: int):
    kinds, job = (RUNS[1:], "pli_rest") if world == 2 else (RUNS, "pli")
    for rank, by_kind in PARITY(world, job).items():
        assert list(by_kind) == kinds, (rank, list(by_kind))
        for kind, r in by_kind.items():
            _check(r, kind, world, (rank, kind))
