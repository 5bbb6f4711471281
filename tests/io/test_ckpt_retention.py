"""Nothing complete is ever deleted unasked: a damaged ``latest`` pointer with ``--resume`` is an error naming
the complete checkpoints (never a fresh start whose next save removed them), a new run refuses a folder that
holds another run's checkpoints, ``--keep N`` thins only the run's own checkpoints, and a failed resume writes
nothing. The CLI refusals happen before any rank starts."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotp.cli.main import app
from autotp.errors import CheckpointError
from autotp.io.ckpt_io import _publish, complete_checkpoints, resume_target
from ranks import ROOT

runner = CliRunner()
NANOGPT = os.path.join(ROOT, "examples", "nanogpt.py")


def _checkpoint(run_dir: Path, name: str, run: str = "earlier", complete: bool = True) -> Path:
    """A step folder as a save leaves it: DCP's metadata and autotp's manifest (contents not read here)."""
    path = run_dir / "checkpoints" / name
    path.mkdir(parents=True)
    if complete:
        (path / ".metadata").write_bytes(b"")
    (path / "autotp.json").write_text(json.dumps({"format": 2, "run": run}))
    return path


def _point(run_dir: Path, name: str) -> None:
    (run_dir / "checkpoints" / "latest").write_text(name + "\n")


def test_resume_reads_latest(tmp_path: Path):
    assert resume_target(tmp_path) is None  # a fresh folder: nothing to resume
    one = _checkpoint(tmp_path, "step-000001")
    _point(tmp_path, "step-000001")
    assert resume_target(tmp_path) == one
    assert resume_target(tmp_path, "step-000001") == one
    assert resume_target(tmp_path, str(one)) == one  # a path works too


@pytest.mark.parametrize("pointer", ["step-000777", "../../../etc", "", None, "step-000002"])
def test_a_damaged_pointer_is_an_error_naming_what_can_be_resumed(tmp_path: Path, pointer: str | None):
    _checkpoint(tmp_path, "step-000001")
    _checkpoint(tmp_path, "step-000002", complete=False)  # a step folder without DCP's metadata
    if pointer is not None:
        _point(tmp_path, pointer)
    with pytest.raises(CheckpointError) as err:
        resume_target(tmp_path)
    assert "step-000001" in str(err.value) and "--resume-from" in str(err.value)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000001"]


def test_a_chosen_checkpoint_must_be_complete(tmp_path: Path):
    _checkpoint(tmp_path, "step-000001")
    _checkpoint(tmp_path, "step-000002", complete=False)
    with pytest.raises(CheckpointError, match="step-000002 is not a complete checkpoint.*step-000001"):
        resume_target(tmp_path, "step-000002")


def _save(run_dir: Path, step: int, run: str, keep: int | None) -> Path:
    """What a save leaves before rank 0 publishes it: a finished temporary folder."""
    staged = _checkpoint(run_dir, f".tmp-step-{step:06d}", run=run)
    return _publish(run_dir / "checkpoints", staged, step, run, keep)


def test_publishing_keeps_every_checkpoint_unless_asked(tmp_path: Path):
    _checkpoint(tmp_path, "step-000003", run="earlier")
    (tmp_path / "checkpoints" / ".tmp-step-000009").mkdir()  # a crashed save's leftovers
    for step in (1, 2, 3):
        _save(tmp_path, step, "now", keep=None)
    names = [p.name for p in complete_checkpoints(tmp_path)]
    assert names == ["step-000001", "step-000002", "step-000003", "step-000003-1"]  # same-numbered: beside it
    assert not (tmp_path / "checkpoints" / ".tmp-step-000009").exists()
    assert resume_target(tmp_path).name == "step-000003-1"


def test_a_folder_where_the_link_goes_is_left_alone(tmp_path: Path):
    old = tmp_path / "checkpoint"  # a checkpoint folder of the older, non-atomic layout
    old.mkdir()
    (old / "model.pt").write_bytes(b"weights")
    _save(tmp_path, 1, "now", keep=None)
    assert (old / "model.pt").read_bytes() == b"weights" and not old.is_symlink()
    assert resume_target(tmp_path).name == "step-000001"


def test_keep_thins_only_this_runs_checkpoints(tmp_path: Path):
    _checkpoint(tmp_path, "step-000001", run="earlier")
    for step in (2, 3, 4):
        last = _save(tmp_path, step, "now", keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000001", "step-000003", "step-000004"]
    assert resume_target(tmp_path) == last


def _shard(out: Path, *extra: str):
    return runner.invoke(app, ["shard", NANOGPT, "--tp", "2", "--steps", "1", "--out", str(out), *extra],
                         env={"COLUMNS": "300"})


def test_cli_refuses_a_damaged_pointer_before_any_rank_starts(tmp_path: Path):
    _checkpoint(tmp_path, "step-000001")
    _point(tmp_path, "step-000777")
    result = _shard(tmp_path, "--resume")
    assert result.exit_code == 2, result.output
    assert "step-000777" in result.output and "--resume-from NAME (step-000001)" in result.output
    assert (tmp_path / "checkpoints" / "step-000001" / ".metadata").is_file()


def test_cli_refuses_a_new_run_beside_another_runs_checkpoints(tmp_path: Path):
    _checkpoint(tmp_path, "step-000003")
    _point(tmp_path, "step-000003")
    result = _shard(tmp_path)
    assert result.exit_code == 2, result.output
    assert "--resume" in result.output and "--out" in result.output and "step-000003" in result.output
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000003"]
    assert not (tmp_path / "plan.json").exists()


WIDER = f"""
import sys
sys.path.insert(0, {os.path.join(ROOT, "examples")!r})
from nanogpt import GPT, GPTConfig, example_batch


def build_model():
    return GPT(GPTConfig(n_embd=128))
"""


@pytest.mark.slow
def test_a_failed_resume_writes_nothing(tmp_path: Path):
    out = tmp_path / "run"
    first = _shard(out, "--no-verify")
    assert first.exit_code == 0, first.output
    assert f"output: {out}" in first.output.replace("\n", "")
    plan = (out / "plan.json").read_text()
    wider = tmp_path / "wider.py"
    wider.write_text(WIDER)
    result = runner.invoke(app, ["shard", str(wider), "--tp", "2", "--steps", "2", "--resume", "--no-verify",
                                 "--out", str(out)], env={"COLUMNS": "300"})
    assert result.exit_code != 0, result.output
    assert (out / "plan.json").read_text() == plan  # the other model's plan was not written over it
    assert [p.name for p in complete_checkpoints(out)] == ["step-000001"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000001"
    # a shard file whose first 64 bytes are zeroed: its checksum refuses it, in one line, no rank's traceback
    # (with the checksums stripped, DCP's own failure is one line too: test_a_checkpoint_failure_is_one_line...)
    shard = out / "checkpoints" / "step-000001" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[:64] = bytes(64)
    shard.write_bytes(bytes(data))
    damaged = _shard(out, "--resume", "--no-verify", "--steps", "2")  # at step 1 of 1 no rank would load it
    assert damaged.exit_code == 1, damaged.output
    lines = damaged.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank "), damaged.stderr
    assert f"{shard} does not match its checksum" in lines[0] and "--resume-from" in lines[0], lines[0]


def test_a_checkpoint_failure_is_one_line_with_its_cause(tmp_path: Path):
    """DCP wraps each rank's error in CheckpointException (a BaseException whose text is every rank's
    traceback): what reaches the user is the first cause, an OSError by its errno's name."""
    import errno

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from autotp.io.ckpt_safety import cause, safe_load

    full = OSError(errno.ENOSPC, "No space left on device", "/run/checkpoints/.tmp-step-000002/__0_0.distcp")
    assert cause(CheckpointException("save", {1: (full, None)})) == \
        "No space left on device (ENOSPC): /run/checkpoints/.tmp-step-000002/__0_0.distcp"
    dcp.save({"w": torch.randn(8, 8)}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    shard = tmp_path / "c" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[:64] = bytes(64)  # the first 64 bytes flipped to zeros: the tensor file's header is gone
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        safe_load({"w": torch.zeros(8, 8)}, tmp_path / "c", no_dist=True)
    first = str(err.value).splitlines()[0]
    assert first.startswith(f"cannot load checkpoint {tmp_path / 'c'}: UnpicklingError") and "Traceback" not in first



def test_cli_refuses_an_unwritable_out_and_a_model_without_parameters(tmp_path: Path):
    result = _shard(Path("/proc/autotp-run"))
    assert result.exit_code == 2, result.output
    assert "--out /proc/autotp-run cannot be written" in result.output and "(ENOENT)" in result.output
    empty = tmp_path / "empty.py"
    empty.write_text("import torch\n\n\ndef build_model():\n    return torch.nn.Identity()\n")
    result = runner.invoke(app, ["shard", str(empty), "--tp", "2", "--out", str(tmp_path / "out")],
                           env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert "Identity has no parameters" in result.output


@pytest.mark.slow
@pytest.mark.extended
def test_a_restart_resumes_from_its_own_newest_checkpoint(tmp_path: Path):
    """--resume-from step 2, a checkpoint at step 3, then rank 1 dies in the save of step 4: the elastic
    restart resumes from step 3, this run's own, not from the step 2 the command named."""
    from test_reliability import CRASHY

    out = tmp_path / "run"
    first = runner.invoke(app, ["shard", NANOGPT, "--tp", "2", "--steps", "2", "--no-verify", "--out", str(out)])
    assert first.exit_code == 0, first.output
    crashy = tmp_path / "crashy.py"
    crashy.write_text(CRASHY)
    marker = tmp_path / "crashed"
    env = {**os.environ, "CRASH_AT_SAVE": "2", "CRASH_MARKER": str(marker), "COLUMNS": "300"}
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "autotp.cli", "shard", str(crashy), "--tp", "2", "--steps", "5",
                           "--save-every", "1", "--no-verify", "--resume-from", "step-000002", "--max-restarts", "1",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker.read_text() == "crashed\n"  # the first attempt did die
    summary = json.loads((out / "summary.json").read_text())
    assert summary["start_step"] == 3 and len(summary["losses"]) == 2, summary
    assert [p.name for p in complete_checkpoints(out)] == ["step-000002", "step-000003", "step-000004",
                                                           "step-000005"]
