"""Every command the README shows runs as written.

The README's ``bash`` blocks are read from the file itself: the two set-up commands must be what CI runs
(``.ci/run``), and every other block runs, line by line and in order, in a folder of its own that holds the
repository's ``examples/`` and ``benchmarks/`` (a block's later lines may read what its earlier ones wrote:
a checkpoint to resume, a profile to plan with). A command that exits non-zero fails the test, naming the
line and what it printed. A command whose numbers or files another test checks (:data:`CLAIMED`) runs
there instead, word for word (``tests/support/readme.py``), and only once.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from ranks import ROOT
from readme import README, bash_blocks, readme_folder, run_readme

CI = Path(ROOT, ".ci", "run")
# commands a test checks beyond their exit status (numbers, files) run there, once: command -> that test file
CLAIMED = {
    "autotp run examples/hf_trainer.py --tp 2 --dp 2": "tests/e2e/test_integrations.py",
    "python examples/hf_trainer.py --unsharded --batch 8": "tests/e2e/test_integrations.py",
    "autotp shard examples/nanogpt.py --tp 2 --dp 2 --fsdp --out fsdp": "tests/runtime/test_fsdp.py",
    "autotp shard examples/llama.py --tp 2 --pp 2 --virtual-stages 2 --schedule Interleaved1F1B --microbatches 4 "
    "--out llama": "tests/runtime/test_pipeline.py",
    "autotp shard examples/nanogpt.py --tp 2 --steps 3 --out autotp-out": "tests/e2e/test_reliability.py",
    "autotp shard examples/nanogpt.py --tp 4 --steps 6 --out autotp-out --resume": "tests/e2e/test_reliability.py",
    "autotp shard examples/nanogpt.py --tp 1 --cp 2 --steps 2 --out cp": "tests/cli/test_context_cli.py",
    "autotp shard examples/nanogpt.py --tp 2 --cp 2 --steps 4 --out cp --resume": "tests/cli/test_context_cli.py",
    "autotp shard examples/nanogpt.py --auto --world-size 4": "tests/plan/test_auto_layout.py",
}


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


def test_claimed_commands_are_run_by_their_tests() -> None:
    """A command left to another test is in the README word for word, and that test runs it (by its text)."""
    every = {c for block in COMMANDS for c in block}
    for command, test in CLAIMED.items():
        assert command in every, command
        assert f'"{command}"' in Path(ROOT, test).read_text(), (command, test)


@pytest.mark.slow
@pytest.mark.parametrize("block", [i for i, b in enumerate(COMMANDS) if set(b) - set(CLAIMED)],
                         ids=lambda i: f"block{i + 3}")
def test_readme_block_runs_as_written(block: int, tmp_path: Path) -> None:
    readme_folder(tmp_path)
    for command in COMMANDS[block]:
        if command in CLAIMED:  # run, and checked further, by the test named there
            continue
        done = run_readme(command, tmp_path)
        assert done.returncode == 0, f"README: `{command}` exited {done.returncode}:\n" + \
            (done.stdout + done.stderr)[-3000:]
