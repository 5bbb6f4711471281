"""``autotp --help`` and every command's ``--help`` answer without importing torch: the CLI modules keep torch
and the capture stack inside the commands (cli/main.py), and importing torch alone takes a second or more.

Each check runs in a fresh interpreter, since the test process has imported torch long before."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
