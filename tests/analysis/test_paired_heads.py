"""Attention whose heads are not read one by one (tests/support/paired_head_models.py).

A dynamic mask computed from the whole ``v`` by a ``(n_kv·d) -> n_kv`` linear (Doge's, and two hand-written
spellings): cut by heads, that linear is row-parallel inside attention's region, one all-reduce of its
``b·s·n_kv`` gates forward and one backward, each rank slicing its own heads' gates; ``A`` read on the way enters
through its own f. It was left replicated at tp 2 and raised at tp 4 (2 kv heads, fewer than tp: each block's
partial sum is now counted once).

Differential attention (DiffLlama's, and two hand-written spellings): head ``i`` paired with head ``i + n/2`` by a
chunk or split of the heads after attention; q, k and v are cut per half so that a pair stays on one rank. It was
left replicated (v cut inside a head, then the chunk of a contiguous cut). Extended run (captures of seconds
each)."""
from __future__ import annotations

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from paired_head_models import GATES, PAIRS, PD, PH, build
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from pattern_models import H, HD, S
from ranks import Launches
from shared_graphs import SHARED, spelling

NKV = {"gate_linear": 2, "gate_matmul": 4}


@pytest.mark.extended
@pytest.mark.parametrize("kind", [*GATES, "doge"])
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


@pytest.mark.extended
@pytest.mark.parametrize("kind", PAIRS)
def test_paired_heads_are_cut_per_half(kind: str):
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    rows = PH * PD // (2 if kind == "diff_chunk" else 1)
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        params = dict(plan.params)
        for w in "qkv":  # rank r holds the r-th slice of each half: heads i and i + n/2 together
            cut = params[f"blocks.0.attn.{w}.weight"]
            assert [(g.size, g.parts) for g in cut.segments] == [(PH * PD // 2, tp)] * 2, (tp, w, cut)
        o = params["blocks.0.attn.o.weight"]
        assert (o.role, [(g.size, g.parts) for g in o.segments]) == ("row", [(rows, tp)]), (tp, o)
        sums = sorted((c.direction, c.shape) for c in plan.collectives if c.module == "blocks.0.attn")
        # Megatron's two all-reduces of b·s·h, and λ's f (a scalar read by every head)
        assert [d for d, _ in sums] == ["backward", "backward", "forward"] and sums[0][1] == (), (tp, sums)


@pytest.mark.extended
def test_diffllama_pairs_heads_and_names_tp_4():
    model, args, kwargs = build("diffllama")
    gm = capture(model, args, kwargs)[0]
    plan = make_plan(gm, 2)
    assert plan.replicated == () and plan.whole == (), (plan.replicated, plan.whole)
    params = dict(plan.params)
    attn = "model.layers.0.self_attn"
    assert [(g.size, g.parts) for g in params[f"{attn}.q_proj.weight"].segments] == [(32, 2)] * 2
    # one kv head per half: each half's head on both ranks (Megatron's kv copies), never cut inside the head
    for w in ("k_proj", "v_proj"):
        assert [(g.size, g.parts) for g in params[f"{attn}.{w}.weight"].segments] == [(HD, 1)] * 2, w
    # 4 heads are 2 pairs: fewer than 4 ranks, no exact cut; attention is left whole with the reason
    plan = make_plan(gm, 4)
    assert sorted(m for m, _ in plan.replicated) == [attn, "model.layers.1.self_attn"], plan.replicated
    assert all("tp=4" in why for _, why in plan.replicated), plan.replicated
    # 2 kv heads in each half of v, tiled head-minor by its repeat: q, k and v cut per half at tp 2
    model, args, kwargs = build("diffllama_8")
    plan = make_plan(capture(model, args, kwargs)[0], 2)
    assert plan.replicated == () and plan.whole == (), (plan.replicated, plan.whole)
    params = dict(plan.params)
    for w, n in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
        assert [(g.size, g.parts) for g in params[f"{attn}.{w}.weight"].segments] == [(n, 2)] * 2, w


@SHARED
def test_diffllama_at_tp_4_names_its_pairs_of_heads():
    """DiffLlama of 4 heads (2 kv heads) at tp 4: its heads are 2 pairs (head i with head i + 2, read by a chunk of
    the heads after attention), fewer than the ranks, and a pair never leaves its rank: attention stays whole with
    that reason, where it said only that 2 heads are not divisible by tp=4 (the repeat of one kv head per half of v
    failed before the chunk was met). At tp 2 the pairs are cut."""
    _, _, _, gm = spelling("paired_head_models", "diffllama")
    assert make_plan(gm, 2).replicated == ()
    plan = make_plan(gm, 4)
    attn = [f"model.layers.{i}.self_attn" for i in range(2)]
    assert [m for m, _ in plan.replicated] == attn, plan.replicated
    for m, why in plan.replicated:
        assert why.startswith("heads read in 2 equal pieces and paired across them") and \
            f"{m}.q_proj's 2 pairs of heads (head i with head i + 2) are fewer than tp=4" in why, why


RUNS = [*GATES, "doge", *PAIRS, "diffllama", "diffllama_8"]
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
            if kind.startswith("diffllama") and world == 4:  # 2 pairs (2 kv heads per half) for 4 ranks: whole
                assert sorted(m for m, _ in r["replicated"]) == [f"model.layers.{i}.self_attn" for i in (0, 1)], r
                continue
            assert_fully_sharded(r, world, (rank, kind))
            if kind in PAIRS:  # Megatron's step, and λ's f per layer (one element)
                assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * 5 + [("all_reduce", "max", bs)]
                                                      + [("all_reduce", "sum", bs)] * 2), (rank, kind, r["forward"])
                assert sorted(r["backward"]) == sorted([("all_reduce", "sum", bsh)] * 5
                                                       + [("all_reduce", "sum", 1)] * 2), (rank, kind, r["backward"])
            if kind not in GATES:
                continue
            gates, nkv = bs * NKV[kind], NKV[kind]
            assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * 5 + [("all_reduce", "sum", gates)] * 2
                                                  + [("all_reduce", "max", bs)] + [("all_reduce", "sum", bs)] * 2), \
                (rank, kind, r["forward"])
            # kv heads fewer than ranks: the gradients of k's, v's and dt's blocks are summed over their copies
            copies = [HD * H] * 4 + [nkv * HD] * 2 if world > nkv else []  # one kv head per block
            assert sorted(r["backward"]) == sorted([("all_reduce", "sum", n) for n in [bsh] * 5 + [gates] * 2
                                                    + [nkv] * 2 + copies]), (rank, kind, r["backward"])
