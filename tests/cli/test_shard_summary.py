"""``autotp shard``'s summary is true where dimensions meet: what each rank holds (parameters, gradients,
optimizer state: its local shards, FSDP's included) against the plan's formula, the FLOPs and MFU, which data
parallelism runs, the TP traffic each rank's sequence positions carry under context parallelism, and what a
pipeline's parity line compared."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from autotp.parallel.held import held, held_params, held_state
from ranks import ROOT

NANOGPT = os.path.join(ROOT, "examples", "nanogpt.py")
BATCH, SEQ = 4, 32  # examples/nanogpt.py's example_batch()


def _shard(out: Path, *layout: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-m", "autotp.cli", "shard", NANOGPT, *layout, "--steps", "1",
                           "--gpu", "h100", "--out", str(out)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "COLUMNS": "250"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "summary.json").read_text()), proc.stdout


def _per_tp_rank(out: Path, cp: int = 1):
    """The plan's report of the run: parameter rows per tp rank (local shapes, padding included) and the
    traffic of one step, from plan.json and the model built on meta."""
    from autotp.capture.modelfile import load_model_file
    from autotp.plan.plan import Plan
    from autotp.reports.sharding import build_report

    plan = Plan.from_json((out / "plan.json").read_text())
    with torch.device("meta"):
        model = load_model_file(NANOGPT).build()
    return plan, build_report(plan, model.named_parameters(remove_duplicate=False), BATCH, SEQ, cp=cp)


def _by(summary: dict, *keys: str) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in summary["ranks"]:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups


def _once_per_replica(ranks: list[dict], summary: dict, report) -> None:
    """The ranks of one model replica hold the unsharded model once between them, but for the tensors the plan
    leaves whole (norms, row biases), which each of the tp ranks holds (nanoGPT's sizes need no padding)."""
    whole = sum(r.full_bytes for r in report.params if r.role == "replicated")
    assert whole > 0 and sum(r["param_bytes"] for r in ranks) == summary["unsharded_bytes"] + (report.tp - 1) * whole


def _training_state_is_the_parameters(summary: dict) -> None:
    """Every parameter trains: each rank's gradients are its parameters' size, AdamW's two moments twice it."""
    for r in summary["ranks"]:
        assert r["grad_bytes"] == r["param_bytes"] and r["state_bytes"] == 2 * r["param_bytes"], r


def _mfu_present(summary: dict, stdout: str) -> None:
    assert summary["step_flops"] > 0 and summary["mfu"] is not None and summary["mfu"] > 0
    assert "FLOPs per replica step; MFU " in stdout


@pytest.mark.slow
def test_fsdp_summary_counts_local_shards(tmp_path: Path) -> None:
    """tp 2 × dp 2 with FSDP: the dp ranks of a tp rank hold that tp rank's shards between them (the sum is the
    plan's bytes per tp rank, each rank less), and the FLOPs are counted, so MFU is printed."""
    summary, stdout = _shard(tmp_path / "out", "--tp", "2", "--dp", "2", "--fsdp")
    _, report = _per_tp_rank(tmp_path / "out")
    for tp_rank, ranks in _by(summary, "tp_rank").items():
        assert len(ranks) == 2
        assert sum(r["param_bytes"] for r in ranks) == report.memory.bytes_per_rank, tp_rank
        assert all(r["param_bytes"] < report.memory.bytes_per_rank for r in ranks)
    _once_per_replica(summary["ranks"], summary, report)
    _training_state_is_the_parameters(summary)
    _mfu_present(summary, stdout)
    assert "tp 2 × dp 2 · FSDP (gloo)" in stdout


@pytest.mark.slow
@pytest.mark.extended  # the fsdp run covers the count in the default tier
def test_pipeline_fsdp_summary_counts_local_shards(tmp_path: Path) -> None:
    """tp 2 × dp 2 × pp 2 with FSDP: each (tp, pp) rank's stage is split over its dp ranks (before, every dp
    rank counted the stage's whole DTensors: 58% of the model on each of 8 ranks); the parity line says the
    loss is what was compared."""
    summary, stdout = _shard(tmp_path / "out", "--tp", "2", "--dp", "2", "--pp", "2", "--fsdp")
    plan, report = _per_tp_rank(tmp_path / "out")
    by_alias = {a: row for row in report.params for a in row.aliases}
    for (tp_rank, pp_rank), ranks in _by(summary, "tp_rank", "pp_rank").items():
        rows = {id(by_alias[n]): by_alias[n] for n in plan.stages[pp_rank].params}.values()
        stage_bytes = sum(r.local_bytes for r in rows)  # one stage per pipeline rank (1F1B)
        assert sum(r["param_bytes"] for r in ranks) == stage_bytes, (tp_rank, pp_rank)
        assert len(ranks) == 2 and all(r["param_bytes"] < stage_bytes for r in ranks)
    # the stages together hold the model once per tp rank, a tensor two stages read (tied embeddings) in both
    assert sum(r["param_bytes"] for r in summary["ranks"]) >= 2 * report.memory.bytes_per_rank
    _training_state_is_the_parameters(summary)
    _mfu_present(summary, stdout)
    assert "tp 2 × dp 2 × pp 2 · FSDP (gloo)" in stdout
    assert summary["parity"]["output_diff"] is None and summary["parity"]["loss_diff"] <= 1e-5
    assert "Δoutput" not in stdout and "compared: the loss" in stdout


@pytest.mark.slow
@pytest.mark.extended
def test_context_parallel_summary_counts_each_ranks_positions(tmp_path: Path) -> None:
    """tp 2 × cp 2: the cp ranks are replicas of the parameters (each holds its tp rank's shards); the TP
    collectives carry each rank's s/cp positions, half of what the same plan carries at cp 1."""
    summary, stdout = _shard(tmp_path / "out", "--tp", "2", "--cp", "2")
    _, whole = _per_tp_rank(tmp_path / "out")
    assert {r["param_bytes"] for r in summary["ranks"]} == {whole.memory.bytes_per_rank}
    for replica in _by(summary, "cp_rank").values():
        _once_per_replica(replica, summary, whole)
    _training_state_is_the_parameters(summary)
    _mfu_present(summary, stdout)
    *_, total = summary["comm"]
    assert total[0] == "total" and total[3] == total[4] == 13
    assert total[5] == total[6] and 2 * total[5] == whole.total().elements
    assert "each rank's 1/2 of the sequence (cp 2)" in stdout
    assert "tp 2 × cp 2 × dp 1 (gloo)" in stdout  # no data parallelism to name


# -- without processes ------------------------------------------------------------------------------------
def test_held_counts_each_tensor_once() -> None:
    """A weight tied to another (the same tensor twice) is held once; None (no gradient yet) is nothing."""
    lin = torch.nn.Linear(4, 3)
    tied = torch.nn.Sequential(lin, lin)
    assert held_params(tied) == held_params(lin) and held_params(lin).elements == 15
    assert held_params(lin).bytes == 60
    assert held([lin.weight, lin.weight, None]).elements == 12
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert held_state(opt).bytes == 2 * held_params(lin).bytes  # the two moments; the step counts are not


def _report(**changes):
    from dataclasses import replace

    from autotp.cli.shard_worker import Parity, RankStats, ShardReport

    base = ShardReport(model="m.py", tp=2, dp=2, backend="gloo", unsharded_bytes=1000,
                       ranks=tuple(RankStats(i, i % 2, i // 2, 250, (0.01,), grad_bytes=250, state_bytes=500)
                                   for i in range(4)),
                       collectives=(), parity=Parity(1e-7, 2e-7), losses=(1.0,), final_loss=1.0,
                       plan_path="p.json", checkpoint_path="c", tokens_per_step=64, step_flops=3e9)
    return replace(base, **changes)


def _text(report) -> str:
    from autotp.cli.shard import render

    console = Console(file=io.StringIO(), width=200)
    render(report, console)
    return console.file.getvalue()


def test_title_names_the_data_parallelism() -> None:
    assert "tp 2 × dp 2 · DDP (gloo)" in _text(_report())
    assert "tp 2 × dp 2 · FSDP (gloo)" in _text(_report(fsdp=1))
    assert "tp 2 × dp 4 · HSDP 2×2 (gloo)" in _text(_report(dp=4, fsdp=2))
    assert "tp 2 × dp 1 (gloo)" in _text(_report(dp=1))
    # FSDP over the dp × cp ranks (cp 2 × dp 1: each rank holds half): named over both, not "over 1 ranks"
    text = " ".join(_text(_report(dp=1, cp=2, fsdp=1, fsdp_units=("h.0", "h.1"))).split())
    assert "tp 2 × cp 2 × dp 1 · FSDP (gloo)" in text and "FSDP2 over 2 ranks (dp 1 × cp 2): 2 units" in text, text


def test_pipeline_parity_says_what_was_compared() -> None:
    from autotp.cli.shard_worker import Parity

    text = _text(_report(pp=2, parity=Parity(4.8e-7, None, "the loss, on the whole batch through the pipeline")))
    assert "pass max |Δloss| 4.80e-07 (tol 1e-05); compared: the loss, on the whole batch" in text
    assert "Δoutput" not in text
    assert "max |Δoutput| 2.00e-07" in _text(_report())
    assert "3e+09 FLOPs per replica step; MFU: no device peak" in _text(_report())
    assert "MFU: FLOPs not counted" in _text(_report(step_flops=None))


@pytest.mark.parametrize("tp,cp,pp,dp", [(2, 1, 1, 2), (2, 2, 1, 1), (1, 2, 2, 2), (2, 2, 2, 1)])
def test_mfu_counts_a_ranks_share_of_its_replica(tp: int, cp: int, pp: int, dp: int) -> None:
    """A replica's FLOPs per step are shared by its tp · cp · pp ranks (1/cp of the sequence each under context
    parallelism: at cp 2 the summary once gave each rank the FLOPs of two), never by the dp replicas."""
    from autotp.cli.shard_worker import rank_flops
    from autotp.distributed.rank_grid import RankGrid

    grid = RankGrid.build(tp * cp * pp * dp, tp=tp, pp=pp, cp=cp)
    assert grid.dp == dp
    assert rank_flops(8e9, grid) == 8e9 / (tp * cp * pp)
    assert rank_flops(None, grid) is None
