"""Interrupting ``autotp shard`` as people do: Ctrl-C's SIGINT to the launcher, and a scheduler's SIGTERM to the
whole process group of a command started without a terminal (its own session, as setsid or a job scheduler
starts it). Each time: the exit code a shell gives (130 / 143), within seconds, one line naming the step kept,
that step's checkpoint complete and loading bit-identically to the same step of an uninterrupted run, and
nothing newer written after the command ended. Plus the pieces without processes: the ranks' agreement on a
stop, the line, and the metrics a resume keeps."""
from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autotp.cli.run_folder import interrupted_line, traces, truncate_metrics
from autotp.errors import LaunchInterrupted
from autotp.io.ckpt_io import complete_checkpoints, latest_checkpoint
from test_reliability import NANOGPT, ROOT, _params, _shard

STOP_S = 10  # the bound from the signal to the command's exit


def _interrupt(out: Path, how: str) -> tuple[int, list[str], float]:
    """Start a long run, signal it once its 3rd step is logged; (exit code, lines after the signal, seconds to exit)."""
    cmd = [sys.executable, "-m", "autotp.cli", "shard", NANOGPT, "--tp", "2", "--steps", "100000", "--no-verify",
           "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "COLUMNS": "200"}, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("training step 3 "):
                break
        else:
            pytest.fail("the run ended before training")
        sent = time.monotonic()
        if how == "int":
            os.kill(proc.pid, signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        rest = proc.stdout.read()
        proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, [ln for ln in rest.splitlines() if not ln.startswith("training step")], took


@pytest.mark.slow
@pytest.mark.parametrize("how, code, name", [("int", 130, "SIGINT"),
                                             pytest.param("term", 143, "SIGTERM", marks=pytest.mark.extended)])
def test_interrupt_keeps_the_finished_step(tmp_path, how, code, name) -> None:
    out = tmp_path / "run"
    rc, lines, took = _interrupt(out, how)
    assert rc == code, lines
    assert took < STOP_S, took
    assert len(lines) == 1, lines
    kept = latest_checkpoint(out)
    assert kept is not None and complete_checkpoints(out) == [kept], lines
    step = int(kept.name.split("-")[1])
    assert step >= 3
    assert lines[0] == f"interrupted by {name} at step {step}: saved checkpoints/{kept.name}; continue with --resume"
    newest = max(p.stat().st_mtime for p in out.rglob("*"))
    time.sleep(2)  # nothing is written after the command ended
    assert max(p.stat().st_mtime for p in out.rglob("*")) == newest
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", kept.name]
    if how == "term":  # resumed: each step logged once; --save-minutes saves by the clock between the steps
        rc, text = _shard(NANOGPT, out, "--steps", str(step + 6), "--no-verify", "--resume", "--save-minutes",
                          "0.002")
        assert rc == 0, text
        logged = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
        assert logged == list(range(1, step + 7)), logged
        between = [p.name for p in complete_checkpoints(out) if step < int(p.name.split("-")[1]) < step + 6]
        assert between, [p.name for p in complete_checkpoints(out)]
    if how == "int":  # the same step of an uninterrupted run, bit for bit
        ref = tmp_path / "ref"
        rc, text = _shard(NANOGPT, ref, "--steps", str(step), "--no-verify")
        assert rc == 0, text
        got, want = _params(out, kept), _params(ref, latest_checkpoint(ref))
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_interrupted_line_names_the_kept_step(tmp_path) -> None:
    ckpt = tmp_path / "checkpoints" / "step-000007"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"")
    (ckpt / "autotp.json").write_text(json.dumps({"step": 7, "run": "r1"}))
    (tmp_path / "checkpoints" / "latest").write_text("step-000007")
    exc = LaunchInterrupted(signal.SIGINT)
    assert exc.code == 130 and LaunchInterrupted(signal.SIGTERM).code == 143
    assert interrupted_line(exc, tmp_path, "r1") == \
        "interrupted by SIGINT at step 7: saved checkpoints/step-000007; continue with --resume"
    assert "before this run's first checkpoint: the newest is still checkpoints/step-000007 (step 7)" in \
        interrupted_line(exc, tmp_path, "r2")
    assert interrupted_line(exc, tmp_path / "empty", "r1").endswith("before the first checkpoint: nothing was "
                                                                      f"saved in {tmp_path / 'empty'}")


def test_metrics_truncated_to_the_resumed_step(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 8)) + '{"step": 8, "lo')
    truncate_metrics(path, 5)
    assert [json.loads(ln)["step"] for ln in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    truncate_metrics(tmp_path / "none.jsonl", 3)  # no file: nothing to do
    assert not (tmp_path / "none.jsonl").exists()
    assert traces(tmp_path) == ["metrics.jsonl"]
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "plan.json").write_text("{}")
    assert traces(tmp_path) == ["plan.json"]  # a plan and no summary: the run did not finish
    (tmp_path / "summary.json").write_text("{}")
    assert traces(tmp_path) == []  # a finished run that trained nothing (--steps 0)


def test_new_run_refused_beside_an_interrupted_runs_traces(tmp_path) -> None:
    from typer.testing import CliRunner

    from autotp.cli.main import app

    (tmp_path / "plan.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    result = CliRunner().invoke(app, ["shard", NANOGPT, "--tp", "2", "--out", str(tmp_path)],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert "already holds a run's files (plan.json, metrics.jsonl)" in result.output
    assert "--resume" in result.output
    assert (tmp_path / "plan.json").read_text() == "{}"


@pytest.mark.slow
@pytest.mark.extended
def test_resume_at_the_final_step_says_so(tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from autotp.cli.main import app

    rc, text = _shard(NANOGPT, tmp_path, "--steps", "2", "--no-verify")
    assert rc == 0, text
    metrics = (tmp_path / "metrics.jsonl").read_text()
    monkeypatch.setattr("autotp.distributed.launch.launch", lambda *a, **k: pytest.fail("a rank was started"))
    result = CliRunner().invoke(app, ["shard", NANOGPT, "--tp", "2", "--steps", "2", "--resume", "--out",
                                      str(tmp_path)], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "already at step 2 of 2" in result.output and "give --steps N to train further" in result.output
    assert (tmp_path / "metrics.jsonl").read_text() == metrics


@pytest.mark.parametrize("layout", ["folder", "file"])
def test_garbage_safetensors_names_the_file(tmp_path, layout) -> None:
    from autotp.errors import CheckpointError
    from autotp.io.sources import open_source

    folder = tmp_path / "w"
    folder.mkdir()
    bad = folder / "model.safetensors"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=f"^{bad} is not a readable safetensors file: .+"):
        open_source(folder if layout == "folder" else bad)


def test_resume_from_a_missing_folder_says_it_does_not_exist(tmp_path) -> None:
    from autotp.errors import CheckpointError
    from autotp.io.ckpt_io import resume_target

    with pytest.raises(CheckpointError, match="/no/such/dir does not exist"):
        resume_target(tmp_path, "/no/such/dir")


@pytest.mark.slow
def test_autotp_run_names_the_rank_that_raised(tmp_path) -> None:
    script = tmp_path / "raises.py"
    script.write_text("import os, sys, time\nimport torch.distributed\n"  # the rank's peers wait until stopped
                      "print('[rank0]: a line a rank prefixes itself', flush=True)\n"
                      "if os.environ['RANK'] == '0':\n    raise ValueError('boom on rank 0')\ntime.sleep(120)\n")
    proc = subprocess.run([sys.executable, "-m", "autotp.cli", "run", str(script), "--tp", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"error: {script}: rank 0: ValueError: boom on rank 0 (of 2 ranks)", proc.stderr
    assert "[rank0]:[rank0]:" not in proc.stdout + proc.stderr


def test_version() -> None:
    from importlib.metadata import version

    from typer.testing import CliRunner

    from autotp.cli.main import app

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"autotp {version('autotp')}\n", result.output


@pytest.mark.parametrize("example, blocked, extra", [("llama.py", "transformers", "autotp[hf]"),
                                                    ("hf_trainer.py", "transformers", "autotp[hf]"),
                                                    ("fabric_train.py", "lightning_fabric", "autotp[lightning]")])
def test_examples_name_the_extra_they_need(example, blocked, extra) -> None:
    import runpy

    path = Path(ROOT) / "examples" / example
    hidden = {name: None for name in (blocked, "lightning")}  # None in sys.modules: the import fails
    saved = {name: sys.modules.get(name) for name in hidden}
    sys.modules.update(hidden)
    try:
        with pytest.raises(ImportError, match=re.escape(f"pip install '{extra}'")):
            runpy.run_path(str(path), run_name="not_main")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@pytest.mark.parametrize("example, blocked, extra", [("llama.py", "transformers", "autotp[hf]"),
                                                    ("hf_trainer.py", "transformers", "autotp[hf]"),
                                                    ("fabric_train.py", "lightning_fabric", "autotp[lightning]")])
def test_examples_missing_their_extra_say_one_line(example, blocked, extra) -> None:
    """Run as a script (``python examples/fabric_train.py``, or each rank of ``autotp run``) an example ends
    with one line naming its extra, not a traceback; a model file (``autotp shard examples/llama.py``) is
    refused with the same words in autotp's one line."""
    import runpy

    from autotp.capture.modelfile import ModelFileError, load_model_file

    path = Path(ROOT) / "examples" / example
    hidden = {name: None for name in (blocked, "lightning")}
    saved = {name: sys.modules.get(name) for name in hidden}
    sys.modules.update(hidden)
    try:
        if example == "llama.py":
            with pytest.raises(ModelFileError) as failed:
                load_model_file(str(path))
            said = str(failed.value)
        else:
            with pytest.raises(SystemExit) as failed:
                runpy.run_path(str(path), run_name="__main__")
            said = failed.value.code
        assert said.count("\n") == 0 and f"pip install '{extra}'" in said, said
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
