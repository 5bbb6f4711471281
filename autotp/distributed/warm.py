"""Warm ranks: rank processes that start with torch and autotp already imported.

A spawned rank imports torch and autotp before it does anything (2-3 s of CPU each; on a machine with fewer
cores than ranks they queue). The ``autotp`` command knows from its arguments, before it imports anything
heavy, that it will launch ranks running one of its own functions (``shard``, ``profile``), so it starts
Python's fork server first (:func:`warm_ranks`): the server imports the ranks' module while the command imports
the CLI and checks the model on meta, and each rank is then forked from it, already imported. The server has
run nothing, so no thread pool or process group is forked.

A rank forked from the server inherits the server's environment: the command's environment when it started.
The launcher sets some variables afterwards (tp, dp, the progress folder, threads per rank), and the command
(or a test calling it in-process) may have changed others, so the launching process's whole environment is
handed to the rank and made its own first (:func:`as_launched`), beside what the elastic agent set for the
worker: its environment is the one a spawned rank would have had. Only the module this file imports at load time is the standard library's, so the console
script can call it before torch is imported.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def warm_ranks(modules: Sequence[str]) -> bool:
    """Start the fork server with ``modules`` preloaded, unless a server already runs in this process (its
    preload is whoever started it); returns whether one now runs with them. Returns at once: the server
    imports in the background."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False  # not POSIX: ranks are spawned
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is None:
        # first the guard that ends the server (and so its ranks) with this process, then the ranks' modules
        server.set_forkserver_preload(["autotp.distributed.server_guard", *modules])
        server.ensure_running()
    return warmed(modules[0])


def warmed(module: str) -> bool:
    """Whether a fork server of this process preloads ``module``: then a rank running one of its functions is
    forked from the server, else spawned."""
    server = multiprocessing.forkserver._forkserver
    return server._forkserver_pid is not None and module in server._preload_modules


# The server ignores these (as Python's fork server ignores SIGINT) and each rank forked from it takes them
# back: a signal sent to the command's process group (a scheduler's SIGTERM, a closed terminal's SIGHUP) would
# otherwise end the server, and torch's agent, which waits for its ranks through the server, would stop waiting
# while they still save the step they finished.
SERVER_IGNORES = (signal.SIGTERM, signal.SIGHUP)

# what torch's elastic agent sets in each worker's environment (its rank, the world, the store, the error file)
_AGENT = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
          "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def _by_agent(key: str) -> bool:
    return key in _AGENT or key.startswith("TORCHELASTIC_")


def as_launched(environ: Mapping[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """Inside a rank forked from the server: the launching process's environment (``environ``) with what the
    agent set for this worker, then ``fn(*args)``. The server imported torch before the launcher chose the
    threads per rank (``OMP_NUM_THREADS``, which torch reads when it loads), so they are set here as a spawned
    rank's import would have set them."""
    for sig in SERVER_IGNORES:
        signal.signal(sig, signal.SIG_DFL)
    agent = {k: v for k, v in os.environ.items() if _by_agent(k)}
    os.environ.clear()
    os.environ.update({k: v for k, v in environ.items() if not _by_agent(k)})
    os.environ.update(agent)
    if "OMP_NUM_THREADS" in environ:
        import torch

        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    return fn(*args)
