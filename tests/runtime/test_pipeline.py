"""Pipeline parallelism: stages cut from the captured graph, run by torch.distributed.pipelining.

Tiers: the stage planner and the schedule checks (pure); the stage split on a captured graph (structural,
no process group); gloo parity against the unsharded model and resume across pipeline sizes (slow).
"""
from __future__ import annotations

from collections import Counter

import pytest

from autotp.capture.tracer import capture
from autotp.distributed.data_parallel import FSDPConfig
from autotp.errors import PipelineError
from autotp.parallel.pipeline import check_pipeline, stage_ranks
from autotp.passes import run_passes, split_stages
from autotp.plan.planner import make_plan
from autotp.plan.stages import StageRequest, _split
from autotp.operators.stages import wire_stages
from ranks import launch, reusing
from pipeline_models import MODELS


# -- pure: schedules, placement, balance ----------------------------------------------------------------
@pytest.mark.parametrize("pp, schedule, v, m, batch, message", [
    (2, "Zigzag", None, 2, 8, "unknown pipeline schedule 'Zigzag'"),
    (2, "GPipe", 2, 2, 8, "GPipe runs one stage per rank, and virtual_stages is 2"),
    (2, "Interleaved1F1B", 1, 2, 8, "Interleaved1F1B interleaves several stages per rank, and virtual_stages is 1"),
    (2, "ZBVZeroBubble", 3, 2, 8, "ZBVZeroBubble places exactly 2 stages per rank (a V), and virtual_stages is 3"),
    (4, "1F1B", None, 2, 8, "1F1B needs at least as many micro-batches as pipeline ranks: microbatches 2 < pp 4"),
    (2, "1F1B", None, 3, 8, "3 micro-batches do not divide the batch of 8"),
    (2, "1F1B", None, 0, 8, "microbatches must be an integer >= 1, got 0"),
])
def test_bad_pipeline_sizes_are_named(pp, schedule, v, m, batch, message):
    with pytest.raises(PipelineError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_pipeline(pp, schedule, v, m, batch)


def test_schedule_defaults_and_names():
    assert check_pipeline(2, "1f1b", None, 2, 8) == ("1F1B", 1)  # any case
    assert check_pipeline(2, "Interleaved1F1B", None, 2, 8) == ("Interleaved1F1B", 2)
    assert check_pipeline(4, "GPipe", None, 2, 8) == ("GPipe", 1)  # GPipe fills and drains: any m


def test_stage_placement():
    assert stage_ranks(2, 4, "loop") == [0, 1, 0, 1]  # Interleaved1F1B: stage s on rank s mod pp
    assert stage_ranks(2, 4, "v") == [0, 1, 1, 0]  # ZBV: rank r holds stages r and 2p - 1 - r
    assert stage_ranks(4, 4, "single") == [0, 1, 2, 3]


def test_balance_minimises_the_largest_stage():
    even = [(10, 1)] * 8
    assert _split(even, (0, 0), 4) == [0, 2, 4, 6]
    # an LM head worth two blocks in the last stage: it takes fewer blocks
    assert _split(even, (20, 0), 2) == [0, 5]
    # equal FLOPs: the parameter bytes decide
    assert _split([(10, 5), (10, 1), (10, 1), (10, 1)], (0, 0), 2) == [0, 2]


# -- structural: the split of a captured graph --------------------------------------------------------
def _captured(name: str):
    model, args, kwargs = MODELS[name]()
    gm, spec = capture(model, args, kwargs, static=True)
    return gm


@pytest.mark.parametrize("count, blocks", [(2, [2, 2]), (4, [1, 1, 1, 1])])
def test_stages_cover_the_blocks_in_order(count, blocks):
    plan = make_plan(_captured("nanogpt"), 1, stages=StageRequest(count))
    assert [len(s.blocks) for s in plan.stages] == blocks
    assert [b for s in plan.stages for b in s.blocks] == [f"transformer.h.{i}" for i in range(4)]
    # the tied embedding / LM head (one parameter, under the name the graph reads) by the first stage and the last
    assert set(plan.stages[0].params) & set(plan.stages[-1].params) == {"lm_head.weight"}
    assert "transformer.ln_f.weight" in plan.stages[-1].params and "transformer.wpe.weight" in plan.stages[0].params
    assert all(s.flops > 0 and s.param_bytes > 0 for s in plan.stages)


def test_more_stages_than_blocks_is_an_error():
    with pytest.raises(PipelineError, match=r"5 pipeline stages .* need a block each, and the graph has 4 repeated "
                                            r"blocks \(transformer.h.0 ... transformer.h.3\)"):
        make_plan(_captured("nanogpt"), 1, stages=StageRequest(5))


def test_split_points_override_the_balance():
    gm = _captured("nanogpt")
    plan = make_plan(gm, 1, stages=StageRequest(2, ("transformer.h.3",)))
    assert [s.blocks for s in plan.stages] == [("transformer.h.0", "transformer.h.1", "transformer.h.2"),
                                               ("transformer.h.3",)]
    with pytest.raises(PipelineError, match="split point 'h.3' is not one of the model's blocks"):
        make_plan(gm, 1, stages=StageRequest(2, ("h.3",)))
    with pytest.raises(PipelineError, match="split_points names 2 blocks, but 2 stages start at 1"):
        make_plan(gm, 1, stages=StageRequest(2, ("transformer.h.1", "transformer.h.2")))


@pytest.mark.parametrize("name, sent", [("nanogpt", 1), ("llama", 1)])
def test_split_stages_sends_what_crosses_the_cut(name, sent):
    """Only the hidden state crosses: Llama's causal mask and rotary cos/sin, made from the inputs and a
    buffer alone, are made again in the stage that reads them, as Megatron does; graph inputs (ids, targets)
    are never sent: every stage takes them locally."""
    gm = _captured(name)
    plan = make_plan(gm, 1, stages=StageRequest(2))
    top = run_passes(gm, plan, (split_stages,))
    calls = [n for n in top.graph.nodes if n.op == "call_module"]
    assert [str(c.target) for c in calls] == ["autotp_stage_0", "autotp_stage_1"]
    assert not dict(top.named_parameters())  # the pieces read the model's parameters when they run
    outputs = next(n for n in top.graph.nodes if n.op == "output").args[0]
    loss = len(outputs) - 1 if name == "nanogpt" else 0
    first, last = wire_stages(top, loss)
    assert len(first.send) == sent and first.recv == () and last.recv == first.send
    assert len(last.send) == 1  # the loss
    assert not any(a.startswith("in") for a in first.send)


@pytest.mark.parametrize("name", ["nanogpt", "llama"])
def test_sequence_parallel_stages_each_sum_their_own_gradients(name):
    """With sequence parallelism each stage sums the gradients of its own norm weights (one all-reduce per
    stage, inside it: a stage holds only its own parameters), and only the hidden state crosses the cut. The
    pipeline captures with a symbolic sequence here, which sequence parallelism needs."""
    from autotp.operators.seq_ops import SumGrads
    from autotp.plan.plan import SEQ_PARAMS

    model, args, kwargs = MODELS[name]()
    gm, _ = capture(model, args, kwargs)
    plan = make_plan(gm, 2, sequence_parallel=True, stages=StageRequest(2))
    assert plan.sequence.leaves and plan.sequence.grads_by == "stage"
    assert len([c for c in plan.collectives if c.module == SEQ_PARAMS]) == 2
    top = run_passes(run_passes(gm, plan), plan, (split_stages,))
    pieces = [m for n, m in top.named_children() if n.startswith("autotp_stage_")]
    assert [sum(isinstance(x, SumGrads) for x in p.piece.modules()) for p in pieces] == [1, 1]
    first, _ = wire_stages(top, 1 if name == "nanogpt" else 0)
    assert len(first.send) == 1


@pytest.mark.parametrize("name", ["nanogpt", "llama"])
def test_context_parallel_stages_send_only_the_hidden_chunk(name):
    """With context parallelism the graph is captured with a symbolic sequence and rewritten for cp 2 before
    the cut: the chunks of the inputs (ids, and the targets the last stage reads), the chunk's positions and
    the length s/cp are computed again in each stage that reads them, so only the hidden state crosses, and
    the graph sums no gradient itself (the pipeline's step sums its stages' over the cp group)."""
    import dataclasses

    from autotp.analysis.context import find_context
    from autotp.operators.context_ops import ShardSequence
    from autotp.plan.context_planner import context_plan

    model, args, kwargs = MODELS[name]()
    gm, _ = capture(model, args, kwargs)
    plan = make_plan(gm, 1, stages=StageRequest(2))
    plan = dataclasses.replace(plan, context=context_plan(gm, find_context(gm, 2), 2, sum_grads=False))
    top = run_passes(run_passes(gm, plan), plan, (split_stages,))
    first, last = wire_stages(top, 1 if name == "nanogpt" else 0)
    assert len(first.send) == 1 and last.recv == first.send
    pieces = [m.piece for n, m in top.named_children() if n.startswith("autotp_stage_")]
    assert all(any(isinstance(x, ShardSequence) for x in p.modules()) for p in pieces)  # each cuts its own inputs
    assert not plan.context.grads


# -- gloo: parity with the unsharded model -------------------------------------------------------------
def _check(results: list[dict], configs: list[tuple]) -> None:
    for config, r in zip(configs, results):
        assert r["same_class"], config
        assert r["param_diff"] <= 1e-5, (config, r["param_diff"])
        if r["losses"]:  # untrained (dropout: its masks differ per micro-batch) only evaluates
            assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= 1e-5, (config, r["losses"])
            # clip_grad_norm_ over every stage (and TP shard): the unsharded model's norm, on every rank
            assert max(abs(a - b) for a, b in zip(r["norms"], r["ref_norms"])) <= 1e-5 * max(r["ref_norms"]), config
        if "eval_loss" in r:
            assert abs(r["eval_loss"] - r["ref_eval"]) <= 1e-5, config
        cls = {"nanogpt": "GPT", "moe": "LM"}.get(config[0].split("_")[0], "LlamaForCausalLM")
        assert r["direct_call"].startswith(f"{cls} is cut into pipeline stages"), config


def _by_rank(results: dict[int, list[dict]], i: int) -> list[dict]:
    return [results[r][i] for r in sorted(results)]


@pytest.mark.slow
def test_pipeline_two_ranks_matches_one_device():
    """(tp 1, pp 2): 1F1B, GPipe, Interleaved1F1B (v 2), ZBVZeroBubble; nanoGPT (tied LM head) and Llama; with
    dropout, eval_step runs the eval-mode graph (dropout off) and gives the unsharded model's eval loss.
    (InterleavedZeroBubble, and position ids every micro-batch shares, in the extended run.)"""
    configs = [("nanogpt", 1, 2, "1F1B", 2, None), ("llama", 1, 2, "GPipe", 2, None),
               ("llama", 1, 2, "Interleaved1F1B", 4, 2), ("llama", 1, 2, "ZBVZeroBubble", 2, 2),
               ("nanogpt_dropout", 1, 2, "1F1B", 2, None, 0)]
    from pipeline_workers import pipeline_parity_many

    results = launch(reusing(pipeline_parity_many), 2, configs, [("nanogpt", 1, 2, "ZBVZeroBubble", 2, 2)])
    _check_two_ranks(results, configs)
    nano = _by_rank(results, 0)
    # the tied embedding / LM head: the same weights on the first and the last stage after 3 steps
    assert nano[0]["sums"]["transformer.wte.weight"] == nano[1]["sums"]["transformer.wte.weight"]
    # ZBV puts the first and last stage on one rank: a weight tied between them is refused, not trained wrong
    assert results[0][-1] == {"refused": "ZBVZeroBubble places stages 0 and 3 on pipeline rank 0, and both read "
                                          "lm_head.weight (a tied weight)"}


@pytest.mark.slow
@pytest.mark.extended
def test_pipeline_two_ranks_other_schedules_and_inputs():
    """(tp 1, pp 2), the rest of the matrix: nanoGPT's tied head under Interleaved1F1B and
    InterleavedZeroBubble, and Llama given position ids of shape (1, s) every micro-batch shares."""
    configs = [("nanogpt", 1, 2, "Interleaved1F1B", 2, 2), ("nanogpt", 1, 2, "InterleavedZeroBubble", 2, 2),
               ("llama_positions", 1, 2, "1F1B", 2, None)]
    from pipeline_workers import pipeline_parity_many

    _check_two_ranks(launch(reusing(pipeline_parity_many), 2, configs), configs)


def _check_two_ranks(results: dict, configs: list) -> None:
    for i, config in enumerate(configs):
        per_rank = _by_rank(results, i)
        _check(per_rank, [config] * len(per_rank))
        count = per_rank[0]["count"]
        placement = "v" if config[3] == "ZBVZeroBubble" else "loop"
        assert [r["stages"] for r in per_rank] == [[s for s in range(count) if stage_ranks(2, count, placement)[s] == r]
                                                   for r in range(2)]
        # each rank holds its own stages' parameters only, together the whole model (a tied one on both ends)
        assert all(r["held_numel"] < r["full_numel"] for r in per_rank)


@pytest.mark.slow
@pytest.mark.extended  # seven pairings in one 4-rank launch; the default run: the README's tp 2 × pp 2 line below
def test_pipeline_with_tensor_parallelism_matches_one_device():
    """(tp 2, pp 2): each stage TP-sharded by autotp's plan; (tp 1, dp 2, pp 2) with FSDP (1F1B and
    Interleaved1F1B: each of a rank's stages one FSDP unit); with sequence parallelism (the hidden state
    crossing the cut is s/t); with expert parallelism (a mixture-of-experts stack, E/tp whole experts per
    rank); FSDP kept gathered through the step (the default) and resharded after each forward; with FSDP and
    the one kv head of multi-query attention on both tp ranks (held whole, cut in the graph, its gradient
    summed once per step); and with each stage's piece compiled as well (torchtitan compiles per stage),
    with no graph break, exact against the unsharded eager model (AOTAutograd's graphs run eagerly: Inductor is
    tests/runtime/test_compile.py's and tests/runtime/test_fsdp.py's, and costs minutes on these CPUs)."""
    configs = [("nanogpt", 2, 2, "1F1B", 2, None), ("llama", 2, 2, "1F1B", 4, None, 3, 0.05, False, True),
               ("nanogpt", 2, 2, "GPipe", 2, None, 3, 0.05, {"backend": "aot_eager"}, True),
               ("moe", 2, 2, "1F1B", 2, None, 3, 0.05, False, False, True),
               ("nanogpt", 1, 2, "1F1B", 2, None, 3, 0.05, False, False, False, True),
               ("llama", 1, 2, "Interleaved1F1B", 2, 2, 3, 0.05, False, False, False,
                FSDPConfig(reshard_after_forward=True)),
               ("llama_mqa", 2, 2, "1F1B", 2, None, 3, 0.05, False, False, False, True)]
    from pipeline_workers import pipeline_parity_many

    results = launch(reusing(pipeline_parity_many), 4, configs)
    for i, config in enumerate(configs):
        _check(_by_rank(results, i), [config] * 4)
    for i in (0, 1, 2):  # the first stage's ranks send (micro-batch, s/t with sequence parallelism, h)
        b, s = _by_rank(results, i)[0]["micro"][0]
        assert _by_rank(results, i)[0]["sent"] == [(b, s // 2 if i else s, 64)], i
    for r in _by_rank(results, 2):
        assert r["breaks"] == {} and r["compiled_graphs"] == 2, (r["breaks"], r["compiled_graphs"])  # train, eval
    for r in _by_rank(results, 3):  # expert parallelism: whole experts per rank in each stage's layer
        assert r["experts"] == [("blocks.0.moe", 4), ("blocks.1.moe", 4)] and r["experts_kept"] == []
    for i, v in ((4, 1), (5, 2)):  # FSDP over dp 2: each of a rank's stages one unit
        for r in _by_rank(results, i):
            assert len(r["fsdp_units"]) == v and r["held_numel"] <= r["full_numel"] / 4 * 1.3, r["held_numel"]
            # per step: kept gathered (the default, as torchtitan pipelines) one all-gather per unit; resharded
            # after forward, one per unit for each micro-batch's forward and one for the backward; one
            # reduce-scatter per unit after the last micro-batch; the tied weight's sum over its pipeline ranks
            tied, gathers = int(i == 4), v if i == 4 else 3 * v
            for calls in r["steps_collectives"]:
                assert Counter(map(tuple, calls)) == Counter({("all_gather", ""): gathers, ("reduce_scatter", "?"): v,
                                                              **({("all_reduce", "sum"): 1} if tied else {})}), calls
    for r in _by_rank(results, 6):  # MQA under FSDP: the kv copies' gradients summed once per step, in one bucket
        assert r["cut_numels"], r
        for calls in r["steps_sized"]:
            sums = [n for kind, op, n in calls if kind == "all_reduce" and op == "sum"]
            assert sums.count(sum(r["cut_numels"])) == 1, (r["cut_numels"], calls)
            assert not set(r["cut_numels"]) & set(sums) - {sum(r["cut_numels"])}, "none per micro-batch"
    nano = _by_rank(results, 0)
    # ranks 0, 1: stage 0 (tp 0, 1); ranks 2, 3: stage 1; the tied weight's TP shards agree end to end
    assert [r["stages"] for r in nano] == [[0], [0], [1], [1]]
    assert nano[0]["sums"]["transformer.wte.weight"] == nano[2]["sums"]["transformer.wte.weight"]
    assert nano[1]["sums"]["transformer.wte.weight"] == nano[3]["sums"]["transformer.wte.weight"]


# cp 2 × pp 2 on a (pp, dp, cp, tp) mesh: nanoGPT (positions, a tied head, targets cut in the last stage) under
# 1F1B; Llama (rotary tables, labels shifted on the whole inputs) and the interleaved schedule in the extended run
CONTEXT = {False: [("nanogpt", 1, 2, "1F1B", 2, None, 3, 0.05, False, False, False, False, 2)],
           True: [("llama", 1, 2, "GPipe", 2, None, 3, 0.05, False, False, False, False, 2),
                  ("nanogpt", 1, 2, "Interleaved1F1B", 2, 2, 3, 0.05, False, False, False, False, 2)]}


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("rest", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_context_parallel_pipeline_matches_one_device(rest):
    """cp 2 × pp 2: every stage runs its rank's chunk of the sequence (the ring between the cp pair of each
    stage), the losses, clipped gradient norms, eval loss and parameters after 3 AdamW steps within 1e-5 of
    one device. The cut carries the chunk's hidden state, (b/m, s/cp, h); each step sums the gradients of a
    rank's stages over its cp pair once, in one all-reduce of all of them, after the micro-batches."""
    configs = CONTEXT[rest]
    from pipeline_workers import pipeline_parity_many

    results = launch(reusing(pipeline_parity_many), 4, configs)
    for i, config in enumerate(configs):
        per_rank = _by_rank(results, i)
        _check(per_rank, [config] * 4)
        assert [r["stages"] for r in per_rank] == ([[0], [0], [1], [1]] if config[5] is None else
                                                   [[0, 2], [0, 2], [1, 3], [1, 3]])
        b, s = per_rank[0]["micro"][0]
        assert per_rank[0]["sent"] == [(b, s // 2, 64)]  # the chunk's hidden state
        for r in per_rank:
            for calls in r["steps_sized"]:
                sums = [n for kind, op, n in calls if kind == "all_reduce" and op == "sum"]
                assert sums.count(r["held_numel"]) == 1, (r["held_numel"], sums)  # the cp sum, once per step
                assert any(kind == "all_to_all_single" for kind, _, _ in calls)  # the rings' backward


@pytest.mark.slow
@pytest.mark.extended  # CI's time: the 4- and 8-rank compositions are benchmarks/compose.py's rows
def test_pipeline_tensor_and_data_parallel_eight_ranks():
    """Megatron's 3-D layout (tp 2, dp 2, pp 2) on 8 ranks: DDP per stage over dp, each replica on its half;
    and FSDP per stage with sequence parallelism. (Llama under GPipe is the 2- and 4-rank tests'.)"""
    configs = [("nanogpt", 2, 2, "1F1B", 2, None),
               ("nanogpt", 2, 2, "1F1B", 2, None, 3, 0.05, False, True, False, True)]  # FSDP, sequence parallel
    from pipeline_workers import pipeline_parity_many

    results = launch(reusing(pipeline_parity_many), 8, configs)
    for i, config in enumerate(configs):
        per_rank = _by_rank(results, i)
        for r in per_rank:
            r.pop("eval_loss", None)  # each replica evaluates its own half: compared in the other tests
        _check(per_rank, [config] * 8)
        assert [r["stages"] for r in per_rank] == [[0]] * 4 + [[1]] * 4


@pytest.mark.slow
@pytest.mark.extended  # CI's time: the 4- and 8-rank compositions are benchmarks/compose.py's rows
def test_checkpoint_resumes_with_every_dimension_changed(tmp_path):
    """Saved at tp 2 × fsdp 2 with sequence parallelism, resumed at tp 2 × pp 2 with sequence parallelism,
    at tp 1 × dp 2 × pp 2 (DDP) and at tp 4: weights and optimizer state as if uninterrupted."""
    from pipeline_workers import layouts_resume_matrix

    results = launch(reusing(layouts_resume_matrix), 4, str(tmp_path), "llama")[0]
    reference = results.pop("reference")
    assert set(results) == {(2, 2, True), (1, 2, False), (4, 1, False)}
    for layout, run in results.items():
        assert run["step"] == 3 and "resharded" in run["note"], (layout, run["note"])
        assert set(run["state"]) == set(reference)
        for k, v in reference.items():
            assert (run["state"][k] - v).abs().max().item() <= 1e-5, (layout, k)


@pytest.mark.slow
@pytest.mark.extended  # CI's time: the 4- and 8-rank compositions are benchmarks/compose.py's rows
def test_pipeline_checkpoint_resumes_at_other_pipeline_sizes(tmp_path):
    """Saved at (tp 2, pp 2), resumed at (tp 4, pp 1) and (tp 1, pp 4), optimizer included: as if uninterrupted."""
    from pipeline_workers import pipeline_resume_matrix

    for name in ("nanogpt", "llama"):
        results = launch(reusing(pipeline_resume_matrix), 4, str(tmp_path), name)[0]
        reference = results.pop("reference")
        assert set(results) == {(4, 1), (1, 4)}
        for layout, run in results.items():
            assert run["step"] == 3
            assert set(run["state"]) == set(reference)
            diff = max((run["state"][k] - v).abs().max().item() for k, v in reference.items())
            assert diff <= 1e-6, (name, layout, diff)
        assert results[(1, 4)]["note"] == ("resumed from tp 2 × dp 1 × pp 2 → tp 1 × dp 1 × pp 4: weights and "
                                           "optimizer state resharded")



# -- the command line ------------------------------------------------------------------------------------
README_PIPELINE = "autotp shard examples/llama.py --tp 2 --pp 2 --virtual-stages 2 --schedule Interleaved1F1B --microbatches 4 --out llama"  # noqa: E501


@pytest.mark.slow
def test_readme_pipeline_line_runs_exactly(tmp_path):
    """The README's pipeline command as written: Llama at tp 2 × pp 2 on 4 ranks, two virtual stages per rank under
    Interleaved1F1B with 4 micro-batches: the check passes (the loss through the pipeline within 1e-5 of the
    unsharded model's), each of the 4 blocks is a stage of its own, placed in Megatron's order (tp inside pp),
    every stage cut by tp (a rank holds about a quarter of the parameters), and 3 steps train and checkpoint."""
    import json

    from readme import readme_folder, run_readme

    done = run_readme(README_PIPELINE, readme_folder(tmp_path))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = json.loads((tmp_path / "llama" / "summary.json").read_text())
    assert summary["parity"]["ok"] and summary["parity"]["loss_diff"] <= 1e-5, summary["parity"]
    assert (summary["tp"], summary["pp"], summary["dp"]) == (2, 2, 1)
    assert summary["pipeline"] == "Interleaved1F1B, 4 micro-batches, 2 stage(s) per rank"
    assert summary["stages"] == [[f"model.layers.{i}"] for i in range(4)]
    assert [(r["pp_rank"], r["tp_rank"]) for r in summary["ranks"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["param_bytes"] < summary["unsharded_bytes"] / 3 for r in summary["ranks"])
    assert len(summary["losses"]) == 3 and (tmp_path / "llama" / "checkpoints" / "step-000003").is_dir()


def _shard(*flags: str):
    import os

    from typer.testing import CliRunner

    from autotp.cli.main import app
    from ranks import ROOT

    return CliRunner().invoke(app, ["shard", os.path.join(ROOT, "examples", "nanogpt.py"), *flags],
                              env={"COLUMNS": "300"})


@pytest.mark.slow
def test_autotp_shard_every_dimension_runs_as_is_and_resumes_without_them(tmp_path):
    """`autotp shard examples/nanogpt.py --tp 2 --dp 2 --pp 2 --fsdp --sequence-parallel --compile` on 8 ranks:
    parity, training, checkpoints (steps 3 and 4); then `--tp 4 --dp 2` resumed from step 3 gives step 4's loss
    exactly (each run's dp replica 0 trains on the same half of the batch). Compiled with aot_eager: dynamo and
    AOTAutograd over every stage's graphs without generating code (Inductor's C++ builds on 8 ranks of 2 cores
    cost about 90 s; Inductor is tests/runtime/test_compile.py's)."""
    import json

    out = tmp_path / "out"
    result = _shard("--tp", "2", "--dp", "2", "--pp", "2", "--fsdp", "--sequence-parallel", "--compile",
                    "--compile-backend", "aot_eager", "--steps", "4", "--save-every", "3", "--out", str(out))
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parity"]["ok"] and summary["pp"] == 2 and summary["dp"] == 2
    assert summary["stages"] == [["transformer.h.0"], ["transformer.h.1"]] and len(summary["fsdp_units"]) == 1
    assert summary["pipeline"] == "1F1B, 2 micro-batches, 1 stage(s) per rank"
    assert len(summary["losses"]) == 4 and summary["losses"][-1] < summary["losses"][0]
    assert [r["pp_rank"] for r in summary["ranks"]] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert (out / "checkpoints" / "step-000003" / ".metadata").is_file()
    again = _shard("--tp", "4", "--dp", "2", "--steps", "4", "--resume-from", str(out / "checkpoints" / "step-000003"),
                   "--out", str(out))
    assert again.exit_code == 0, again.output
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["start_step"] == 3 and len(resumed["losses"]) == 1
    assert resumed["resharded"] == ("resumed from tp 2 × dp 2 × pp 2 → tp 4 × dp 2 × pp 1: weights and optimizer "
                                    "state resharded")
    assert abs(resumed["losses"][0] - summary["losses"][3]) <= 1e-5, (resumed["losses"], summary["losses"])


@pytest.mark.parametrize("flags, says", [
    (["--tp", "1", "--pp", "4"], "4 pipeline stages (pp × virtual stages) need a block each, and the graph has 2"),
    (["--tp", "1", "--pp", "2", "--microbatches", "3"], "--microbatches 3 does not divide example_batch()'s batch of 4"),
    (["--tp", "1", "--pp", "2", "--schedule", "Zigzag"], "unknown pipeline schedule 'Zigzag'"),
    (["--tp", "1", "--pp", "2", "--schedule", "Interleaved1F1B", "--virtual-stages", "1"], "virtual_stages is 1"),
    (["--tp", "1", "--pp", "2", "--dp", "2", "--fsdp", "--schedule", "ZBVZeroBubble"],
     "fsdp with the ZBVZeroBubble schedule is not supported yet"),
    (["--tp", "1", "--pp", "2", "--compile-backend", "inductr"], "--compile-backend 'inductr' is not a torch.compile "
                                                                 "backend; known: "),
])
def test_pipeline_bad_flags_fail_before_any_rank(flags, says):
    result = _shard(*flags)
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split()), result.output


_SCRIPT = '''
import json, os, sys
import torch
import autotp
from nanogpt_model import GPT, GPTConfig

torch.manual_seed(1337)
config = GPTConfig()
model = GPT(config)
g = torch.Generator().manual_seed(0)
X = torch.randint(0, config.vocab_size, (4, 32), generator=g)
Y = torch.randint(0, config.vocab_size, (4, 32), generator=g)
amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(os.environ.get("AMP")))
if os.environ.get("AUTOTP_JOB"):  # under `autotp run --pp 2`: the layout's mesh, no group made here
    with amp:  # built under the autocast it steps under: the stages send what they compute there
        pipe = autotp.pipeline(model, example_inputs=(X, Y), microbatches=2)
    params, clip = list(pipe.parameters()), pipe.clip_grad_norm_
else:
    pipe, params = None, list(model.parameters())
    clip = lambda c: torch.nn.utils.clip_grad_norm_(params, c)
opt = torch.optim.AdamW(params, lr=1e-3)
losses = []
for _ in range(3):
    if pipe is not None:
        with amp:
            loss = pipe.step(X, Y)
    else:
        with amp:
            loss = model(X, Y)[1]
        loss.backward()
    clip(1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
print("RESULT " + json.dumps({"losses": losses}), flush=True)
if torch.distributed.is_initialized():  # a script that ends its own group, as torchrun scripts do
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
'''


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("amp, tol", [(False, 1e-5), pytest.param(True, 1e-3, marks=pytest.mark.extended)])
def test_user_script_under_autotp_run_pp(tmp_path, amp, tol):
    """A script of the user's own with autotp.pipeline under `autotp run --tp 1 --pp 2`: the layout's mesh is
    picked up, and every rank gets the single-device losses; under bf16 autocast too (built inside it)."""
    import json
    import os
    import subprocess
    import sys

    from ranks import ROOT

    script = tmp_path / "train_pp.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests", "scripts"), "AMP": "1" if amp else ""}
    env.pop("AUTOTP_JOB", None)
    single = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert single.returncode == 0, single.stderr[-2000:]
    want = json.loads(single.stdout.split("RESULT ")[1])["losses"]
    proc = subprocess.run([sys.executable, "-m", "autotp.cli", "run", str(script), "--tp", "1", "--pp", "2"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    got = [json.JSONDecoder().raw_decode(part)[0]["losses"] for part in proc.stdout.split("RESULT ")[1:]]
    assert len(got) == 2
    for losses in got:
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, want)) <= tol, (losses, want)


@pytest.mark.slow
@pytest.mark.extended  # CI's time: the 4- and 8-rank compositions are benchmarks/compose.py's rows
def test_pipeline_of_a_model_built_on_meta_loads_only_its_stages(tmp_path):
    """Built inside autotp.empty_weights() and pipelined at (tp 2, pp 2): each rank allocates only its own
    stages' TP shards, autotp.load_weights reads only those, and training matches the unsharded model."""
    import torch

    from pipeline_workers import pipeline_from_meta

    model, _, _ = MODELS["llama"]()
    path = tmp_path / "llama.pt"
    torch.save(model.state_dict(), path)
    results = launch(reusing(pipeline_from_meta), 4, str(path), "llama", 2, 2)
    for r in results.values():
        assert r["allocated"] == r["held"] < sum(p.numel() for p in model.parameters()) // 3
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= 1e-5, r
        assert r["param_diff"] <= 1e-5, r
    assert [results[r]["read"] for r in sorted(results)][0] < len(model.state_dict())


@pytest.mark.slow
@pytest.mark.extended
def test_grad_scaler_overflow_on_one_stage_skips_every_rank():
    """fp16 + GradScaler through the pipeline: an overflow in one stage's gradients skips the step on both
    pipeline ranks, and the scale halves on both, as on one device."""
    from pipeline_workers import pipeline_grad_scaler

    results = launch(pipeline_grad_scaler, 2)
    assert [results[r]["held_inf_param"] for r in sorted(results)] == [False, True]  # the inf: on rank 1 only
    for rank, r in results.items():
        assert r["skipped_unchanged"], rank  # rank 0 found no inf of its own, and still skipped
        assert r["scales"] == r["ref_scales"], (rank, r["scales"], r["ref_scales"])
        assert r["scales"][1] == r["scales"][0] / 2
        assert max(abs(a - b) / b for a, b in zip(r["losses"], r["ref_losses"])) <= 1e-3, (r["losses"], r["ref_losses"])
