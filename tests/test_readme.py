"""Every command the README shows runs as written.

The README's ``bash`` blocks are read from the file itself: the two set-up commands must be what CI runs
(``.ci/run``), and every other block runs, line by line and in order, in a folder of its own that holds the
repository's ``examples/`` and ``benchmarks/`` (a block's later lines may read what its earlier ones wrote:
a checkpoint to resume, a profile to plan with). A command that exits non-zero fails the test, naming the
line and what it printed.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ranks import ROOT

README = Path(ROOT, "README.md")
CI = Path(ROOT, ".ci", "run")


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


COMMANDS = bash_blocks(README.read_text())[2:]  # after the two set-up commands


def test_the_set_up_commands_are_what_ci_runs() -> None:
    """The README's two fresh-machine commands are the ones ``.ci/run`` runs: the main job in its own fresh
    virtualenv without test extras, then the tests (CI adds only ``--durations``)."""
    raw = re.findall(r"^```bash\n(.*?)\n^```", README.read_text(), flags=re.S | re.M)[:2]
    ci = CI.read_text()
    main_job, tests = raw
    assert "autotp shard examples/" in main_job and "'.[test]'" not in main_job and "'.[test]'" in tests
    assert main_job in ci, main_job
    assert tests in ci, tests


def test_blocks_are_found() -> None:
    blocks = bash_blocks(README.read_text())
    assert len(blocks) >= 5 and all(blocks)
    assert any(c.startswith("autotp plan benchmarks/llama70b.py") and "--microbatches 128" in c
               for b in blocks for c in b)  # a continued line is one command


def _run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    words = shlex.split(command)
    if words[0] == "autotp":  # the installed command, as this interpreter's module (same code, no PATH needed)
        words = [sys.executable, "-m", "autotp.cli", *words[1:]]
    return subprocess.run(words, cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "100"})


@pytest.mark.slow
@pytest.mark.parametrize("block", range(len(COMMANDS)), ids=lambda i: f"block{i + 3}")
def test_readme_block_runs_as_written(block: int, tmp_path: Path) -> None:
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(Path(ROOT, name))
    for command in COMMANDS[block]:
        done = _run(command, tmp_path)
        assert done.returncode == 0, f"README: `{command}` exited {done.returncode}:\n" + \
            (done.stdout + done.stderr)[-3000:]
