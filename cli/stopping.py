"""Stopping a training run cleanly, and keeping its work: the ranks' side of an interrupt and of saving by time.

A signal (Ctrl-C's SIGINT, a scheduler's SIGTERM, a closed terminal's SIGHUP) reaches the ranks straight from
the terminal's process group, or through the launcher (torch's agent sends it on). A rank never acts on it
alone, since its peers would wait for it in their next collective: it notes the signal, and at the end of
every step all ranks agree (one all-reduce of two numbers) on whether any of them was stopped, and whether
the save interval has passed on any rank's clock. Stopped, they save the step they finished (atomic, as
every save) and exit with 128 + the signal's number, as a shell does. Before training starts nothing would
be kept, so a signal then ends the rank at once.

The handlers are installed explicitly: a launcher started in the background (``cmd &`` in a script, a job
scheduler) has SIGINT ignored, and its ranks inherit that, so without them Ctrl-C sent to the process group
would be ignored until torch's agent gives up waiting and kills them.
"""
from __future__ import annotations

import os
import signal
import time
from types import FrameType

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
DEFAULT_SAVE_MINUTES = 30.0  # `autotp shard --save-minutes`: a long run keeps work by default


class Stops:
    """This rank's signal handlers and the save interval's clock; :meth:`check` is collective."""

    def __init__(self, save_minutes: float = 0.0) -> None:
        self.signum = 0  # the first stop signal received (0: none)
        self.training = False  # before the loop, a signal ends the rank at once: nothing would be kept
        self.every_s = save_minutes * 60.0
        self.last = time.monotonic()
        self.parent = os.getppid()

    def install(self) -> Stops:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._received)
        return self

    def _received(self, signum: int, frame: FrameType | None) -> None:
        if not self.training or os.getppid() != self.parent:
            # before training nothing would be kept; with the launcher gone (its death signal: SIGINT through
            # torch's worker wrapper) nobody would say what was, so nothing is written after it
            raise SystemExit(128 + signum)
        self.signum = self.signum or signum  # the launcher sends on the signal the group already got: once

    def check(self, device: torch.device) -> tuple[int, bool]:
        """Collective, at a step boundary: (the stop signal any rank received, 0 for none; whether a save by
        time is due on any rank's clock)."""
        due = self.every_s > 0 and time.monotonic() - self.last >= self.every_s
        flags = torch.tensor([self.signum, int(due)], dtype=torch.int64, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return int(flags[0]), bool(flags[1])

    def saved(self) -> None:
        """A checkpoint was written: the interval counts from now."""
        self.last = time.monotonic()
