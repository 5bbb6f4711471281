"""What a restart says (autotp.distributed.restarts): the failed rank, its pid, how it ended, where it was,
which restart, and what is redone. Pure: no ranks (tests/e2e/test_faults.py restarts a real job)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from autotp.distributed.restarts import ENV_PROGRESS, Failure, describe, last_failure, note_progress
from autotp.errors import RankFailedError


@dataclass
class _Ended:  # the fields of torch's ProcessFailure that are read
    pid: int
    exitcode: int

    def signal_name(self) -> str:
        return {-9: "SIGKILL", -15: "SIGTERM"}[self.exitcode]


def test_the_line_names_rank_pid_signal_step_and_restart(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_PROGRESS, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    note_progress(202, "at step 202")
    note_progress(203, "at step 203")  # the newest note is the one read
    failure = describe(tmp_path, 1, _Ended(4242, -9), "", restart=1, max_restarts=1)
    assert failure.line() == "rank 1 (pid 4242) was killed by SIGKILL at step 203; restart 1 of 1"
    assert failure.resumed(200) == \
        "rank 1 (pid 4242) was killed by SIGKILL at step 203; restart 1 of 1 from step 200 (3 steps redone)"
    assert failure.resumed(202).endswith("(1 step redone)")


@pytest.mark.parametrize("ended, message, how", [
    (_Ended(7, 17), "", "exited with code 17"),
    (_Ended(7, 1), "Traceback ...\nRuntimeError: boom", "failed: RuntimeError: boom"),
    (_Ended(7, -15), "", "was killed by SIGTERM"),
])
def test_how_a_rank_ended(tmp_path: Path, ended, message: str, how: str) -> None:
    failure = describe(tmp_path, 0, ended, message, restart=2, max_restarts=3)  # no note: no where
    assert failure.line() == f"rank 0 (pid 7) {how}; restart 2 of 3"
    assert failure.resumed(5) == f"rank 0 (pid 7) {how}; restart 2 of 3 from step 5"


def test_a_restarted_worker_reads_the_failure_before_it(tmp_path: Path) -> None:
    record = Failure(restart=1, max_restarts=2, rank=3, pid=99, how="was killed by SIGKILL", step=4,
                     where="while saving step 4")
    (tmp_path / "failure-1.json").write_text(json.dumps(record.__dict__))
    assert last_failure({ENV_PROGRESS: str(tmp_path), "TORCHELASTIC_RESTART_COUNT": "1"}) == record
    assert last_failure({ENV_PROGRESS: str(tmp_path), "TORCHELASTIC_RESTART_COUNT": "0"}) is None
    assert last_failure({ENV_PROGRESS: str(tmp_path), "TORCHELASTIC_RESTART_COUNT": "2"}) is None  # none written
    assert last_failure({}) is None


def test_notes_outside_the_launcher_are_a_no_op(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(ENV_PROGRESS, raising=False)
    note_progress(1, "at step 1")  # nowhere to write: nothing happens
    monkeypatch.setenv(ENV_PROGRESS, str(tmp_path / "gone"))
    monkeypatch.setenv("RANK", "0")
    note_progress(1, "at step 1")  # a folder that vanished: training goes on
    assert not (tmp_path / "gone").exists()


@pytest.mark.parametrize("message, said", [
    ("(pid 12) was killed by SIGKILL at step 3", "rank 1 (pid 12) was killed by SIGKILL at step 3"),
    ("CheckpointError: checkpoint X is damaged", "rank 1: checkpoint X is damaged"),
    ("RuntimeError: boom", "rank 1: RuntimeError: boom"),
])
def test_a_failed_rank_is_one_line(message: str, said: str) -> None:
    assert RankFailedError(1, 1, message).said() == said
