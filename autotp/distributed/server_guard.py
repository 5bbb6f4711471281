"""Imported first by the warm ranks' fork server (:mod:`autotp.distributed.warm`), and only there: the server
ends when the command that started it ends, however it ends.

The ranks forked from the server are its children (torch's worker wrapper has each one get SIGINT when its
parent dies, as a spawned rank does when its launcher dies), and each holds the server's "alive" pipe open,
so the server would otherwise outlive a launcher killed with SIGKILL, and its ranks would run on, orphaned.
Linux's parent-death signal ties the server to the launcher: importing this module sets it for the
importing process. Elsewhere (no ``prctl``) nothing is set.
"""
from __future__ import annotations

import ctypes
import os
import signal

from autotp.distributed.warm import SERVER_IGNORES

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_parent() -> None:
    """SIGKILL this process when the thread that started it exits; at once if that happened already."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:  # the launcher ended before the signal was set
        os.kill(os.getpid(), signal.SIGKILL)


end_with_parent()
for _sig in SERVER_IGNORES:  # the server outlives a signal to the process group: its ranks are waited for
    signal.signal(_sig, signal.SIG_IGN)
