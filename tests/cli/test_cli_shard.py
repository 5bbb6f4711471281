"""``autotp shard`` and ``autotp run`` end to end on gloo ranks, plus model-file loading and the checkpoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn
from typer.testing import CliRunner

from autotp.cli.main import app
from autotp.capture.modelfile import ModelFileError, default_example, find_loss, load_model_file, split_batch
from autotp.plan.plan import ParamShard, Plan
from autotp.options import Options
from autotp.state import Captured, RankIdentity, TPState, attach_state
from autotp.shard_spec import Segment, shard_tensor
from ranks import ROOT, launch

NANOGPT = os.path.join(ROOT, "examples", "nanogpt.py")
runner = CliRunner()


class Ran(NamedTuple):
    exit_code: int
    stdout: str
    output: str


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[Path, Ran]:
    """The main job as a user runs it, piped: the launcher's and rank 0's lines in one stream."""
    out = tmp_path_factory.mktemp("shard") / "out"
    proc = subprocess.run([sys.executable, "-m", "autotp.cli", "shard", NANOGPT, "--tp", "2", "--steps", "3", "--out",
                           str(out), "--log-every", "2"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "200"})
    return out, Ran(proc.returncode, proc.stdout, proc.stdout + proc.stderr)


@pytest.mark.slow
def test_shard_nanogpt_tp2(sharded) -> None:
    out, result = sharded
    assert result.exit_code == 0, result.output
    assert "pass" in result.stdout and "tol 1e-05" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parity"]["ok"]
    assert summary["parity"]["loss_diff"] <= 1e-5 and summary["parity"]["output_diff"] <= 1e-5
    # the step's TP communication sits exactly at Megatron's formula
    *_, total = summary["comm"]
    assert total[0] == "total" and total[3] == total[4] == 13 and total[5] == total[6] > 0
    assert len(summary["losses"]) == 3 and [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert all(len(r["step_s"]) == 3 for r in summary["ranks"])
    assert all(r["param_bytes"] < summary["unsharded_bytes"] for r in summary["ranks"])
    plan = Plan.from_json((out / "plan.json").read_text())
    assert plan.tp == 2 and plan.params
    per_step = sum(n for *_, n in summary["collectives"])
    assert per_step == len(plan.collectives) > 0


@pytest.mark.slow
@pytest.mark.extended
def test_shard_plans_once_per_job(sharded) -> None:
    """The check before any rank starts plans the model and stores the plan in the job's own cache folder;
    every rank's parallelize shards from it instead of capturing and planning again (the tests' user cache
    is off: the job's folder is its own), and the folder is gone when the command ends."""
    out, result = sharded
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    cached = {r["plan_cached"] for r in summary["ranks"]}
    assert len(cached) == 1 and "autotp-job-plans-" in next(iter(cached)), cached
    assert not Path(next(iter(cached))).exists()
    assert "made once, by the check before the ranks started: all 2 ranks" in " ".join(result.stdout.split())


@pytest.mark.slow
def test_shard_says_each_phase_and_logs_metrics(sharded) -> None:
    """Each phase is said as it starts, with the time since the command started; every --log-every steps
    (and the last) the metrics trainers log go to the console, OUT/metrics.jsonl and TensorBoard; the
    logged gradient norm is the full model's, as on one device."""
    import re

    out, result = sharded
    assert result.exit_code == 0, result.output
    phases = re.findall(r"^\[ *([0-9.]+) s\] (\w+):", result.stdout, flags=re.M)
    names = [p for _, p in phases]
    assert names[:5] == ["check", "launch", "parallelize", "parity", "train"] and names[-2:] == ["save", "save"]
    times = [float(t) for t, _ in phases]
    assert times == sorted(times) and times[0] < 5
    assert "training step 2 loss" in result.stdout and "tok/s" in result.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3]  # every 2nd step, and the last
    summary = json.loads((out / "summary.json").read_text())
    assert [r["loss"] for r in rows] == pytest.approx(summary["losses"][1:], abs=1e-6)
    for r in rows:
        assert r["tokens"] == 4 * 32 and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_s"])
        assert r["tokens_per_s_per_rank"] == pytest.approx(r["tokens_per_s"] / 2)
        assert r["peak_memory"] > 0 and r["lr"] == 1e-3
    assert summary["metrics_path"] == str(out / "metrics.jsonl") and summary["tokens_per_step"] == 128
    assert all(r["peak_memory"] > 0 for r in summary["ranks"])
    assert "throughput (median step)" in result.stdout and f"metrics: {out / 'metrics.jsonl'}" in result.stdout

    # the same steps on one device: the logged norm is the whole model's gradient norm
    import nanogpt

    from autotp.capture.modelfile import replica_batch

    torch.manual_seed(0)
    model = nanogpt.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    norms = []
    for step in range(3):
        a, k = replica_batch(nanogpt.example_batch(), {}, 0, step)
        model(*a, **k)[1].backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        opt.step()
        opt.zero_grad()
    assert [r["grad_norm"] for r in rows] == pytest.approx(norms[1:], rel=1e-5)

    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(summary["tensorboard"])
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/tokens_per_s", "train/grad_norm", "train/peak_memory", "train/step_s"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [2, 3]


@pytest.mark.slow
@pytest.mark.extended
def test_no_steps_trains_and_writes_no_checkpoint(tmp_path: Path) -> None:
    """``--steps 0`` builds, shards and checks the model, and neither steps nor checkpoints (a load check of
    ``--weights`` costs no save)."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "autotp.cli", "shard", NANOGPT, "--tp", "2", "--steps", "0", "--out",
                           str(out)], capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["losses"] == [] and summary["checkpoint_path"] == "" and summary["parity"]["ok"]
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    assert "checkpoint: none (--steps 0" in proc.stdout and "] save:" not in proc.stdout


@pytest.mark.slow
def test_first_line_comes_before_torch_is_imported(tmp_path: Path) -> None:
    """Piped (``| cat``), the command says what it is doing before it imports torch (before: nothing for
    50-100 s). Checked without a clock: a ``torch`` that never finishes importing is put first on the path,
    and the first line still comes. The command is stopped once it has spoken."""
    import select
    import signal

    stuck = tmp_path / "stuck" / "torch"
    stuck.mkdir(parents=True)
    (stuck / "__init__.py").write_text("import time\ntime.sleep(3600)\n")
    env = {**os.environ, "COLUMNS": "80",
           "PYTHONPATH": os.pathsep.join([str(stuck.parent), ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "autotp.cli", "shard", NANOGPT, "--tp", "2", "--out",
                             str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 300)  # a hang guard, not a speed target
        first = proc.stdout.readline() if ready else ""
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert first.startswith("[") and "] check: " in first, first


def _load_worker(out: str) -> tuple[float, float, torch.Tensor]:
    import nanogpt

    import autotp
    from autotp.io.checkpoint import load_checkpoint
    from autotp.distributed.launch import init_distributed

    ctx = init_distributed(tp=2)
    idx, targets = nanogpt.example_batch()
    tpm = autotp.parallelize(nanogpt.build_model(), tp_group=ctx.tp_group(), example_inputs=(idx, targets))
    tpm.eval()
    with torch.no_grad():
        for p in tpm.parameters():
            p.normal_()
        before = tpm(idx, targets)[1].item()
        load_checkpoint(tpm, ctx, Path(out, "checkpoint"))
        logits, loss = tpm(idx, targets)
    return before, loss.item(), logits


@pytest.mark.slow
def test_checkpoint_loads_back_identically(sharded) -> None:
    import nanogpt

    from autotp.io.checkpoint import load_unsharded

    out, result = sharded
    assert result.exit_code == 0, result.output
    final = json.loads((out / "summary.json").read_text())["final_loss"]
    results = launch(_load_worker, 2, str(out))
    for before, loss, _ in results.values():
        assert before != final
        assert loss == final
    assert torch.equal(results[0][2], results[1][2])

    # the checkpoint is in global coordinates: an unsharded model loads it and agrees
    model = nanogpt.build_model().eval()
    load_unsharded(model, Plan.from_json((out / "plan.json").read_text()), out / "checkpoint")
    with torch.no_grad():
        logits, loss = model(*nanogpt.example_batch())
    assert abs(loss.item() - final) < 1e-5
    assert (logits - results[0][2]).abs().max().item() < 1e-5


_GQA = ParamShard("column", "qkv", 0, (Segment(8, 2), Segment(4, 1), Segment(4, 1)), (16, 3), (12, 3))


class _Shards(nn.Module):
    """Stands in for a TPModule: one fused parameter whose k, v segments have fewer blocks than ranks
    (one kv head, tp 2: both ranks hold it), which no planned model exercises yet."""

    def __init__(self, w: torch.Tensor, tp: int):
        super().__init__()
        self.w = nn.Parameter(w)
        self.norm = nn.Parameter(torch.arange(3.0))
        self.plan = Plan(tp=tp, params=(("w", _GQA),))
        st = TPState(RankIdentity(None, tp, 0, torch.device("cpu")), Options(), base=nn.Module, forward=None)
        st.shards, st.graphs = {"w": _GQA}, {"call": Captured(nn.Identity(), self.plan, None)}
        attach_state(self, st)


def _gqa_worker(out: str) -> bool:
    from autotp.io.checkpoint import load_checkpoint, save_checkpoint
    from autotp.distributed.launch import init_distributed

    ctx = init_distributed(tp=2)
    full = torch.arange(48.0).view(16, 3)
    m = _Shards(shard_tensor(full, _GQA.dim, _GQA.segments, 2, ctx.rank), 2)
    want = m.w.detach().clone()
    save_checkpoint(m, ctx, out)
    with torch.no_grad():
        m.w.zero_()
    load_checkpoint(m, ctx, out)
    return torch.equal(m.w, want)


@pytest.mark.slow
def test_checkpoint_replicated_kv_blocks(tmp_path: Path) -> None:
    from autotp.io.checkpoint import load_unsharded

    assert all(launch(_gqa_worker, 2, str(tmp_path / "ckpt")).values())
    full = _Shards(torch.zeros(16, 3), 1)
    load_unsharded(full, full.plan, tmp_path / "ckpt")
    assert torch.equal(full.w, torch.arange(48.0).view(16, 3))


def test_model_file_without_factory_lists_names(tmp_path: Path) -> None:
    path = tmp_path / "nofactory.py"
    path.write_text("import torch\nfrom torch import nn\n\nclass Tiny(nn.Module):\n    pass\n\n"
                    "WIDTH = 8\n\ndef helper():\n    return 1\n")
    result = runner.invoke(app, ["shard", str(path), "--tp", "2"], env={"COLUMNS": "500"})
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1
    assert "build_model" in result.stderr
    assert "Tiny, WIDTH, helper" in result.stderr
    assert "torch" not in result.stderr.split("defines:")[1].split("hint")[0]


def test_model_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="does not exist"):
        load_model_file(tmp_path / "missing.py")
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\nraise RuntimeError('no weights here')\n")
    with pytest.raises(ModelFileError, match=r"line 2: RuntimeError: no weights here"):
        load_model_file(bad)
    named = tmp_path / "named.py"
    named.write_text("import torch\ndef make():\n    return torch.nn.Linear(2, 2)\n")
    assert isinstance(load_model_file(f"{named}:make").build(), nn.Linear)
    with pytest.raises(ModelFileError, match="defines no `other`"):
        load_model_file(f"{named}:other")


def test_batch_and_loss_conventions() -> None:
    x = torch.zeros(2)
    assert split_batch((x, x)) == ((x, x), {})
    assert split_batch({"a": x}) == ((), {"a": x})
    assert split_batch(((x,), {"a": x})) == ((x,), {"a": x})
    loss = torch.tensor(1.5)
    assert find_loss((x, loss)) is loss
    assert find_loss({"loss": loss}) is loss
    assert find_loss((x, x)) is None


def _tiny_gpt_file(path: Path, batch: str) -> Path:
    """A one-layer nanoGPT model file (vocab 256) with ``batch`` as its example_batch() source, if any."""
    path.write_text(textwrap.dedent(f"""
        import sys
        import torch
        sys.path.insert(0, {os.path.join(ROOT, "examples")!r})
        from nanogpt import GPT, GPTConfig

        CONFIG = GPTConfig(n_layer=1, n_embd=32, n_head=2)

        def build_model():
            return GPT(CONFIG)
    """) + textwrap.dedent(batch))
    return path


@pytest.mark.slow
@pytest.mark.extended
def test_shard_unseeded_example_batch(tmp_path: Path) -> None:
    # each rank drawing its own ids would be refused (InputMismatchError): tp rank 0's batch is broadcast
    model = _tiny_gpt_file(tmp_path / "unseeded.py", """
        def example_batch():
            ids = torch.randint(0, CONFIG.vocab_size, (2, 16))
            return ids, torch.randint(0, CONFIG.vocab_size, (2, 16))
    """)
    out = tmp_path / "out"
    result = runner.invoke(app, ["shard", str(model), "--tp", "2", "--steps", "2", "--out", str(out)],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parity"]["ok"] and summary["parity"]["loss_diff"] is not None
    assert len(summary["losses"]) == 2 and summary["final_loss"] is not None and not summary["training_skipped"]
    assert summary["batch"].startswith("example_batch(): (2, 16), (2, 16)") and "broadcast" in summary["batch"]
    assert summary["checkpoint_path"].endswith("step-000002")


@pytest.mark.slow
@pytest.mark.extended
def test_shard_without_example_batch(tmp_path: Path) -> None:
    model = _tiny_gpt_file(tmp_path / "no_batch.py", "")
    out = tmp_path / "out"
    result = runner.invoke(app, ["shard", str(model), "--tp", "2", "--steps", "2", "--out", str(out)],
                           env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "default" in result.stdout and "(2, 8) token ids (ids < 256, seed 0)" in result.stdout
    assert "skipped" in result.stdout and "no targets" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    # the parity check ran on the default batch: nanoGPT returns logits and no loss without targets
    assert summary["parity"]["ok"] and summary["parity"]["loss_diff"] is None
    assert summary["parity"]["output_diff"] <= 1e-5
    assert summary["losses"] == [] and summary["final_loss"] is None and summary["training_skipped"]
    assert all(r["step_s"] == [] for r in summary["ranks"])
    assert summary["comm"] == []  # no training step to compare with the formula
    assert Plan.from_json((out / "plan.json").read_text()).tp == 2
    # the checkpoint is the step reached, 0, not --steps: resuming would train from the start
    assert summary["checkpoint_path"].endswith("step-000000")
    assert json.loads(Path(summary["checkpoint_path"], "autotp.json").read_text())["step"] == 0


def test_default_example_is_parallelize_default() -> None:
    from autotp.parallel import parallelize

    assert parallelize._default_example is default_example  # one definition for the API and the CLI

    def forward(idx, use_cache=True):
        return idx

    (ids,), kwargs = default_example(forward)
    assert ids.shape == (2, 8) and ids.dtype == torch.long and not ids.any() and kwargs == {"use_cache": False}
    (drawn,), kwargs = default_example(lambda idx: idx, vocab=256)
    assert kwargs == {} and drawn.shape == (2, 8) and 0 <= drawn.min() and drawn.max() < 256
    assert drawn.unique().numel() > 1 and torch.equal(drawn, default_example(lambda idx: idx, vocab=256)[0][0])


@pytest.mark.slow
def test_autotp_run_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\nimport torch.distributed as dist\nimport autotp\n"
        "from autotp.distributed.launch import current_tp_group, init_from_env\n"
        f"sys.path.insert(0, {os.path.join(ROOT, 'examples')!r})\n"
        "from nanogpt import GPT, GPTConfig\n"
        "ctx = init_from_env()\n"
        "assert current_tp_group() is ctx.tp_group()\n"
        "tpm = autotp.parallelize(GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2)), tp_group=current_tp_group())\n"
        "print(f'tp rank {autotp.tp_state(tpm).rank} of {autotp.tp_state(tpm).tp} args {sys.argv[1:]}', flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    cmd = [sys.executable, "-m", "autotp.cli", "run", str(script), "--tp", "2", "--", "--data", "x"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"tp rank {rank} of 2 args ['--data', 'x']" in proc.stdout


@pytest.mark.slow
@pytest.mark.extended
def test_autotp_run_failing_script(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    result = runner.invoke(app, ["run", str(script), "--tp", "2"], env={"COLUMNS": "500"})
    assert result.exit_code == 3
    *phases, error = result.stderr.strip().splitlines()  # the phase lines (check, launch), then one error line
    assert "exit code 3" in error and error.startswith("error: ") and all(p.startswith("[") for p in phases), phases


def test_a_save_says_that_it_saves_where_and_how_long(tmp_path: Path, capsys) -> None:
    """The final checkpoint save takes seconds: rank 0 says it is saving, then where it saved and in how long."""
    import torch.distributed as dist

    from autotp.cli.shard_worker import saving

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        path = saving(lambda step: tmp_path / f"step-{step:06d}", 3)
    finally:
        dist.destroy_process_group()
    lines = capsys.readouterr().out.splitlines()
    assert path == tmp_path / "step-000003"
    assert lines[0].endswith("] save: checkpoint of step 3 …"), lines
    assert f"] save: wrote {path} in " in lines[1] and lines[1].endswith(" s"), lines
