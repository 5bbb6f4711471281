"""What ``autotp shard`` is doing, said as it starts each phase, with the time since the command started.

A phase (check, launch, build, parallelize, parity, train, save) is one line: ``[  3.2 s] parity: …``. The
launching process says its own phases and hands the command's start time to the ranks (in the job), so rank
0's lines count from the same moment. A line is printed whole and flushed at once, the same in a terminal and
in a pipe, so a log reads as the terminal did.

Nothing here imports torch: the first line is printed before torch is imported (a second or more).
"""
from __future__ import annotations

import time

from rich.console import Console
from rich.markup import escape


class Phases:
    """Phase lines of one command, timed from ``started`` (``time.time()`` at the command's start)."""

    def __init__(self, started: float | None = None, console: Console | None = None, quiet: bool = False):
        self.started = time.time() if started is None else started
        self.console = console or Console(highlight=False)
        self.quiet = quiet

    def elapsed(self) -> float:
        return time.time() - self.started

    def say(self, phase: str, what: str) -> None:
        """``[  t s] phase: what``, at once (flushed: a pipe sees it now, not when the process ends)."""
        if self.quiet:
            return
        self.console.print(f"[dim]\\[{self.elapsed():6.1f} s][/dim] [bold]{escape(phase)}:[/bold] {escape(what)}",
                           soft_wrap=True, highlight=False)
        self.console.file.flush()


class RankPhases:
    """Phase lines a rank says, timed from the command's start: sent to the ranks with the job (it pickles
    as its start time alone; the console is made in the rank)."""

    def __init__(self, started: float):
        self.started = started

    def __call__(self, phase: str, what: str) -> None:
        Phases(self.started).say(phase, what)
