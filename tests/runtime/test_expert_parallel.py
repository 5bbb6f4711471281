"""Expert parallelism (``expert_parallel=True``, ``--expert-parallel``): E/tp whole experts per rank (a block of
dim 0 of every 3-D expert weight), each rank computing only what is routed to its own experts, exact against the
unsharded model (idle experts and uneven loads included) with the same collectives as expert tensor
parallelism: the tokens are on every rank of the group, so nothing is dispatched."""
from __future__ import annotations

import os

import pytest
import torch

from autotp.capture.tracer import capture
from autotp.passes import run_passes
from autotp.analysis.experts import analyze_experts
from autotp.analysis.pairs import analyze
from autotp.errors import ShardingError
from autotp.plan.planner import check_expert_counts, make_plan
from autotp.operators.expert_ops import ExpertGrouped, ExpertIndex, ExpertOut, ExpertRows, ExpertSelect
from ranks import Launches
from moe_models import E, H, S, build, collectives
from parity_workers import pattern_parity

LAYERS = 2
WEIGHTS = {"fused_loop": ("w1", "w2", "w3"), "gathered_bmm": ("gate_up", "down")}
# which runtime operators each way of reading experts gets: W[e] in a loop (its rows masked per expert),
# W[ids] per slot, a grouped GEMM over sorted tokens
OPS = {"fused_loop": {ExpertSelect: 3 * E, ExpertRows: E, ExpertOut: E},
       "gathered_bmm": {ExpertIndex: 1}, "mixtral": {ExpertGrouped: 2 * LAYERS}}


# loops over W[e] (top-1 with a load-balancing loss, capacity-dropped tokens, a shared expert), W[ids] with
# bmm and einsum; at tp 4 one expert per rank
KINDS = {2: ["fused_loop", "fused_loop_t", "gathered_bmm", "gathered_einsum", "shared_sigmoid", "top1_aux", "capacity"],
         4: ["gathered_bmm"]}
HF_KINDS = {2: ["mixtral", "mixtral:batched_mm", "qwen2_moe", "deepseek_v3_idle"], 4: ["deepseek_v3_idle"]}


@pytest.fixture(scope="module")
def runs() -> Launches:
    """Both multi-process tests' jobs in one launch per world."""
    jobs = {world: {"spellings": (pattern_parity, KINDS[world], 3, False, "moe_models", True),
                    "hugging face": (pattern_parity, HF_KINDS[world], 3, False, "hf_moe_models", True)}
            for world in (2, 4)}
    return Launches({2: jobs[2]}, extended={4: jobs[4]}, reuse_captures=True)  # tp 4 in the extended run


def _rewritten(model, args, kwargs, tp: int):
    gm = capture(model, args, kwargs)[0]
    ep, etp = make_plan(gm, tp, expert_parallel=True), make_plan(gm, tp)
    return ep, etp, run_passes(gm, ep)


@pytest.mark.parametrize("kind", ["fused_loop", "gathered_bmm", "mixtral"])
def test_whole_experts_per_rank_with_expert_tensor_parallelisms_collectives(kind: str):
    """No process group: every expert weight cut into E/tp whole experts on dim 0, the graph reading them
    through one operator per read, and exactly the collectives of expert tensor parallelism."""
    if kind == "mixtral":
        pytest.importorskip("transformers")
        from hf_moe_models import build as hf_build

        model, args, kwargs = hf_build(kind)
        names = [f"model.layers.{i}.mlp.experts.{w}" for i in range(LAYERS) for w in ("gate_up_proj", "down_proj")]
    else:
        (model, args, _), kwargs = build(kind), {}
        names = [f"blocks.{i}.moe.{w}" for i in range(LAYERS) for w in WEIGHTS[kind]]
    ep, etp, gm = _rewritten(model, args, kwargs, 2)
    assert ep.replicated == () and ep.experts_kept == ()
    for name in names:
        shard = ep.param(name)
        assert (shard.role, shard.dim, shard.local_shape[0], shard.full_shape[0]) == ("experts", 0, E // 2, E), shard
        assert shard.local_shape[1:] == shard.full_shape[1:], shard  # each expert whole
    assert [x.top_k for x in ep.experts] == [2] * LAYERS
    assert sorted((c.kind, c.direction, c.shape) for c in ep.collectives) == \
        sorted((c.kind, c.direction, c.shape) for c in etp.collectives)
    used = [type(gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module"]
    for op, count in OPS[kind].items():  # per layer (an index reads gate_up and down: one operator, two calls)
        assert used.count(op) == count * (1 if kind == "mixtral" else LAYERS) * (2 if op is ExpertIndex else 1), \
            (op, used)


@pytest.mark.extended
def test_experts_as_modules_or_with_late_biases_keep_expert_tensor_parallelism_and_say_why():
    """Experts as a ModuleList of Linears are cut 1/tp each (whole experts need one 3-D parameter per
    projection), and so are experts whose per-expert bias is added after the down-projection (GPT-OSS); a tp
    that does not divide the experts is refused with the sizes."""
    model, args, _ = build("list_masked")
    plan = make_plan(capture(model, args, {})[0], 2, expert_parallel=True)
    assert [m for m, _ in plan.experts_kept] == [f"blocks.{i}.moe.experts" for i in range(LAYERS)]
    assert "separate modules" in plan.experts_kept[0][1] and plan.param("blocks.0.moe.experts.0.w1.weight").role == "column"
    model, args, _ = build("fused_loop")
    gm = capture(model, args, {})[0]
    facts = analyze_experts(gm, analyze(gm, 2))  # (this model's 4 heads refuse tp 8 before its experts would)
    with pytest.raises(ShardingError, match=r"blocks.0.moe has 4 experts, which tp=8 does not divide") as err:
        check_expert_counts(facts, 8)
    assert "divides 4" in err.value.hint
    pytest.importorskip("transformers")
    from hf_moe_models import build as hf_build

    model, args, kwargs = hf_build("gpt_oss")
    plan = make_plan(capture(model, args, kwargs)[0], 2, expert_parallel=True)
    assert len(plan.experts_kept) == LAYERS and "down_proj_bias" in plan.experts_kept[0][1], plan.experts_kept


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_expert_parallel_is_exact_with_one_all_reduce_per_layer(runs, world: int):
    """3 AdamW steps within 1e-5 of the unsharded model, E/tp whole experts per rank, and the collectives of
    expert tensor parallelism (forward one all-reduce per attention and MoE layer; backward one entering
    each and the routing weights once per layer), for loops over W[e] (top-1 with a load-balancing loss,
    capacity-dropped tokens, a shared expert), W[ids] with bmm and einsum."""
    results = runs(world, "spellings")
    for rank, by_kind in results.items():
        assert list(by_kind) == KINDS[world]
        for kind, r in by_kind.items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert r["replicated"] == [] and r["unexplained"] == [], (kind, r)
            assert len(r["experts"]) == LAYERS * (2 if kind == "gathered_bmm" else 3), r["experts"]
            assert abs(r["fraction"] - 1 / world) < 0.01, (kind, r["fraction"])
            forward, backward, _ = collectives(kind, LAYERS)
            assert sorted(r["forward"]) == sorted(forward), kind
            assert sorted(r["backward"]) == sorted(backward), (kind, r["backward"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_hugging_face_experts_whole_per_rank_with_idle_experts(runs, world: int):
    """Mixtral (grouped GEMM; batched_mm), Qwen2-MoE (a shared expert) and DeepSeek-V3 with its routing bias
    ruling out experts 2 and 3 (at tp 2 rank 1 holds only experts that get no tokens; at tp 4 ranks 2 and 3):
    exact, whole experts per rank, the collectives of expert tensor parallelism."""
    pytest.importorskip("transformers")
    import hf_moe_models

    model, args, kwargs = hf_moe_models.build("deepseek_v3_idle")
    model(*args, **kwargs).loss.backward()
    grad = model.model.layers[1].mlp.experts.gate_up_proj.grad
    assert grad[:2].abs().sum() > 0 and torch.count_nonzero(grad[2:]) == 0  # experts 2 and 3 are idle
    results = runs(world, "hugging face")
    bsh, rows = 2 * 8 * 64, 2 * 8
    for rank, by_kind in results.items():
        assert list(by_kind) == HF_KINDS[world]
        for kind, r in by_kind.items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert r["replicated"] == [] and r["unexplained"] == [], (kind, r)
            assert len(r["experts"]) == 2 * (1 if kind.startswith("deepseek") else LAYERS), r["experts"]
            layers = 2 * LAYERS + 1
            assert sorted(c for c in r["forward"] if c[2] >= bsh) == [("all_reduce", "sum", bsh)] * layers, kind
            router = [("all_reduce", "sum", rows * 2)] * (1 if kind.startswith("deepseek") else LAYERS)
            assert [c for c in r["backward"] if c[2] == rows * 2] == router, (kind, r["backward"])


def test_autotp_plan_shows_whole_experts_per_rank(tmp_path):
    """``autotp plan --expert-parallel``: the experts' role (E/tp whole per rank) and, per layer, that nothing
    is dispatched, beside what an all-to-all dispatch would move (b·s·k·h each way)."""
    from typer.testing import CliRunner

    from autotp.cli.main import app
    from ranks import ROOT

    model_py = tmp_path / "moe_model.py"
    model_py.write_text(f"import sys\nsys.path.insert(0, {os.path.join(ROOT, 'tests', 'support')!r})\n"
                        "from moe_models import build\n"
                        "def build_model():\n    return build('fused_loop')[0]\n"
                        "def example_batch():\n    return build('fused_loop')[1]\n")
    result = CliRunner().invoke(app, ["plan", str(model_py), "--tp", "2", "--expert-parallel"],
                                env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines() if line.count("│") > 5}
    assert "experts (2 of 4 whole per rank)" in rows["blocks.0.moe"] and "[2, 32, 64]" in rows["blocks.0.moe"]
    table = [line for line in result.output.splitlines() if line.startswith("│ blocks.0.moe ") and "│" in line]
    slots = 2 * S * 2  # b·s·k
    assert any("2 of 4" in line and f"{slots:,}" in line for line in table), table
    assert f"{slots * H:,}" in result.output and "every rank holds the tokens" in result.output
