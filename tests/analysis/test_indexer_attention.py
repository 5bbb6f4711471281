"""Latent attention whose keys a sparse-attention indexer chooses (tests/support/indexer_models.py): the latent
down-projections and the indexer kept whole by design, the up-projections (and a per-head gate) cut by heads,
the output projection row-parallel; exact at tp 2 and 4 with Megatron's collectives and none for the indexer.

The indexer reaches the loss only through the indices it chooses, so it gets no gradient; kept whole, every
rank computes the single-device choice from the same replicated inputs with no communication (cut by its
heads, its summed (b, s, s) scores would need an all-reduce before the choice)."""
from __future__ import annotations

import pytest
import torch

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from indexer_models import HF_KINDS, WRITTEN_KINDS, build
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from ranks import Launches
from tiers import core_first

LAYERS = 2


@pytest.fixture(scope="module")
def written():
    """Each spelling captured once for the module's tests, when one first asks for it."""
    graphs: dict[str, object] = {}

    def get(kind: str):
        if kind not in graphs:
            model, args, kwargs = build(kind)
            graphs[kind] = capture(model, args, kwargs)[0]
        return graphs[kind]
    return get


def _roles(plan, block: str) -> dict[str, object]:
    """Each weight of ``block`` by what the plan does with it: its role when cut, else its reason's first words."""
    cut = {n[len(block) + 1:]: s.role for n, s in plan.params if n.startswith(block + ".")}
    whole = {w.name[len(block) + 1:]: w.reason.split(":")[0] for w in plan.whole if w.name.startswith(block + ".")}
    return {**cut, **whole}


@pytest.mark.parametrize("kind", core_first(WRITTEN_KINDS, ["written_no_grad"]))
def test_the_indexer_and_the_latents_are_whole_by_design_and_attention_is_cut_by_heads(written, kind: str):
    gm = written(kind)
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), (tp, plan.replicated)
        for i in range(LAYERS):
            roles = _roles(plan, f"blocks.{i}.attn")
            expect = {"q_a.weight": "down-projection kept whole", "kv_a.weight": "down-projection kept whole",
                      "q_b.weight": "column", "kv_b.weight": "column", "o.weight": "row",
                      "indexer.wq.weight": "indexer kept whole", "indexer.wk.weight": "indexer kept whole",
                      "indexer.weights.weight": "indexer kept whole",
                      "gate.weight": "column"}  # one sigmoid per head: cut with the heads it weights
            assert {k: v for k, v in roles.items() if k.endswith("weight") and "norm" not in k} == expect, \
                (tp, i, roles)
        # the gate reads x with its gradient, not through a detach of the no-grad indexer's x.to(x.dtype): its
        # input's gradient is summed by one f (b·s·h) per layer
        pair = next(p for p in plan.pairs if p.module == "blocks.0.attn" and p.columns)
        gate = pair.columns[pair.column_weights.index("blocks.0.attn.gate.weight")]
        (x,) = [n.args[0] for n in gm.graph.nodes if n.name == gate]
        assert x.target is not torch.ops.aten.detach.default and x.name in pair.enter, (x, pair.enter)
        why = next(w.reason for w in plan.whole if w.name == "blocks.0.attn.indexer.wq.weight")
        assert why.startswith("indexer kept whole: its 24→16 linear reaches the loss and the outputs only through "
                              f"the integer or boolean values of {'topk' if kind == 'written_no_grad' else 'argsort'}"), why


@pytest.mark.extended
@pytest.mark.parametrize("kind", HF_KINDS)
def test_the_hugging_face_indexed_families_are_planned_fully_sharded(kind: str):
    """DeepSeek-V3.2, GLM-MoE-DSA, Dots3-Note and HY-V4 (a capture of tens of seconds each: extended run): nothing
    replicated, the indexer's three projections and the latent down-projections whole by design."""
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), (tp, plan.replicated)
        whole = {w.name: w.reason.split(":")[0] for w in plan.whole}
        # (HY-V4's hyper-connections: each mixing linear maps the 4 streams to 8 weights, a gate)
        assert set(whole.values()) <= {"indexer kept whole", "down-projection kept whole", "router kept whole",
                                       "gate kept whole"}, whole
        assert whole["model.layers.0.self_attn.indexer.wq_b.weight"] == "indexer kept whole", whole
        cut = dict(plan.params)
        for name, role in (("q_b_proj", "column"), ("kv_b_proj", "column"), ("o_proj", "row")):
            assert cut[f"model.layers.0.self_attn.{name}.weight"].role == role, (tp, name)


RUN = {2: list(HF_KINDS + WRITTEN_KINDS), 4: list(HF_KINDS + WRITTEN_KINDS)}
RUNS = Launches({}, extended={w: {"indexed": (pattern_parity, RUN[w], 3, False, "indexer_models")} for w in (2, 4)})


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_indexed_latent_attention_trains_exactly_with_megatron_collectives(world: int):
    """Loss, gradients and parameters after 3 AdamW steps within 1e-5 of one device, at most 1/tp + 0.12 of
    the parameters per rank. Forward: attention's and the MLP's (or MoE layer's) all-reduce per layer and the
    embedding's (b·s·h), nothing for the indexer; HY-V4's MoE layer too reduces its (b, s, h) output, before
    its hyper-connection writes it into the 4 residual streams (not 4·b·s·h after). Backward: f on the q and kv
    latents per layer (b·s·24, b·s·16; the Hugging Face families also on the rotary key head, b·s·8, and the
    routing weights, b·s·2), b·s·h entering the MLP per layer (and the per-head gate of the block input) and the
    LM head."""
    for rank, by_kind in RUNS(world, "indexed").items():
        assert list(by_kind) == RUN[world], (rank, list(by_kind))
        for kind, r in by_kind.items():
            where = (rank, kind)
            assert_exact(r, where)
            assert_fully_sharded(r, world, where)
            rows = 2 * (8 if kind in HF_KINDS else 12)
            bsh = rows * 64
            big = sorted(c for c in r["forward"] if c[2] >= bsh)
            assert big == [("all_reduce", "sum", bsh)] * (2 * LAYERS + 1), (where, r["forward"])
            assert sorted(c for c in r["forward"] if c[2] < bsh) == sorted(
                [("all_reduce", "max", rows)] + [("all_reduce", "sum", rows)] * 2), (where, r["forward"])
            small = sorted(c for c in r["backward"] if c[2] != bsh)
            entering = len([c for c in r["backward"] if c[2] == bsh])
            if kind in HF_KINDS:
                latent = [("all_reduce", "sum", rows * n) for n in (24, 16, 8)] * LAYERS
                router = [("all_reduce", "sum", rows * 2)]  # the one MoE layer's routing weights
                # a per-head gate reading the block input (g_proj, gate_proj) enters at it
                gate = LAYERS if kind in ("dots3_note_text", "hy_v4") else 0
                assert small == sorted(latent + router), (where, small)
                assert entering == LAYERS + 1 + gate, (where, r["backward"])
            else:
                assert small == sorted([("all_reduce", "sum", rows * n) for n in (24, 16)] * LAYERS), (where, small)
                assert entering == LAYERS + 1 + LAYERS, (where, r["backward"])  # the gate reads the block input
