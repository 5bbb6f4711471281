"""Reliability of ``autotp shard`` (issue 6): atomic checkpoints, resume, failing ranks, and the catalog of
bad inputs that must fail in the launching process, before any rank starts."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from autotp.cli.main import app
from autotp.io.ckpt_io import checkpoint_info, latest_checkpoint
from autotp.distributed.job import ENV_JOB, RankJob, job_from_env
from autotp.distributed.launch import LaunchSpec, launch
from autotp.distributed.rank_grid import RankGrid
from ranks import ROOT
from readme import readme_folder, run_readme
from torch.distributed.elastic.utils.distributed import get_free_port

NANOGPT = os.path.join(ROOT, "examples", "nanogpt.py")
EXAMPLES = os.path.join(ROOT, "examples")
RUN_TIMEOUT_S = 240
TOL = 1e-6
runner = CliRunner()

# nanoGPT behind a wrapper that can crash rank 1 (tests/io/test_ckpt_retention.py's restarts) in the middle of its CRASH_AT_SAVE-th checkpoint save (first
# attempt of the job only): its data files are written, the checkpoint's metadata is not (DCP's coordinator,
# rank 0, writes it after every rank finished)
CRASHY = f"""
import os, sys
sys.path.insert(0, {EXAMPLES!r})
from nanogpt import build_model, example_batch

if os.environ.get("CRASH_AT_SAVE") and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    import torch.distributed as dist
    from torch.distributed.checkpoint import filesystem

    _write = filesystem.FileSystemWriter.write_data
    _saves = [0]

    def _crashing_write(self, plan, planner):
        fut = _write(self, plan, planner)
        fut.wait()
        _saves[0] += 1
        if dist.get_rank() == 1 and _saves[0] == int(os.environ["CRASH_AT_SAVE"]):
            with open(os.environ["CRASH_MARKER"], "a") as f:
                f.write("crashed\\n")
            os._exit(17)
        return fut

    filesystem.FileSystemWriter.write_data = _crashing_write
"""

# nanoGPT whose graph ends in a custom op: autotp runs the captured graph, not the user's forward, so a
# Python `raise` in forward would only run at capture; the op runs every step and fails as told by the env
FAULTY = f"""
import os, sys, time
sys.path.insert(0, {EXAMPLES!r})
import torch
import torch.distributed as dist
from torch import nn
import nanogpt

_calls = [0]


@torch.library.custom_op("autotp_test::fault_point", mutates_args=())
def fault_point(x: torch.Tensor) -> torch.Tensor:
    _calls[0] += 1
    step = _calls[0] - 1  # call 1 is the parity check, then one call per training step
    rank = dist.get_rank() if dist.is_initialized() else -1
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if rank == 1 and step == 2 and first_attempt:
        if os.environ.get("FAULT") == "hang":
            time.sleep(600)
        raise RuntimeError(f"injected fault on rank {{rank}} at step {{step}}")
    return x.clone()


@fault_point.register_fake
def _(x):
    return torch.empty_like(x)


fault_point.register_autograd(lambda ctx, g: g)


class Faulty(nn.Module):
    def __init__(self):
        super().__init__()
        self.gpt = nanogpt.build_model()

    def forward(self, idx, targets):
        logits, loss = self.gpt(idx, targets)
        return logits, fault_point(loss)


def build_model():
    return Faulty()


example_batch = nanogpt.example_batch
"""


def _shard(model: str | Path, out: Path, *extra: str, env: dict | None = None, tp: int = 2) -> tuple[int, str]:
    """``autotp shard`` in a fresh process group (session); (exit code, stdout+stderr). ``RUN_TIMEOUT_S`` is
    a hang guard (a hanging rank sleeps 600 s), not a speed target."""
    cmd = [sys.executable, "-m", "autotp.cli", "shard", str(model), "--tp", str(tp), "--out", str(out), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "COLUMNS": "200", **(env or {})}, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        pytest.fail(f"autotp shard {extra} did not finish within {RUN_TIMEOUT_S} s\n{text}")
    return proc.returncode, text


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _params(out: Path, checkpoint: str | Path) -> dict[str, torch.Tensor]:
    import nanogpt

    from autotp.io.checkpoint import load_unsharded
    from autotp.plan.plan import Plan

    model = nanogpt.build_model()
    load_unsharded(model, Plan.from_json((out / "plan.json").read_text()), checkpoint)
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


# -- 1 and 2: resume (a crash at each point of a save: tests/e2e/test_faults.py) --------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("reliability")
    res: dict = {"tmp": tmp}
    res["full"] = _shard(NANOGPT, tmp / "full", "--steps", "6", "--save-every", "3", "--no-verify")
    # the README's: three steps at tp 2, then resumed at tp 4 up to step 6 (weights and AdamW state resharded)
    here = readme_folder(tmp / "readme")
    res["saved"] = run_readme("autotp shard examples/nanogpt.py --tp 2 --steps 3 --out autotp-out", here)
    # wide: the summary's table would otherwise wrap its cells by the length of the temporary folder's path
    res["resumed"] = run_readme("autotp shard examples/nanogpt.py --tp 4 --steps 6 --out autotp-out --resume", here,
                                columns=250)
    res["out"] = here / "autotp-out"
    return res


@pytest.mark.slow
def test_resume_at_another_tp_matches_uninterrupted_training(runs) -> None:
    """The README's resume at another tp continues the uninterrupted run's losses and weights; the new
    checkpoint sits beside the one resumed from, its manifest naming the layout and the optimizer."""
    for proc in (runs["saved"], runs["resumed"]):
        assert proc.returncode == 0, proc.stdout + proc.stderr
    text = " ".join(runs["resumed"].stdout.split())  # as read, whatever the terminal's width wrapped
    assert "from step 3" in text and "resumed from tp 2 → tp 4: weights and optimizer state resharded" in text, text
    full, resumed = _summary(runs["tmp"] / "full"), _summary(runs["out"])
    assert resumed["tp"] == 4 and resumed["start_step"] == 3 and len(resumed["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(resumed["losses"], full["losses"][3:])) <= 1e-5, \
        (resumed["losses"], full["losses"])
    want = _params(runs["tmp"] / "full", full["checkpoint_path"])
    got = _params(runs["out"], resumed["checkpoint_path"])
    assert want.keys() == got.keys()
    assert max((want[n] - got[n]).abs().max().item() for n in want) <= 1e-5
    ckpts = runs["out"] / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000003", "step-000006"]
    info = checkpoint_info(ckpts / "step-000006")
    assert {k: info[k] for k in ("format", "step", "tp", "dp", "world_size")} == \
        {"format": 2, "step": 6, "tp": 4, "dp": 1, "world_size": 4}
    assert info["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    assert info["optimizer"]["param_groups"][0]["lr"] == 1e-3


class _Payload:
    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):  # unpickling creates the file
        return open, (self.path, "w")


@pytest.mark.slow
def test_tampered_checkpoint_fails_before_any_rank(runs, monkeypatch, tmp_path: Path) -> None:
    import pickle

    out = tmp_path / "out"
    shutil.copytree(runs["tmp"] / "full", out, symlinks=True)
    metadata = latest_checkpoint(out) / ".metadata"
    marker = tmp_path / "pwned"
    metadata.write_bytes(pickle.dumps(_Payload(marker)))
    manifest = metadata.parent / "autotp.json"  # the manifest rewritten too: its checksums would refuse it first
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items()
                                    if k not in ("files", "manifest_crc32")}))
    # `autotp shard` imports the launcher when it runs (its --help imports no torch): patched where it is defined
    monkeypatch.setattr("autotp.distributed.launch.launch", lambda *a, **k: pytest.fail("a rank was started"))
    result = runner.invoke(app, ["shard", NANOGPT, "--tp", "4", "--resume", "--out", str(out)],
                           env={"COLUMNS": "500"})
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {metadata} is not checkpoint metadata"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not marker.exists()


# -- 3: faults ------------------------------------------------------------------------------------------------
@pytest.fixture
def faulty(tmp_path: Path) -> Path:
    path = tmp_path / "faulty.py"
    path.write_text(FAULTY)
    return path


def _first_failure_line(text: str) -> str:
    # the first line that is not progress: phase lines ("[  3.1 s] parity: …"), steps, the output folder
    lines = [ln for ln in text.splitlines()
             if ln.strip() and not ln.lstrip().startswith(("training", "output:")) and not re.match(r"\[ *[0-9.]+ s\] ", ln)]
    return lines[0] if lines else ""


@pytest.mark.slow
def test_failing_rank_fails_the_job_fast_and_first(faulty: Path, tmp_path: Path) -> None:
    code, text = _shard(faulty, tmp_path / "out", "--steps", "4", "--timeout", "30")
    assert code != 0, text
    assert "Traceback" not in text
    first = _first_failure_line(text)
    assert first.startswith("error: rank 1:") and "injected fault on rank 1 at step 2" in first, text


@pytest.mark.slow
@pytest.mark.extended
def test_hanging_rank_is_bounded_by_timeout(faulty: Path, tmp_path: Path) -> None:
    # rank 1 never reaches the next collective; rank 0's waits end after --timeout, and with it the job
    code, text = _shard(faulty, tmp_path / "out", "--steps", "3", "--timeout", "3",
                                 env={"FAULT": "hang"})
    assert code != 0, text
    first = _first_failure_line(text)
    assert first.startswith("error: rank ") and "no peer answered within --timeout 3 s" in first, text


def _fails_first_attempt() -> dict[str, str | None]:
    """Rank 1 dies on the job's first attempt; every rank reports the attempt it finished and its timeout."""
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if attempt == "0" and os.environ["RANK"] == "1":
        raise RuntimeError("rank 1 fails its first attempt")
    return {"attempt": attempt, "timeout": job_from_env().timeout}


@pytest.mark.slow
@pytest.mark.extended
def test_timeout_and_restarts_reach_the_launcher() -> None:
    results = launch(LaunchSpec(tp=2, timeout=7, max_restarts=1, device="cpu"), _fails_first_attempt)
    # the launcher restarted the whole job once, and its ranks saw the timeout
    assert results == {r: {"attempt": "1", "timeout": 7.0} for r in (0, 1)}
    assert LaunchSpec(tp=2).job("gloo").timeout is None


# -- 4: the catalog of bad inputs --------------------------------------------------------------------------
def _write(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(body)
    return str(path)


GPT = f"import sys\nsys.path.insert(0, {EXAMPLES!r})\nimport torch\nfrom nanogpt import GPT, GPTConfig\n"
CATALOG = {
    "missing file": (lambda d: str(d / "nope.py"), [], "does not exist"),
    "import fails": (lambda d: _write(d, "bad.py", "x = 1\nraise RuntimeError('no weights here')\n"), [],
                     "importing .* failed at line 2: RuntimeError: no weights here"),
    "no factory": (lambda d: _write(d, "nofactory.py", "WIDTH = 8\n\ndef helper():\n    return 1\n"), [],
                   "defines neither build_model.*public names it defines: WIDTH, helper"),
    "factory raises": (lambda d: _write(d, "raises.py", "def build_model():\n    raise ValueError('bad config')\n"),
                       [], r"build_model\(\) in .* raised ValueError: bad config"),
    "example_batch raises": (lambda d: _write(
        d, "badbatch.py", GPT + "def build_model():\n    return GPT(GPTConfig())\n"
        "def example_batch():\n    raise OSError('tokens.bin not found')\n"),
        [], r"example_batch\(\) in .* raised OSError: tokens.bin not found"),
    "heads not divisible": (lambda d: _write(
        d, "heads.py", GPT + "def build_model():\n    return GPT(GPTConfig(n_head=3, n_embd=48))\n"
        "def example_batch():\n    return torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)\n"),
        [], "not divisible|divisible by"),
    "sequence > block_size": (lambda d: _write(
        d, "long.py", GPT + "def build_model():\n    return GPT(GPTConfig())\n"
        "def example_batch():\n    idx = torch.zeros(2, 100, dtype=torch.long)\n    return idx, idx\n"),
        [], "Cannot forward sequence of length 100, block size is only 64"),
    "tp 0": (lambda d: NANOGPT, ["--tp", "0"], "--tp must be an integer >= 1"),
    "more ranks than GPUs": (lambda d: NANOGPT, ["--device", "cuda"], r"need 2 GPUs, this node has \d"),
    "nnodes without master": (lambda d: NANOGPT, ["--nnodes", "2"], "needs --master-addr and --master-port"),
    "node rank out of range": (lambda d: NANOGPT, ["--nnodes", "2", "--node-rank", "2", "--master-addr", "x",
                                                   "--master-port", "1"], "out of range"),
    "timeout 0": (lambda d: NANOGPT, ["--timeout", "0"], "--timeout must be > 0"),
}


@pytest.mark.parametrize("case", list(CATALOG))
def test_bad_input_fails_before_any_rank(case: str, tmp_path: Path, monkeypatch) -> None:
    import re

    if case == "more ranks than GPUs" and torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")

    def no_launch(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr("autotp.distributed.launch.launch", no_launch)  # imported by the command when it runs
    make, extra, pattern = CATALOG[case]
    args = ["shard", make(tmp_path), "--tp", "2", "--out", str(tmp_path / "out"), *extra]
    result = runner.invoke(app, args, env={"COLUMNS": "500"})
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.slow
def test_group_made_for_the_script_is_destroyed_at_exit(tmp_path: Path) -> None:
    # a one-rank job whose script never touches torch.distributed: autotp makes the group, and tears it down
    # at exit (left alive, gloo's threads can abort the rank after its last line)
    script = tmp_path / "script.py"
    script.write_text(
        "import atexit, torch.distributed as dist\n"
        "from autotp.distributed.launch import init_from_env\n"
        "atexit.register(lambda: print('INITIALIZED AT EXIT', dist.is_initialized()))  # runs after autotp's\n"
        "init_from_env()\n"
    )
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(get_free_port()),
           ENV_JOB: RankJob(RankGrid.build(1, 1)).to_json()}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "INITIALIZED AT EXIT False" in proc.stdout
