"""The README's shell commands, for the tests that run them as written.

``tests/e2e/test_readme.py`` runs every command of the README's ``bash`` blocks; a test that checks more than
the exit status of one of them (its numbers, its files) runs it itself, through :func:`run_readme`, and
claims it there, so the command runs once and the README cannot drift from what that test checks.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
import traceback
from pathlib import Path

from ranks import ROOT

README = Path(ROOT, "README.md")


def bash_blocks(text: str) -> list[list[str]]:
    """The README's ``bash`` blocks, each a list of commands: continued lines joined, comments dropped."""
    blocks = []
    for body in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        commands, pending = [], ""
        for line in body.splitlines():
            line = pending + line
            if line.rstrip().endswith("\\"):
                pending = line.rstrip()[:-1] + " "
                continue
            pending = ""
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
        blocks.append(commands)
    return blocks


def readme_folder(path: Path) -> Path:
    """``path`` made a folder the README's commands run in: the repository's ``examples/`` and
    ``benchmarks/`` beside whatever they write."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("examples", "benchmarks"):
        if not (path / name).exists():
            (path / name).symlink_to(Path(ROOT, name))
    return path


def run_readme(command: str, cwd: Path, *extra: str, timeout: int = 600,
               columns: int = 100) -> subprocess.CompletedProcess:
    """Run the README's ``command`` (it must be there, word for word) in ``cwd`` (see :func:`readme_folder`),
    with ``extra`` words appended (a script's own ``--json``).

    ``autotp`` commands other than ``run`` are the console script's own app, invoked in this process (typer's
    runner, in ``cwd``): the same code without another start of torch, and their ranks fork from the tests'
    warm fork server (``.ci/run`` runs the console script itself). ``autotp run`` and ``python`` run as
    this interpreter in a process of their own: they start the user's script, which imports what it likes."""
    every = {c for block in bash_blocks(README.read_text()) for c in block}
    assert command in every, f"the README no longer has `{command}`"
    words = shlex.split(command) + list(extra)
    env = {**os.environ, "COLUMNS": str(columns)}
    if words[0] == "autotp" and words[1] != "run":
        return _invoke(words, cwd, env)
    if words[0] == "autotp":
        words = [sys.executable, "-m", "autotp.cli", *words[1:]]
    elif words[0] == "python":
        words = [sys.executable, *words[1:]]
    return subprocess.run(words, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def _invoke(words: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    from typer.testing import CliRunner

    from autotp.cli.main import app

    with contextlib.chdir(cwd):
        result = CliRunner().invoke(app, words[1:], env=env)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(words, result.exit_code, result.stdout, stderr)
