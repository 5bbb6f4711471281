"""Attention whose heads are not read one by one (tests/support/paired_head_models.py): a dynamic mask computed
from the whole ``v`` by a ``(n_kv·d) -> n_kv`` linear (Doge's, and two hand-written spellings). Cut by heads, that
linear is row-parallel inside attention's region: one all-reduce of its ``b·s·n_kv`` gates forward and one
backward, each rank slicing its own heads' gates; ``A`` read on the way enters through its own f. It was left
replicated at tp 2 and raised at tp 4 (2 kv heads, fewer than tp: each block's partial sum is now counted once).
Extended run (captures of seconds each)."""
from __future__ import annotations

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from paired_head_models import HAND, build
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from pattern_models import H, HD, S
from ranks import Launches

NKV = {"gate_linear": 2, "gate_matmul": 4}


@pytest.mark.extended
@pytest.mark.parametrize("kind", [*HAND, "doge"])
def test_gate_of_all_heads_is_row_parallel_inside_attention(kind: str):
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    attn = "model.layers.0.self_attn" if kind == "doge" else "blocks.0.attn"
    nkv = NKV.get(kind, 2)
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        params = dict(plan.params)
        dt = params[f"{attn}.dt_proj.weight" if kind == "doge" else f"{attn}.dt.weight"]
        # rows cut by kv heads; with fewer kv heads than ranks each block is held by tp / n_kv of them
        assert (dt.role, dt.dim, dt.local_shape) == ("row", 1, (nkv, nkv * HD // min(tp, nkv))), (tp, dt)
        sums = sorted((c.direction, c.shape[-1]) for c in plan.collectives if c.module == attn)
        # o's all-reduce and the gates' forward; f at the input, the gates' and A's (n_kv,) backward (and Doge's
        # per-head q and k norms' weights, (d,))
        norms = [("backward", str(HD))] * 2 if kind == "doge" else []
        assert sums == sorted([("forward", str(H)), ("forward", str(nkv)), ("backward", str(H)),
                               ("backward", str(nkv)), ("backward", str(nkv)), *norms]), (tp, sums)


RUNS = [*HAND, "doge"]
PARITY = Launches({}, extended={w: {"paired": (pattern_parity, RUNS, 3, False, "paired_head_models")}
                                for w in (2, 4)})


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_gated_attention_trains_exactly(world: int):
    """3 AdamW steps: loss, gradients and parameters within 1e-5, every block cut, at most 1/tp + 0.12 of the
    parameters per rank; the hand-written LMs' forward is Megatron's plus one all-reduce of b·s·n_kv gates per
    layer, their backward Megatron's plus the gates' all-reduce and A's (n_kv)."""
    bsh, bs = 2 * S * H, 2 * S
    for rank, by_kind in PARITY(world, "paired").items():
        assert list(by_kind) == RUNS, (rank, list(by_kind))
        for kind, r in by_kind.items():
            assert_exact(r, (rank, kind))
            assert_fully_sharded(r, world, (rank, kind))
            if kind == "doge":
                continue
            gates, nkv = bs * NKV[kind], NKV[kind]
            assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * 5 + [("all_reduce", "sum", gates)] * 2
                                                  + [("all_reduce", "max", bs)] + [("all_reduce", "sum", bs)] * 2), \
                (rank, kind, r["forward"])
            # kv heads fewer than ranks: the gradients of k's, v's and dt's blocks are summed over their copies
            copies = [HD * H] * 4 + [nkv * HD] * 2 if world > nkv else []  # one kv head per block
            assert sorted(r["backward"]) == sorted([("all_reduce", "sum", n) for n in [bsh] * 5 + [gates] * 2
                                                    + [nkv] * 2 + copies]), (rank, kind, r["backward"])
