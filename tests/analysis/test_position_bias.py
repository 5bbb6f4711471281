"""A relative-position bias looked up once and added to every layer's scores (tests/support/position_bias_models.py:
T5's ``nn.Embedding`` spelling, CPM-Ant's raw table with ``F.embedding``, and Hugging Face's CPM-Ant): the
table's heads are a column of the first layer's attention pair, cut by heads; every later layer's region reads
the bias as that pair left it, its own heads'. No collective of its own, forward or backward (each rank's
slice of the table gets the gradient of its own heads from every layer). CPM-Ant's attention was left whole in
every layer ('sharded value contiguous escapes the region', the bias cut for the first layer and read by the
second). The plans are checked in the fast tier; training is the extended run."""
from __future__ import annotations

import math

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from pattern_models import NH, H, S
from position_bias_models import BUCKETS, KINDS, build
from ranks import Launches

# the table, the attention projections and the output projection of each kind's layer 0
NAMES = {"table": ("rel.weight", "blocks.{i}.attn.{p}.weight", ("q", "k", "v"), "o"),
         "raw": ("table", "blocks.{i}.attn.{p}.weight", ("q", "k", "v"), "o"),
         "cpmant": ("cpmant.position_bias.relative_attention_bias",
                    "cpmant.encoder.layers.{i}.self_att.self_attention.{p}.weight",
                    ("project_q", "project_k", "project_v"), "attention_out")}
ROWS = {"table": BUCKETS, "raw": BUCKETS, "cpmant": 4 * 4 + 32}  # CPM-Ant: segment pairs + position buckets


@pytest.mark.parametrize("kind", KINDS)
def test_the_bias_is_cut_by_heads_once_for_every_layer(kind: str):
    """Nothing replicated or whole, at most 1/tp + 0.12 of the parameters per rank; the table column-parallel by
    heads, every layer's attention cut by heads; per layer only attention's and the MLP's all-reduce each way."""
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    table, proj, columns, out = NAMES[kind]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        params = dict(plan.params)
        assert (params[table].role, params[table].local_shape) == ("column", (ROWS[kind], NH // tp)), params[table]
        for i in range(2):
            for p in columns:
                assert params[proj.format(i=i, p=p)].local_shape == (H // tp, H), (tp, i, p)
            assert params[proj.format(i=i, p=out)].local_shape == (H, H // tp), (tp, i)
        held = sum(math.prod(params[n].local_shape) if n in params else p.numel() for n, p in model.named_parameters())
        assert held / sum(p.numel() for p in model.parameters()) <= 1 / tp + 0.12, (tp, held)
        # the bias's pair is layer 0's attention: no f for the table (its ids need no gradient), no all-reduce
        # of the (b, heads, s, s) bias (it was vocab-parallel: one per call)
        for i in range(2):
            attn = proj.format(i=i, p="").rsplit(".", 2)[0]
            ways = sorted((c.op, c.direction) for c in plan.collectives if c.module == attn)
            assert ways == [("sum", "backward"), ("sum", "forward")], (tp, attn, ways)
        assert not [c for c in plan.collectives if len(c.shape) == 4], plan.collectives

PARITY = Launches({}, extended={w: {"bias": (pattern_parity, list(KINDS), 3, False, "position_bias_models")}
                                for w in (2, 4)})


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_the_bias_trains_exactly(world: int):
    """3 AdamW steps: loss and gradients within 1e-5, parameters within 1e-5 (CPM-Ant 1e-4, as in
    tests/analysis/test_hf_families.py), fully sharded; the hand-written LMs with Megatron's all-reduces of b·s·h
    (per layer attention's and the MLP's each way, the embedding's forward, the head's f backward) and the
    loss's three of b·s: none for the bias."""
    bsh, bs = 2 * S * H, 2 * S
    for rank, by_kind in PARITY(world, "bias").items():
        assert list(by_kind) == list(KINDS), (rank, list(by_kind))
        for kind, r in by_kind.items():
            assert_exact(r, (rank, kind), param_tol=1e-4 if kind == "cpmant" else 1e-5)
            assert_fully_sharded(r, world, (rank, kind))
            if kind == "cpmant":
                continue
            assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * 5 + [("all_reduce", "max", bs)]
                                                  + [("all_reduce", "sum", bs)] * 2), (rank, kind, r["forward"])
            assert sorted(r["backward"]) == [("all_reduce", "sum", bsh)] * 5, (rank, kind, r["backward"])
