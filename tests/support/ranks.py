"""Helpers for multi-process tests: launch a function on N gloo ranks, count collectives."""
from __future__ import annotations

import contextlib
import functools
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.elastic.utils.distributed import get_free_port
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# what every rank imports before running its function (torch, transformers, every module of autotp, ...):
# loaded once, in the fork server, not once per rank (tests/support/rank_preload.py)
# (and the modules of the functions the command's ranks run: `autotp shard` called in-process forks its ranks
# from this server too, as the console script forks them from its own; autotp.cli.entry.RANK_MODULES)
_PRELOAD = ["rank_preload", "autotp.cli.shard_worker", "autotp.search.profile"]
# where the ranks' functions and models live
PATHS = [os.path.join(ROOT, "examples"), os.path.join(ROOT, "tests", "support"), os.path.join(ROOT, "tests", "scripts")]


@record
def _entry(fn: Callable, *args):
    sys.path[:0] = PATHS
    dist.init_process_group("gloo")
    # as torchrun does for several ranks per node: N ranks each running as many threads as there are cores
    # oversubscribe them (on 2 cores a tp-4 test runs ~2.5x slower)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // dist.get_world_size()))
    try:
        return _timed("", fn, *args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable, world_size: int, *args) -> dict[int, object]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks with torch's elastic launcher; rank -> return value.

    Ranks are forked from a fork server (one per test session) that has imported torch, autotp and
    transformers and run nothing else: each rank starts as a fresh process, as a spawned one would, without
    paying those imports again (seconds per rank on a small machine). The fork server runs no computation, so
    no thread pool is forked; it keeps the environment of the first launch (tests set none for their ranks).
    """
    start_fork_server()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=uuid.uuid4().hex,
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{get_free_port()}", max_restarts=0,
        monitor_interval=0.1, start_method="forkserver",
    )
    return elastic_launch(config, _entry)(fn, *args)


def start_fork_server() -> None:
    """Start the fork server (once per test session) with the preload. It imports the preload before it
    applies this process's ``sys.path`` (Python 3.11 passes it and ignores it), so the helpers' folders
    reach it through ``PYTHONPATH``, for its start only: a missing module would be skipped silently."""
    multiprocessing.set_forkserver_preload(_PRELOAD)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(PATHS + ([saved] if saved else []))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved


_REDUCE_OPS = {0: "sum", 3: "min", 4: "max"}  # c10d's RedOpType


@dataclass
class CollectiveLog(TorchDispatchMode):
    """Records every all-reduce, reduce-scatter and all-gather (functional or c10d) as (op name, reduce op,
    number of elements). A reduce-scatter counts its input, an all-gather its output: the full tensor. The
    input check's all-gather of integer fingerprints (first call of a signature) is not part of a step."""

    calls: list[tuple[str, str, int]] = field(default_factory=list)

    def __post_init__(self):
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in ("all_reduce", "all_to_all_single"):
            self.calls.append((name, args[1] if isinstance(args[1], str) else "", args[0].numel()))
        elif func.namespace == "_c10d_functional" and name == "reduce_scatter_tensor":
            self.calls.append(("reduce_scatter", args[1], args[0].numel()))
        elif func.namespace == "_c10d_functional" and name == "all_gather_into_tensor":
            self.calls.append(("all_gather", "", args[0].numel() * args[1]))
        elif func.namespace == "c10d" and name == "allreduce_":  # eager all-reduces are plain c10d ones
            self.calls.append(("all_reduce", _REDUCE_OPS.get(args[2].op(), "?"), args[0][0].numel()))
        elif func.namespace == "c10d" and name == "_reduce_scatter_base_":  # (output, input, group, op, ..)
            self.calls.append(("reduce_scatter", _REDUCE_OPS.get(args[3].op(), "?"), args[1].numel()))
        elif func.namespace == "c10d" and name == "_allgather_base_" and args[0].is_floating_point():
            self.calls.append(("all_gather", "", args[0].numel()))  # (output, input, group, ..)
        return func(*args, **(kwargs or {}))


def run_jobs(jobs: dict[str, tuple], reuse_captures: bool = False) -> dict[str, object]:
    """Inside each rank: every job ``name -> (function, *args)`` in turn; name -> what the function returned.
    The ranks run the same jobs in the same order, so their collectives (and random streams) stay in step.
    Each job is timed where the suite is profiled (:func:`_timed`). ``reuse_captures``: a model exported by
    one job is not exported again by the next that builds an equal one (:mod:`capture_reuse`)."""
    from capture_reuse import captures_reused

    with captures_reused() if reuse_captures else contextlib.nullcontext():
        return {name: _timed(name, fn, *args) for name, (fn, *args) in jobs.items()}


def reusing(fn: Callable) -> Callable:
    """``fn`` for :func:`launch`, run with the captures of equal models made once in each rank
    (:mod:`capture_reuse`): for a job that parallelizes one model several times."""
    return functools.partial(_reusing, fn)


def _reusing(fn: Callable, *args) -> object:
    from capture_reuse import captures_reused

    with captures_reused():
        return fn(*args)


def _timed(job: str, fn: Callable, *args) -> object:
    """``fn(*args)``; with ``AUTOTP_SUITE_PROFILE_JOBS`` set (``benchmarks/suite_profile.py``), one line appended
    to that file: process, rank, function, job, start and end (epoch seconds), this process's CPU seconds."""
    log = os.environ.get("AUTOTP_SUITE_PROFILE_JOBS")
    start, cpu = time.time(), time.process_time()
    try:
        return fn(*args)
    finally:
        if log:
            with open(log, "a") as f:
                if getattr(fn, "func", None) is _reusing:
                    fn = fn.args[0]
                name = getattr(getattr(fn, "func", fn), "__qualname__", repr(fn))  # a partial by its function's name
                f.write(f"{os.getpid()}\t{os.environ.get('RANK', '?')}\t{name}\t{job}\t"
                        f"{start:.3f}\t{time.time():.3f}\t{time.process_time() - cpu:.3f}\n")


class Launches:
    """The jobs of a test module, one launch per world size (made when a test first asks for that world):
    a launch costs process start, rendezvous and group set-up on every rank, a job only its own work.
    ``launches(world, name)``: rank -> what job ``name`` returned. Each job builds its own model and state.
    ``extended``: jobs only ``extended`` tests ask for (tests/conftest.py), launched apart, when one of them
    first asks, so the default run never pays for them. A launch that failed fails every test of its batch
    with the same error, without launching again. ``reuse_captures``: the jobs of a launch that build equal
    models export them once (:mod:`capture_reuse`); not for the tests of capture itself."""

    def __init__(self, jobs: dict[int, dict[str, tuple]], extended: dict[int, dict[str, tuple]] | None = None,
                 reuse_captures: bool = False):
        self.batches = {**{(world, False): batch for world, batch in jobs.items()},
                        **{(world, True): batch for world, batch in (extended or {}).items()}}
        self.done, self.failed = {}, {}
        self.reuse_captures = reuse_captures

    def __call__(self, world: int, name: str) -> dict[int, object]:
        key = (world, name in self.batches.get((world, True), {}))
        if key in self.failed:
            raise RuntimeError(f"the launch of this module's {world}-rank jobs failed") from self.failed[key]
        if key not in self.done:
            try:
                self.done[key] = launch(run_jobs, world, self.batches[key], self.reuse_captures)
            except Exception as exc:
                self.failed[key] = exc
                raise
        return {rank: by_job[name] for rank, by_job in self.done[key].items()}
