"""Data parallelism over tensor-parallel replicas (tp 2 × dp 2 on gloo), the rank grid inside the running job,
and ``autotp shard`` as a two-node job on loopback."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autotp.distributed.launch import LaunchSpec, launch
from autotp.distributed.rank_grid import RankGrid
from ranks import ROOT

NANOGPT = os.path.join(ROOT, "examples", "nanogpt.py")
TP, DP, STEPS, LR, EPS, TOL = 2, 2, 3, 1e-3, 1e-6, 1e-5
# a two-node job takes 17-30 s on 2 cores (up to ~45 s with other jobs on the machine); the hang it retries
# (see test_shard_two_nodes_on_loopback) never ends by itself, so a longer wait only delays the retry
TWO_NODE_TIMEOUT_S = 180  # a hang guard, not a speed target: two launchers each check the plan before 4 ranks start


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two same-sized batches of nanoGPT token ids: the example batch's first and last two rows."""
    import nanogpt

    idx, targets = nanogpt.example_batch(batch=4)
    return [(idx[:2], targets[:2]), (idx[2:], targets[2:])]


def _dp_tp_worker(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """One rank of tp × dp: trains on batch ``dp rank`` with the step ``autotp shard`` uses."""
    import nanogpt

    import autotp
    from autotp.cli.shard_worker import data_parallel, train_step
    from autotp.distributed.launch import init_from_env

    ctx = init_from_env()
    try:
        idx, targets = batches[ctx.coords["dp"]]
        tpm = autotp.parallelize(nanogpt.build_model(), tp_group=ctx.tp_group(),
                                 example_inputs=((idx, targets), {}))
        trained = data_parallel(tpm, ctx)
        opt = torch.optim.AdamW(tpm.parameters(), lr=LR, eps=EPS)
        losses = [train_step(trained, opt, (idx, targets), {}).loss.item() for _ in range(STEPS)]

        # a tied parameter is in the plan under one of its names: find its entry through any alias
        aliases: dict[int, list[str]] = {}
        for name, p in tpm.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        params = {}
        for name, p in tpm.named_parameters():
            shard = next((s for s in map(autotp.tp_state(tpm).plan.param, aliases[id(p)]) if s is not None), None)
            params[name] = (shard, p.detach().clone())
        groups = {
            "tp": dist.get_process_group_ranks(ctx.tp_group()),
            "dp": dist.get_process_group_ranks(ctx.dp_group()),
            "ddp": dist.get_process_group_ranks(trained.process_group) if trained is not tpm else None,
        }
        return {"rank": ctx.rank, "coords": ctx.coords, "tp_rank": autotp.tp_state(tpm).rank, "world": dist.get_world_size(),
                "losses": losses, "params": params, "groups": groups}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dp_tp_run() -> tuple[dict[int, dict], list]:
    batches = _batches()
    return launch(LaunchSpec(tp=TP, dp=DP), _dp_tp_worker, batches, quiet=False), batches


def _reference(batches: list) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsharded model trained in this process on the concatenation of every replica's batch."""
    import nanogpt

    model = nanogpt.build_model()
    idx = torch.cat([b[0] for b in batches])
    targets = torch.cat([b[1] for b in batches])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for _ in range(STEPS):
        _, loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.slow
def test_dp_tp_training_matches_unsharded_on_concatenated_batches(dp_tp_run) -> None:
    results, batches = dp_tp_run
    assert sorted(results) == list(range(TP * DP))
    ref_losses, ref_params = _reference(batches)

    by_dp = {r["coords"]["dp"]: r["losses"] for r in results.values() if r["coords"]["tp"] == 0}
    assert by_dp[0][0] != by_dp[1][0], "both DP replicas saw the same data"
    for step in range(STEPS):
        # equal batch sizes: the mean over the concatenation is the mean of the replicas' means
        assert abs((by_dp[0][step] + by_dp[1][step]) / 2 - ref_losses[step]) < TOL, step

    for rank, r in results.items():
        assert r["tp_rank"] == r["coords"]["tp"]
        assert any(shard is not None for shard, _ in r["params"].values()), "nothing was sharded"
        assert set(r["params"]) <= set(ref_params)
        for name, (shard, local) in r["params"].items():
            full = ref_params[name]
            want = full if shard is None else shard.shard(full, TP, r["tp_rank"])
            assert local.shape == want.shape, (rank, name, local.shape, want.shape)
            diff = (local - want).abs().max().item()
            assert diff <= TOL, f"rank {rank} {name}: max |Δ| {diff:.3e} after {STEPS} steps"


@pytest.mark.slow
def test_rank_groups_in_running_job_follow_layout(dp_tp_run) -> None:
    results, _ = dp_tp_run
    grid = RankGrid.build(TP * DP, TP)
    for rank, r in results.items():
        assert r["rank"] == rank and r["world"] == TP * DP
        assert r["coords"] == grid.coords(rank)
        assert r["groups"]["tp"] == next(g for g in grid.tp_groups if rank in g)
        assert r["groups"]["dp"] == next(g for g in grid.dp_groups if rank in g)
        assert r["groups"]["ddp"] == r["groups"]["dp"], "DDP does not average over the DP group"
    assert grid.tp_groups == [[0, 1], [2, 3]] and grid.dp_groups == [[0, 2], [1, 3]]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the agent and the ranks it spawned
    proc.wait()


def _free_ipv4_port() -> int:
    """A port free on 127.0.0.1, the address both nodes are given: torch's ``get_free_port`` may pick one
    free on another of localhost's addresses (::1), and then node 0's rendezvous store can hang both."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(where: Path, sizes: tuple[str, ...] = ("--tp", str(TP)), timeout: float = TWO_NODE_TIMEOUT_S):
    """``autotp shard`` with ``sizes`` as node 0 and node 1 on this host: (processes, logs, their text, which
    timed out, the output folder)."""
    where.mkdir()
    port, out = _free_ipv4_port(), where / "out"
    env = {**os.environ, "COLUMNS": "200"}
    procs, logs = [], []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "autotp.cli", "shard", NANOGPT, *sizes, "--steps", "2",
               "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
               "--master-port", str(port), "--out", str(out)]
        logs.append(where / f"node{node}.log")
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                          start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = [p.poll() is None for p in procs]
        for proc in procs:
            _kill(proc)
    return procs, logs, [log.read_text() for log in logs], timed_out, out


def _two_nodes_finished(tmp_path: Path, sizes: tuple[str, ...] = ("--tp", str(TP)),
                        timeout: float = TWO_NODE_TIMEOUT_S) -> tuple[list, list[str], str, Path]:
    """:func:`_two_nodes`, once more on a fresh port if both launchers stalled (a stall at gloo's teardown seen
    before; a job that fails exits, and is not retried); both must have finished with exit code 0."""
    for attempt in range(2):
        procs, _, text, timed_out, out = _two_nodes(tmp_path / f"attempt{attempt}", sizes, timeout)
        if not all(timed_out):
            break
    shown = "\n".join(f"--- node {n} ---\n{t}" for n, t in enumerate(text))
    assert not any(timed_out), f"not finished within {timeout} s\n{shown}"
    assert [p.returncode for p in procs] == [0, 0], shown
    return procs, text, shown, out


def _assert_checkpoint_loads_unsharded(out: Path, summary: dict) -> None:
    """Every rank of both nodes wrote its part of the checkpoint: it loads into the unsharded model, whose loss
    is the run's last."""
    import nanogpt

    from autotp.io.checkpoint import load_unsharded
    from autotp.plan.plan import Plan

    model = nanogpt.build_model().eval()
    load_unsharded(model, Plan.from_json((out / "plan.json").read_text()), out / "checkpoint")
    with torch.no_grad():
        _, loss = model(*nanogpt.example_batch())
    assert abs(loss.item() - summary["final_loss"]) < 1e-5


@pytest.mark.slow
@pytest.mark.extended  # two launchers of two ranks each; tp × dp parity on one launcher: above
def test_shard_two_nodes_on_loopback(tmp_path: Path) -> None:
    # four ranks and two launchers on 2 cores: a rank that polled a tensor-parallel all-reduce without end
    # took the core its peer needed to finish capturing, and a run stalled past a minute about one in ten
    # (py-spy: one rank in the eval graph's all-reduce, three in export); the poll now sleeps after 100 ms
    # (autotp/operators/collectives.py: 0 stalls in 24 runs at 5 ms, none in 5 at 100 ms). One more attempt on
    # a fresh port before failing, for a stall at gloo's teardown seen before (a job that fails exits, and is
    # not retried)
    procs, text, shown, out = _two_nodes_finished(tmp_path)

    # c10d rendezvous numbers the nodes by sorted (hostname, agent pid), not by --node-rank; on one host the
    # first-started node 0 has the lower pid and holds ranks 0-1, unless the pids wrapped in between
    host = 0 if procs[0].pid < procs[1].pid else 1
    other = 1 - host
    assert "tp 2 × dp 2 · DDP (gloo)" in text[host], shown
    assert "parity vs unsharded" in text[host] and "pass" in text[host], shown
    assert f"node {other}: 2 ranks finished" in text[other], shown
    assert "parity" not in text[other], shown

    summary = json.loads((out / "summary.json").read_text())
    assert summary["tp"] == TP and summary["dp"] == 2 and summary["parity"]["ok"]
    assert [(r["rank"], r["tp_rank"], r["dp_rank"]) for r in summary["ranks"]] == \
        [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    assert len(summary["losses"]) == 2
    _assert_checkpoint_loads_unsharded(out, summary)


@pytest.mark.slow
@pytest.mark.extended
def test_shard_pipeline_stages_on_two_nodes_with_world_size(tmp_path: Path) -> None:
    """``--world-size 2 --nnodes 2 --pp 2``: --dp counts every node's replicas (here 1), one rank per node, so
    stage 0 runs on one node and stage 1 on the other (the spelling ``autotp plan --auto`` prints for a pipeline
    over nodes; the per-node --dp could not say it). The loss through the stages matches the unsharded model's
    and the trained checkpoint loads into it."""
    procs, text, shown, out = _two_nodes_finished(tmp_path, ("--tp", "1", "--pp", "2", "--world-size", "2"),
                                                  2 * TWO_NODE_TIMEOUT_S)
    host = 0 if procs[0].pid < procs[1].pid else 1  # the node holding rank 0 (see the test above)
    assert "parity vs unsharded" in text[host] and "pass" in text[host], shown
    assert f"node {1 - host}: 1 ranks finished" in text[1 - host], shown

    summary = json.loads((out / "summary.json").read_text())
    assert (summary["tp"], summary["dp"], summary["pp"]) == (1, 1, 2) and summary["parity"]["ok"]
    assert [(r["rank"], r["pp_rank"]) for r in summary["ranks"]] == [(0, 0), (1, 1)]  # one stage per node
    assert len(summary["losses"]) == 2
    _assert_checkpoint_loads_unsharded(out, summary)
