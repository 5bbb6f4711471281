"""``autotp --help`` and every command's ``--help`` answer without importing torch: the CLI modules keep torch
and the capture stack inside the commands (cli/main.py), and importing torch alone takes a second or more.

Each check runs in a fresh interpreter, since the test process has imported torch long before."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMANDS = ("layout", "plan", "profile", "run", "shard")

_TORCH = "sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))"
IMPORT = f"""
import sys
import autotp.cli.main
torch = {_TORCH}
assert not torch, f"importing autotp.cli.main imported {{torch[:5]}}"
"""
HELP = f"""
import sys
import typer
from typer.testing import CliRunner
from autotp.cli.main import app

commands = sorted(typer.main.get_command(app).commands)
assert commands == {sorted(COMMANDS)!r}, commands
runner = CliRunner()
for argv in ([], *([c] for c in commands)):
    result = runner.invoke(app, [*argv, "--help"], env={{"COLUMNS": "200"}})
    assert result.exit_code == 0 and "--help" in result.output, (argv, result.output)
torch = {_TORCH}
assert not torch, f"--help imported {{torch[:5]}}"
"""


def _python(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_importing_the_cli_imports_no_torch() -> None:
    _python(IMPORT)


@pytest.mark.slow
def test_every_help_imports_no_torch() -> None:
    _python(HELP)


def _stuck_torch(tmp_path) -> dict[str, str]:
    """An environment whose ``torch`` never finishes importing: whatever a command says or refuses there, it
    says before it imports torch."""
    stuck = tmp_path / "stuck" / "torch"
    stuck.mkdir(parents=True)
    (stuck / "__init__.py").write_text("import time\ntime.sleep(3600)\n")
    return {**os.environ, "COLUMNS": "300",
            "PYTHONPATH": os.pathsep.join([str(stuck.parent), ROOT, os.environ.get("PYTHONPATH", "")])}


def _autotp(argv: list[str], env: dict[str, str], first_line_only: bool) -> tuple[int | None, str]:
    """(exit code, output) of ``autotp ARGV``, or (None, its first line) once it has said one; its whole
    process group (a fork server importing the stuck torch) is killed after. The 120 s are a hang guard."""
    import select
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "autotp.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env, cwd=ROOT)
    try:
        if first_line_only:
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            return None, proc.stdout.readline() if ready else ""
        out, _ = proc.communicate(timeout=120)
        return proc.returncode, out
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group ended with the command
            pass
        proc.wait()


@pytest.mark.slow
def test_run_and_profile_speak_and_refuse_before_importing_torch(tmp_path) -> None:
    """``autotp run`` and ``autotp profile`` say their first phase before torch is imported (before: 9-32 s of
    nothing), and a missing path or an occupied --out is refused without torch (before: after 6-13 s)."""
    env = _stuck_torch(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("print('hello')\n")
    for argv in (["run", str(script), "--tp", "2"], ["profile", "--nproc", "2"]):
        _, first = _autotp(argv, env, first_line_only=True)
        assert first.startswith("[") and "] check: " in first, (argv, first)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "metrics.jsonl").write_text('{"step": 1}\n')
    nanogpt = os.path.join(ROOT, "examples", "nanogpt.py")
    for argv, said in ((["run", "/no/such.py", "--tp", "2"], "script /no/such.py does not exist"),
                       (["profile", "--model", "/no/such.py"], "model file /no/such.py does not exist"),
                       (["shard", "/no/such.py", "--tp", "2"], "model file /no/such.py does not exist"),
                       (["shard", nanogpt, "--tp", "2", "--weights", "/no/such"], "--weights /no/such does not exist"),
                       (["shard", nanogpt, "--tp", "2", "--out", str(taken)], "already holds a run's files")):
        code, out = _autotp(argv, env, first_line_only=False)
        assert code == 2 and said in out, (argv, out)
        assert out.strip().splitlines()[-1].startswith("error: "), out
