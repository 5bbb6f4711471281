"""Say which rank failed, how, and where, when torch's elastic launcher restarts the job (``--max-restarts``).

The elastic agent knows how a worker ended (its exit code or signal, its pid) but tells the restarted workers
only their restart count; the workers know where they were (the step) but not which peer died. So:

- every worker notes its progress in a small file of a folder the launcher made for the job
  (:func:`note_progress`, a no-op outside ``autotp``'s launcher);
- while the job runs, the launcher watches the agent's view of its workers (:func:`watching`): when the group
  fails it writes a :class:`Failure` (rank, pid, signal or exit code, the rank's last noted progress) that the
  next attempt's workers read with :func:`last_failure`, and calls ``on_failure`` so the launching command can
  say it at once: ``rank 1 (pid 4242) was killed by SIGKILL at step 203; restart 1 of 1``.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ENV_PROGRESS = "AUTOTP_PROGRESS_DIR"  # the folder of the job's progress notes and failure records


@dataclass(frozen=True)
class Failure:
    """One failed attempt of the job, as the restart after it sees it."""

    restart: int  # 1 for the first restart
    max_restarts: int
    rank: int
    pid: int
    how: str  # "was killed by SIGKILL", "exited with code 17", "failed: RuntimeError: ..."
    step: int | None = None  # the step the rank was running or saving (1-based), when it noted one
    where: str = ""  # "at step 203", "while saving step 4"

    def line(self) -> str:
        where = f" {self.where}" if self.where else ""
        return f"rank {self.rank} (pid {self.pid}) {self.how}{where}; restart {self.restart} of {self.max_restarts}"

    def resumed(self, start: int) -> str:
        """The line, and where the restart resumed: ``... restart 1 of 1 from step 200 (3 steps redone)``."""
        n = None if self.step is None else max(0, self.step - start)
        redone = "" if n is None else f" ({n} step{'' if n == 1 else 's'} redone)"
        return f"{self.line()} from step {start}{redone}"


def note_progress(step: int | None, where: str) -> None:
    """Worker: record what this rank is doing now (``step``, 1-based, and a phrase: "at step 5"); read by the
    launcher if the rank dies. A no-op unless the job was started by :func:`autotp.distributed.launch.launch`."""
    folder = os.environ.get(ENV_PROGRESS)
    rank = os.environ.get("RANK")
    if not folder or rank is None:
        return
    path = Path(folder) / f"rank-{rank}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"step": step, "where": where}))
        os.replace(tmp, path)  # the launcher never reads half a note
    except OSError:
        pass  # a note is a courtesy; training goes on without it


def last_failure(environ: Mapping[str, str] | None = None) -> Failure | None:
    """Worker: the failure that caused this restart; None on the first attempt or outside autotp's launcher."""
    environ = os.environ if environ is None else environ
    folder, restart = environ.get(ENV_PROGRESS), environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if not folder or restart in ("", "0"):
        return None
    try:
        return Failure(**json.loads((Path(folder) / f"failure-{int(restart)}.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _progress(folder: Path, rank: int) -> tuple[int | None, str]:
    try:
        note = json.loads((folder / f"rank-{rank}.json").read_text())
        return note.get("step"), str(note.get("where", ""))
    except (OSError, ValueError, AttributeError):
        return None, ""


def _how(failure: Any, message: str) -> str:
    """How a worker ended, from torch's ProcessFailure: its signal, its own error, or its exit code."""
    if failure.exitcode < 0:
        return f"was killed by {failure.signal_name()}"
    if message:
        return f"failed: {message.strip().splitlines()[-1]}"
    return f"exited with code {failure.exitcode}"


def describe(folder: Path, rank: int, failure: Any, message: str, restart: int, max_restarts: int) -> Failure:
    step, where = _progress(folder, rank)
    return Failure(restart=restart, max_restarts=max_restarts, rank=rank, pid=int(failure.pid),
                   how=_how(failure, message), step=step, where=where)


@contextlib.contextmanager
def watching(max_restarts: int, pick: Callable[[Mapping[int, Any]], tuple[int, Any, str]],
             on_failure: Callable[[Failure], None] | None = None) -> Iterator[dict[str, str]]:
    """Launcher: for the duration of one job, a progress folder (yielded as the workers' environment) and a
    watch on the elastic agent's results. ``pick(failures)`` -> (rank, failure, message) names the failure
    that caused the others. Each failure the agent will restart from is written for the next attempt and
    passed to ``on_failure``."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    folder = Path(tempfile.mkdtemp(prefix="autotp-progress-"))
    original = getattr(LocalElasticAgent, "_monitor_workers", None)
    seen = [0]

    def monitor(self, worker_group):  # the agent's own poll, then a look at what it found
        result = original(self, worker_group)
        if result.state == WorkerState.FAILED and result.failures:
            _add_unreported(self, worker_group, result.failures)
            seen[0] += 1
            rank, failure, message = pick(result.failures)
            record = describe(folder, rank, failure, message, seen[0], max_restarts)
            if seen[0] <= max_restarts:  # the agent restarts the group: its workers read this
                (folder / f"failure-{seen[0]}.json").write_text(json.dumps(asdict(record)))
                if on_failure is not None:
                    on_failure(record)
            (folder / "final.json").write_text(json.dumps(asdict(record)))
        return result

    if original is not None:  # a torch whose agent polls elsewhere: the job runs, unannotated
        LocalElasticAgent._monitor_workers = monitor
    try:
        yield {ENV_PROGRESS: str(folder)}
    finally:
        if original is not None:
            LocalElasticAgent._monitor_workers = original
        shutil.rmtree(folder, ignore_errors=True)


# what the agent stops the other ranks with once one has failed (and what a dead launcher's ranks get)
AGENT_STOPS = (signal.SIGTERM, signal.SIGINT)


def stopped_by_agent(exitcode: int) -> bool:
    """Whether a rank's exit code is the agent's (or a dead launcher's) stop, not a failure of its own."""
    return exitcode < 0 and -exitcode in AGENT_STOPS


def _add_unreported(agent: Any, group: Any, failures: dict[int, Any]) -> None:
    """Add to the agent's ``failures`` every other rank that failed by itself: an exit code, or a signal from
    outside (SIGKILL: the OOM killer, a user), not the SIGTERM with which the agent stopped the rest. The agent
    reports the first failed rank it sees, and a peer that raised on the lost connection may be seen before
    the rank that caused it (a forked rank's end reaches the agent through the fork server); by now it has
    stopped the others, so every exit code, and each rank's own error file, is there to read."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    context = getattr(agent, "_pcontext", None)
    for local, proc in enumerate(getattr(getattr(context, "_pc", None), "processes", ())):
        code, worker = proc.exitcode, group.workers[local]
        if not code or stopped_by_agent(code) or worker.global_rank in failures:
            continue
        failures[worker.global_rank] = ProcessFailure(local_rank=local, pid=proc.pid, exitcode=code,
                                                      error_file=context.error_files[local])


def final_failure(environ: Mapping[str, str]) -> Failure | None:
    """Launcher, inside :func:`watching`: the last failure the agent reported (the one the job ends with)."""
    try:
        return Failure(**json.loads((Path(environ[ENV_PROGRESS]) / "final.json").read_text()))
    except (KeyError, OSError, ValueError, TypeError):
        return None
