"""Experts that take their tokens split by the routing's counts and joined again (tests/support/token_split_models.py:
two hand-written spellings and Hugging Face's JetMoE), cut as Megatron's expert tensor parallelism cuts experts:
every expert's up-projection by its output features (gate | up per segment of JetMoE's fused ``(E, 2·I, h)``),
its down-projection by its input features, one all-reduce of the router-weighted combine per layer; backward one
of the layer's input (where the tokens are gathered from) and one of the routing weights. The counts, read at run
time, size the row dim of the split and the join, which no rank cuts: no size changes. Each expert's
down-projection reads its piece of the one value all the up-projections' pieces are joined into, so the
down-projections are the rows of one pair (they were left whole: 'no row-parallel matmul consumes it sharded').

JetMoE's attention, a mixture of attention heads (the query projection and the output projection per expert,
``k`` slots of ``n_kv`` query heads per token, one key | value projection every slot shares, repeated
head-minor), is cut by kv heads as grouped-query attention whose kv heads are repeated head-minor: rank r holds
its kv heads and, in each slot, the query heads that read them (it was left whole: 'cat_1 has a size known only
at run time', a size of the token dim, which no rank cuts). With 2 kv heads at tp 4 no such cut exists (a rank
would hold half a head of each slot): attention stays whole, with that reason."""
from __future__ import annotations

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from pattern_models import H, S
from ranks import Launches
from token_split_models import E, HF, I, SPELLINGS, build

_GRAPHS: dict[str, object] = {}


def _graph(kind: str):
    """One capture per kind for the module's tests (the plan reads it, never changes it)."""
    if kind not in _GRAPHS:
        model, args, kwargs = build(kind)
        _GRAPHS[kind] = capture(model, args, kwargs)[0]
    return _GRAPHS[kind]


def _moe_collectives(plan, module: str) -> list[tuple[str, str]]:
    return sorted((c.direction, c.shape[-1]) for c in plan.collectives if c.module == module)


@pytest.mark.parametrize("kind", SPELLINGS)
def test_token_split_experts_are_cut_per_expert(kind: str):
    gm = _graph(kind)
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), (tp, plan.replicated)
        assert [w.name for w in plan.whole] == [f"blocks.{i}.moe.router.weight" for i in range(2)], (tp, plan.whole)
        params = {n: (s.role, s.dim, [g.size for g in s.segments], s.local_shape) for n, s in plan.params
                  if n.startswith("blocks.0.moe.")}
        if kind == "fused":  # gate | up per segment of each expert's rows, the down-projection by its columns
            assert params == {"blocks.0.moe.w_in": ("column", 1, [I, I], (E, 2 * I // tp, H)),
                              "blocks.0.moe.w_out": ("row", 2, [I], (E, H, I // tp))}, (tp, params)
        else:  # weights as [E, in, out]
            assert params == {"blocks.0.moe.w_gate": ("column", 2, [I], (E, H, I // tp)),
                              "blocks.0.moe.w_up": ("column", 2, [I], (E, H, I // tp)),
                              "blocks.0.moe.w_down": ("row", 1, [I], (E, I // tp, H))}, (tp, params)
        # forward the combine's all-reduce (b·s, h); backward the tokens' (b·s, h) and the routing weights' (b·s·k)
        assert _moe_collectives(plan, "blocks.0.moe") == sorted(
            [("backward", "2*s85*s95"), ("backward", str(H)), ("forward", str(H))]), (tp, plan.collectives)
        # expert parallelism: E/tp whole experts per rank, every expert's down-projection a row of the one pair
        ep = make_plan(gm, tp, expert_parallel=True)
        assert ep.experts_kept == () and ep.replicated == (), (tp, ep.experts_kept, ep.replicated)
        assert {n: (s.role, s.local_shape[0]) for n, s in ep.params if n.startswith("blocks.0.moe.")} == \
            {n: ("experts", E // tp) for n in params}, (tp, ep.params)
        local = sum(_numel(s.local_shape) for _, s in plan.params)
        full = sum(p.numel() for p in build(kind)[0].parameters())
        replicated = full - sum(_numel(s.full_shape) for _, s in plan.params)
        assert (local + replicated) / full <= 1 / tp + 0.12, (tp, (local + replicated) / full)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_jetmoe_is_cut_by_kv_heads_and_experts():
    """JetMoE (2 kv heads): attention and the MLP cut at tp 2; at tp 4 its 2 kv heads, repeated head-minor to its
    slots, fewer than the ranks: attention whole with the reason, the MLP cut."""
    gm = _graph("jetmoe")
    a = "model.layers.0.self_attention"
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        params = {n: (s.role, s.local_shape) for n, s in plan.params if n.startswith("model.layers.0.")}
        assert params["model.layers.0.mlp.input_linear.weight"] == ("column", (E, 256 // tp, 64)), (tp, params)
        assert params["model.layers.0.mlp.output_linear.weight"] == ("row", (E, 64, 128 // tp)), (tp, params)
        gaps = [w.name for w in plan.whole if not w.reason.startswith("router kept whole")]
        if tp == 2:
            assert plan.replicated == () and gaps == [], (plan.replicated, gaps)
            assert params[f"{a}.experts.input_linear.weight"] == ("column", (E, 16, 64)), params
            assert params[f"{a}.experts.output_linear.weight"] == ("row", (E, 64, 16)), params
            assert params[f"{a}.kv_proj.weight"] == ("column", (32, 64)), params
            # with expert parallelism the MLP's experts are whole per rank; attention's share their pair with kv_proj,
            # cut by heads: they keep expert tensor parallelism, with the reason
            ep = make_plan(gm, tp, expert_parallel=True)
            assert dict(ep.experts_kept) == {f"model.layers.{i}.self_attention": (
                f"its experts share a column→row pair with model.layers.{i}.self_attention.kv_proj.weight, not an "
                "expert's weight, which is cut by columns or rows") for i in range(2)}, ep.experts_kept
            assert ep.param("model.layers.0.mlp.input_linear.weight").role == "experts"
        else:
            assert [m for m, _ in plan.replicated] == [f"model.layers.{i}.self_attention" for i in range(2)]
            assert all("2 heads are not divisible by tp=4" in why for _, why in plan.replicated), plan.replicated


def test_jetmoe_with_4_kv_heads_is_fully_sharded():
    gm = _graph("jetmoe_kv4")
    a = "model.layers.0.self_attention"
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        gaps = [w.name for w in plan.whole if not w.reason.startswith("router kept whole")]
        assert plan.replicated == () and gaps == [], (tp, plan.replicated, gaps)
        params = {n: (s.role, s.local_shape) for n, s in plan.params if n.startswith(a)}
        assert params == {f"{a}.experts.input_linear.weight": ("column", (E, 64 // tp, 64)),
                          f"{a}.experts.output_linear.weight": ("row", (E, 64, 64 // tp)),
                          f"{a}.kv_proj.weight": ("column", (128 // tp, 64))}, (tp, params)


RUNS = {2: [*SPELLINGS, *HF], 4: [*SPELLINGS, "jetmoe_kv4"]}
EP = [*SPELLINGS, "jetmoe"]
PARITY = Launches({2: {"default": (pattern_parity, ["fused"], 3, False, "token_split_models")}},
                  extended={2: {"all": (pattern_parity, RUNS[2], 3, False, "token_split_models"),
                                "ep": (pattern_parity, EP, 3, False, "token_split_models", True)},
                            4: {"all": (pattern_parity, RUNS[4], 3, False, "token_split_models")}})


def _check(r: dict, world: int, kind: str, rank: int) -> None:
    # the families' gradients agree within 1e-6; AdamW's step normalizes near-zero ones (tests/analysis/test_hf_families.py)
    assert_exact(r, (rank, kind), param_tol=1e-4 if kind in HF else 1e-5)
    if kind == "jetmoe" and world == 4:
        return
    assert_fully_sharded(r, world, (rank, kind))
    if kind in SPELLINGS:
        bsh, bs = 2 * S * H, 2 * S
        # forward per layer attention's and the experts' combine (b·s·h), the embedding's, the loss's 3 (b·s);
        # backward per layer attention's f, the experts' tokens (b·s·h) and routing weights (b·s·k), the head's
        assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * 5 + [("all_reduce", "max", bs)]
                                              + [("all_reduce", "sum", bs)] * 2), (rank, kind, r["forward"])
        assert sorted(r["backward"]) == sorted([("all_reduce", "sum", bsh)] * 5 + [("all_reduce", "sum", 2 * bs)] * 2), \
            (rank, kind, r["backward"])


@pytest.mark.slow
def test_token_split_experts_train_exactly():
    """3 AdamW steps of ``fused`` at world 2: loss, gradients and parameters within 1e-5, fully sharded, with
    Megatron's all-reduces."""
    for rank, by_kind in PARITY(2, "default").items():
        _check(by_kind["fused"], 2, "fused", rank)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_token_split_experts_and_jetmoe_train_exactly(world: int):
    """Every spelling and JetMoE at world 2 (JetMoE with 4 kv heads at world 4): 3 AdamW steps exact, fully
    sharded (the hand-written ones with Megatron's all-reduces)."""
    for rank, by_kind in PARITY(world, "all").items():
        assert list(by_kind) == RUNS[world], (rank, list(by_kind))
        for kind, r in by_kind.items():
            _check(r, world, kind, rank)


@pytest.mark.slow
@pytest.mark.extended
def test_token_split_experts_train_exactly_with_whole_experts_per_rank():
    """``expert_parallel=True`` at world 2: each rank holds 2 whole experts of each MLP (JetMoE's attention keeps
    expert tensor parallelism); 3 AdamW steps exact, the same all-reduces as expert tensor parallelism."""
    for rank, by_kind in PARITY(2, "ep").items():
        assert list(by_kind) == EP, (rank, list(by_kind))
        for kind, r in by_kind.items():
            _check(r, 2, kind, rank)
            moe = {n for n in r["experts"]}
            assert moe and all(".mlp." in n or ".moe." in n for n in moe), (rank, kind, r["experts"])
