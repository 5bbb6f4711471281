"""Start tp × dp ranks with torch's elastic launcher, and find a rank's groups inside a worker.

Launcher side: :class:`LaunchSpec` (validated sizes and rendezvous) and :func:`launch`, which runs a
function or an executable on ``tp × dp`` processes per node with c10d rendezvous. The sizes reach the ranks
as one value, :meth:`LaunchSpec.job` (:class:`~autotp.distributed.job.RankJob`): a function's caller may pass it
as an argument (``autotp shard`` does), and every worker finds it in ``AUTOTP_JOB`` (``autotp run``'s script,
which is a process of its own). With a
:class:`RankOutput` the ranks' stdout and stderr reach the launcher's through torch's ``tee`` (as torchrun's
``--tee``, ``--local-ranks-filter`` and ``--log-dir``), each line prefixed with its rank.

Worker side (:mod:`autotp.distributed.rank_context`, its names importable from here too): :func:`init_job` and
:func:`init_from_env` initialise the default process group if needed and return a :class:`RankContext` (grid,
the one DeviceMesh, ``tp_group()``, ``dp_group()``); :func:`current_tp_group` returns its TP group, so
``autotp.parallelize(model)`` can default to it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

import torch
from torch.distributed.elastic.utils.distributed import get_free_port

from autotp.combinations import refused
from autotp.errors import LaunchError, LaunchInterrupted, RankFailedError
from autotp.distributed.cpu_binding import ENV_BIND
from autotp.distributed.job import ENV_JOB, RankJob, choose_backend
from autotp.distributed.rank_grid import RankGrid
from autotp.distributed.rank_context import (RankContext, cp_from_env, current_context, current_cp_group,
                                             current_dp_group, current_job, current_mesh, current_tp_group,
                                             fsdp_from_env, init_distributed, init_from_env, init_job)
from autotp.distributed.restarts import Failure, final_failure, stopped_by_agent, watching
from autotp.distributed.warm import as_launched, warmed

__all__ = [
    "ENV_JOB", "LaunchError", "LaunchSpec", "RankContext", "RankFailedError", "RankJob", "RankOutput",
    "choose_backend", "cp_from_env", "current_context", "current_cp_group", "current_dp_group", "current_job",
    "current_mesh", "current_tp_group", "fsdp_from_env", "init_distributed", "init_from_env", "init_job", "launch",
    "root_failure",
]
# a rank that fails because a peer died reports one of these; the peer's own error is the one to show
_PEER_FAILURE = ("connection closed by peer", "connection reset", "broken pipe", "socket closed",
                 "timed out", "timeout", "distbackenderror", "checkpointexception", "nccl", "watchdog",
                 "signal", "sigterm", "sigkill")
_LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
# torch's log_line_prefix_template: each tee'd line starts with its global rank (torch's own default, "[default0]:",
# is the role and the local rank)
RANK_PREFIX = "[rank${rank}]:"
_PREFIXED = re.compile(r"\[rank\d+\]:")


@dataclass(frozen=True)
class LaunchSpec:
    """The ranks of one job and how they sit on ``nnodes`` nodes. Without ``world``, ``dp`` counts one node's
    replicas: ``tp × cp × dp × pp`` processes on each node, dp × nnodes replicas in all. With ``world`` (``autotp
    shard --world-size``), ``dp`` counts every node's: world = tp × cp × dp × pp ranks, world / nnodes per node.
    Either way global ranks follow Megatron's order (tp fastest, then cp, dp, pp) and node n holds ranks
    n·(world / nnodes) onwards, so a pipeline's stages may sit on different nodes (tp 4 × dp 4 × pp 4 on 8 nodes of
    8: each stage's 16 ranks fill two nodes)."""

    tp: int
    dp: int = 1
    pp: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    timeout: float | None = None  # collective timeout in seconds; None: torch's default
    max_restarts: int = 0
    device: str = "auto"  # "cuda": one GPU per rank (nccl), "cpu": gloo, "auto": cuda when every rank has a GPU
    bind_cores: bool = True  # CPU ranks: each bound to its own share of this node's cores (cpu_binding.py)
    fsdp: bool = False  # shard each TP shard over the data-parallel ranks (FSDP2)
    # with fsdp: replica groups (HSDP: shard within a group of dp / hsdp ranks, each inside a node, replicate
    # across them); None: FSDP over every data-parallel rank, across nodes too (torchtitan's FSDP over nodes)
    hsdp: int | None = None
    cp: int = 1  # context parallelism: ranks that each run a chunk of the same sequences (between tp and dp)
    world: int | None = None  # ranks in all, dp then the whole data-parallel size; None: dp per node × nnodes
    virtual_stages: int | None = None  # with pp: pipeline stages per rank (None: the schedule's default)

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp", "nnodes", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LaunchError(f"{name} must be an integer >= 1, got {value!r}", fields=(name,))
        if self.world is not None:
            self._check_world()
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"node_rank {self.node_rank} is out of range [0, {self.nnodes}) "
                              f"for nnodes {self.nnodes}", fields=("node_rank", "nnodes"))
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise LaunchError(f"master_port {self.master_port} is out of range [1, 65535]", fields=("master_port",))
        if self.timeout is not None and not self.timeout > 0:
            raise LaunchError(f"timeout must be > 0 seconds, got {self.timeout!r}", fields=("timeout",))
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise LaunchError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}",
                              fields=("max_restarts",))
        if self.device not in ("auto", "cpu", "cuda"):
            raise LaunchError(f"device must be auto, cpu or cuda, got {self.device!r}", fields=("device",))
        if self.device == "cuda":
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if have < self.nproc_per_node:
                raise LaunchError(
                    f"device cuda: {self._per_node()} = {self.nproc_per_node} ranks per node need "
                    f"{self.nproc_per_node} GPUs, this node has {have}",
                    hint=f"use at most {have} ranks per node (tp × cp × dp × pp)" if have else
                    "run on the CPU (device cpu: gloo)", fields=("device",))
        if self.nnodes > 1 and (self.master_addr is None or self.master_port is None):
            raise LaunchError(f"nnodes {self.nnodes} needs master_addr and master_port "
                              "(node 0's address and a free port, the same on every node)",
                              fields=("nnodes", "master_addr", "master_port"))
        self.grid  # validates tp × dp × pp against the world size now, not inside the workers
        self._check_fsdp()
        self.job("gloo")  # and what the ranks are told (the backend is chosen at launch)

    def _check_world(self) -> None:
        """``world`` is the product of the sizes, and the nodes take equal shares of it."""
        w = self.world
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise LaunchError(f"world_size must be an integer >= 1, got {w!r}", fields=("world_size",))
        product = self.tp * self.cp * self.dp * self.pp
        if product != w:
            cp = f" × cp {self.cp}" if self.cp > 1 else ""
            raise LaunchError(f"tp {self.tp}{cp} × dp {self.dp} × pp {self.pp} = {product} ranks, not the world_size "
                              f"{w} (with world_size, dp counts every node's replicas)",
                              fields=("tp", "cp", "dp", "pp", "world_size"),
                              hint=f"give dp {w // (product // self.dp)}" if w % (product // self.dp) == 0 else
                              f"tp × cp × pp = {product // self.dp} does not divide {w}: change them or world_size")
        if w % self.nnodes:
            raise LaunchError(f"world_size {w} ranks do not divide into nnodes {self.nnodes} equal nodes",
                              fields=("world_size", "nnodes"))

    def _per_node(self) -> str:
        """How this node's ranks are counted, for messages."""
        if self.world is not None:
            return f"world_size {self.world} / nnodes {self.nnodes}"
        return f"tp {self.tp} × cp {self.cp} × dp {self.dp} × pp {self.pp}"

    def _replicas(self) -> str:
        return f"dp {self.dp}" if self.world is not None else f"dp {self.dp} × nnodes {self.nnodes}"

    @property
    def replica_groups(self) -> int:
        """FSDP's replica groups: hsdp's, or 1 (plain FSDP)."""
        return self.hsdp or 1

    @property
    def data_parallel(self) -> int:
        """The data-parallel size of the whole job (every node's replicas)."""
        return self.dp if self.world is not None else self.dp * self.nnodes

    def _check_fsdp(self) -> None:
        dp = self.data_parallel
        if self.hsdp is not None and (isinstance(self.hsdp, bool) or not isinstance(self.hsdp, int) or self.hsdp < 1):
            raise LaunchError(f"hsdp must be an integer >= 1, got {self.hsdp!r}", fields=("hsdp",))
        # the combinations (hsdp without fsdp, fsdp over one dp × cp rank, replicas that do not divide dp): the
        # rule the library, the command line and the layout search ask
        reason = refused(fsdp=self.fsdp, dp=dp, context_parallel=self.cp, hsdp=self.hsdp)
        if reason is not None:
            where = f" ({self._replicas()})" if self.nnodes > 1 and "dp" in reason.fields else ""
            raise LaunchError(reason.message + where, hint=reason.hint, fields=reason.fields)
        if not self.fsdp or self.hsdp is None:  # plain FSDP: one group of every data-parallel rank, wherever they are
            return
        shard = dp // self.hsdp
        # HSDP asked for: its point is gathers inside a node (topology, not a combination of options)
        if self.nnodes > 1 and self._shards_span_nodes(shard):
            per = f"{self.dp} per node" if self.world is None else f"{self.nproc_per_node} ranks per node"
            raise LaunchError(f"hsdp {self.hsdp}: a shard group of {shard} data-parallel ranks would span nodes "
                              f"({per}), so every all-gather would cross them",
                              fields=("hsdp", "dp", "nnodes"),
                              hint=f"use hsdp {self.nnodes} (or a multiple that divides {dp}): shard within a "
                                   f"node, replicate across nodes")

    def _shards_span_nodes(self, shard: int) -> bool:
        """Whether an HSDP shard group (``shard`` consecutive data-parallel ranks of one tp, cp and pp coordinate)
        holds ranks of two nodes."""
        per = self.nproc_per_node
        return any(g[k] // per != g[k + shard - 1] // per
                   for g in self.grid.dp_groups for k in range(0, len(g), shard))

    @property
    def nproc_per_node(self) -> int:
        if self.world is not None:
            return self.world // self.nnodes
        return self.tp * self.cp * self.dp * self.pp

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def grid(self) -> RankGrid:
        try:
            return RankGrid.build(self.world_size, self.tp, pp=self.pp, dp=self.data_parallel,
                                    gpus_per_node=self.nproc_per_node, cp=self.cp)
        except (TypeError, ValueError) as exc:
            raise LaunchError(str(exc)) from exc

    @property
    def backend(self) -> str:
        """The ranks' process group backend: ``device``'s, or with "auto" nccl when every rank has a GPU."""
        return {"cpu": "gloo", "cuda": "nccl"}.get(self.device) or choose_backend(self.nproc_per_node)

    def job(self, backend: str | None = None) -> RankJob:
        """What every rank is told, as one value: the whole job's sizes (dp counting every node's replicas),
        the backend (default :attr:`backend`), the timeout, FSDP's replica groups and the virtual stages."""
        # the ranks' grid as they have always seen it: coordinates without the launcher's nodes
        grid = RankGrid(self.world_size, self.tp, self.pp, self.data_parallel, cp=self.cp)
        return RankJob(grid, self.backend if backend is None else backend,
                       None if self.timeout is None else float(self.timeout),
                       self.replica_groups if self.fsdp else None, self.virtual_stages)

    def env(self, backend: str | None = None) -> dict[str, str]:
        """The ranks' environment: the job in ``AUTOTP_JOB`` (one variable, the whole value), and how a CPU rank
        shares the cores."""
        backend = self.backend if backend is None else backend
        env = self.job(backend).env()
        if backend == "gloo" and "OMP_NUM_THREADS" not in os.environ:
            # as torchrun does: N CPU ranks each using every core oversubscribe the machine
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.nproc_per_node))
        env[ENV_BIND] = "1" if backend == "gloo" and self.bind_cores else "0"  # "0" overrides an inherited "1"
        return env


@contextlib.contextmanager
def _environ(updates: Mapping[str, str]) -> Iterator[None]:
    # LaunchConfig has no per-worker env; workers copy the launching process's environment at start
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _quiet_launcher_logs(quiet: bool) -> Iterator[None]:
    # the agent logs each worker's traceback at ERROR; the CLI shows the failure once, as one line
    loggers = [logging.getLogger(n) for n in logging.root.manager.loggerDict if n.startswith(_LAUNCHER_LOGGERS)]
    saved = [lg.level for lg in loggers]
    if quiet:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, saved):
            lg.setLevel(level)


@dataclass(frozen=True)
class RankOutput:
    """The ranks' stdout and stderr go to files that the launching process tails onto its own (torch's
    ``tee``), each line prefixed with its global rank (``[rank1]:``) and printed only once it is whole."""

    ranks: frozenset[int] | None = None  # local ranks whose lines are shown (torch's local_ranks_filter); None: all
    log_dir: str | None = None  # where the files stay (torch's layout under it); None: a temporary folder, removed


class _WholeLines:
    """The stream torch's tailing threads write to, one write per line read: ``[rankN]:`` and what that rank's
    file held up to a newline or up to its end. A line the rank had not finished (its buffer flushed mid-line)
    is held until the rest arrives, so ranks' lines never run into each other; anything else passes through."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._held: dict[str, str] = {}  # prefix -> the start of that rank's unfinished line
        self._lock = threading.Lock()  # one tailing thread per rank and stream

    def write(self, text: str) -> int:
        with self._lock:
            prefixed = _PREFIXED.match(text)
            if prefixed is None:
                self._stream.write(text)
                return len(text)
            prefix = prefixed.group()
            line = self._held.pop(prefix, "") + text[len(prefix):]
            while line.startswith(prefix):  # torch's own logs in a rank already start with its rank: once is enough
                line = line[len(prefix):]
            if line.endswith("\n"):
                self._stream.write(prefix + line)
                self._stream.flush()  # shown as the rank prints it, through a pipe too
            else:
                self._held[prefix] = line
        return len(text)

    def finish(self) -> None:
        """What ranks wrote after their last newline, each as a line of its own."""
        with self._lock:
            for prefix, rest in self._held.items():
                self._stream.write(f"{prefix}{rest}\n")
            self._held.clear()
            self._stream.flush()

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the stream's own
        return getattr(self._stream, name)


@contextlib.contextmanager
def _rank_output(output: RankOutput | None, on_logs: Callable[[str], None] | None) -> Iterator[dict[str, Any]]:
    """LaunchConfig's arguments for ``output`` (none without one), with this process's stdout and stderr
    joining the ranks' partial lines while the ranks run; then ``on_logs(folder)`` with the folder that holds
    this run's files, when ``output.log_dir`` keeps them."""
    if output is None:
        yield {}
        return
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    with contextlib.ExitStack() as stack:
        folder = output.log_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="autotp-logs-"))
        shown = None if output.ranks is None else set(output.ranks)
        specs = DefaultLogsSpecs(log_dir=folder, tee=Std.ALL, local_ranks_filter=shown)
        streams = _WholeLines(sys.stdout), _WholeLines(sys.stderr)
        stack.enter_context(contextlib.redirect_stdout(streams[0]))  # torch's tails write to sys.stdout and
        stack.enter_context(contextlib.redirect_stderr(streams[1]))  # sys.stderr as they are when ranks start
        try:
            yield {"logs_specs": specs, "log_line_prefix_template": RANK_PREFIX}
        finally:
            for stream in streams:
                stream.finish()
            if output.log_dir is not None and on_logs is not None:
                # torch makes one folder per run under log_dir (<run id>_<random>); it keeps its name to itself
                on_logs(getattr(specs, "_run_log_dir", None) or output.log_dir)


def launch(spec: LaunchSpec, entrypoint: Callable[..., Any] | str, *args: Any, quiet: bool = True,
           on_restart: Callable[[Failure], None] | None = None, output: RankOutput | None = None,
           on_logs: Callable[[str], None] | None = None) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` on this node's ranks; global rank -> return value (functions only).

    A str entrypoint is an executable (``sys.executable``, then the script and its args in ``args``).
    Raises :class:`RankFailedError` for the rank whose failure caused the others. ``on_restart(failure)`` is
    called when a failed attempt is restarted (``spec.max_restarts``): which rank, its pid, how it ended, where.
    Without ``output`` the ranks write to this process's stdout and stderr directly; with one, through files
    (:class:`RankOutput`), and ``on_logs(folder)`` says where they stay once the ranks have ended.
    """
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # importing the launcher registers its loggers, so they can be quietened before it runs
    backend = spec.backend
    warm = callable(entrypoint) and warmed(entrypoint.__module__)
    port = spec.master_port if spec.master_port is not None else get_free_port()
    addr = spec.master_addr or "127.0.0.1"
    env = spec.env(backend)
    if output is not None and "PYTHONUNBUFFERED" not in os.environ:
        # each rank's stdout is a file then, which Python fills 8 KiB at a time: unbuffered, a line shows when it
        # is printed, as on a terminal (_WholeLines joins the pieces of a line)
        env["PYTHONUNBUFFERED"] = "1"
    with watching(spec.max_restarts, _picked, on_restart) as progress, _rank_output(output, on_logs) as logs, \
            _environ({**env, **progress}), _quiet_launcher_logs(quiet):
        config = LaunchConfig(
            min_nodes=spec.nnodes, max_nodes=spec.nnodes, nproc_per_node=spec.nproc_per_node,
            run_id=f"autotp-{addr}-{port}", rdzv_backend="c10d", rdzv_endpoint=f"{addr}:{port}",
            rdzv_configs={"is_host": spec.node_rank == 0} if spec.nnodes > 1 else {},
            max_restarts=spec.max_restarts, monitor_interval=0.1,
            # a function whose module the fork server preloads (autotp.distributed.warm): forked, already imported
            start_method="forkserver" if warm else "spawn", **logs,
        )
        try:
            with _signals_restored():
                if warm:  # the server's environment is the launcher's when it started: the rank gets today's
                    return elastic_launch(config, as_launched)(dict(os.environ), entrypoint, *args)
                return elastic_launch(config, entrypoint)(*args)
        except SignalException as exc:
            # torch's agent sent the signal on to every rank and waited for them (the ranks stop at a step
            # boundary); a second signal arrives while it waits, and then the ranks left are killed here
            forced = isinstance(exc.__context__, SignalException)
            if forced:
                _kill_ranks()
            raise LaunchInterrupted(int(exc.sigval), forced) from None
        except ChildFailedError as exc:
            rank, failure, message = _picked(exc.failures)
            _, trace = _failure_text(failure)
            ended = final_failure(progress)
            if not message or failure.exitcode < 0:  # no error of its own: how it ended, and where it was
                where = f" {ended.where}" if ended is not None and ended.rank == rank and ended.where else ""
                message = f"(pid {failure.pid}) {_ended(failure)}{where}"
            raise RankFailedError(rank, failure.exitcode, message, trace) from None


_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # the ones torch's agent handles


@contextlib.contextmanager
def _signals_restored() -> Iterator[None]:
    """The launching process's own signal handlers back once the ranks have ended: torch's agent installs
    handlers that raise SignalException and leaves them, so a later Ctrl-C would raise in whatever runs next."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in _STOPS}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is not None:
                signal.signal(s, handler)


def _kill_ranks() -> None:
    """SIGKILL the ranks still alive when torch's agent was interrupted while it waited for them (a second
    Ctrl-C). Spawned and forked ranks are this process's multiprocessing children; an executable's ranks
    (``autotp run``) are direct children that torch starts in sessions of their own, found in /proc (the
    fork server and multiprocessing's resource tracker share this session and are left alone)."""
    import multiprocessing

    pids = {p.pid for p in multiprocessing.active_children() if p.pid is not None}
    me = str(os.getpid())
    for stat in _proc_stats():
        pid, fields = stat.partition(" ")[0], stat.rpartition(")")[2].split()  # state ppid pgrp session ...
        if len(fields) > 3 and fields[1] == me and fields[3] == pid:
            pids.add(int(pid))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _proc_stats() -> Iterator[str]:
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:  # no /proc (macOS): the multiprocessing children are all there is
        return
    for name in names:
        try:
            with open(f"/proc/{name}/stat") as f:
                yield f.read()
        except OSError:  # ended meanwhile
            continue


def _ended(failure: Any) -> str:
    return f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"


def _picked(failures: Mapping[int, Any]) -> tuple[int, Any, str]:
    """The root failure and its own message ('' when the rank recorded none)."""
    rank, failure = root_failure(failures)
    return rank, failure, _failure_text(failure)[0] if _recorded(failure) else ""


def _recorded(failure: Any) -> bool:
    """Whether the worker wrote its own error (torch's error file); without one, torch makes a message up."""
    return isinstance(failure.message, dict) or getattr(failure, "error_file", "<N/A>") not in ("<N/A>", "")


def _failure_text(failure: Any) -> tuple[str, str]:
    message, trace = failure.message, ""
    if isinstance(message, dict):
        trace = message.get("extraInfo", {}).get("py_callstack", "")
        message = message.get("message", "")
    return str(message or ""), trace


def root_failure(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The failure that caused the others, in this order: an error a rank recorded that is not a lost peer
    or a timed-out collective; a rank killed from outside (SIGKILL: the OOM killer, a user); a recorded lost
    peer or timeout; a rank that exited with a code of its own (``sys.exit(3)``); the rest (SIGTERM and
    SIGINT: the agent stopping the others, a dead launcher's ranks); then the earliest.

    When one rank raises or is killed, its peers fail too (their collectives lose the peer, or the agent kills
    them), often within the same second, and which the agent sees first depends on how the ranks were started
    (a forked rank's death reaches it through the fork server): the launcher's own "first failure" (by
    whole-second timestamp) is a coin toss.
    """
    def key(item: tuple[int, Any]) -> tuple:
        rank, failure = item
        message, _ = _failure_text(failure)
        recorded = _recorded(failure)
        own = recorded and bool(message) and not any(s in message.lower() for s in _PEER_FAILURE)
        killed = failure.exitcode < 0 and not stopped_by_agent(failure.exitcode)
        exited = failure.exitcode > 0  # its own exit; the agent's SIGTERM to its peers comes in the same second
        return (not own, not killed, not recorded, not exited, failure.timestamp, rank)

    return min(failures.items(), key=key)
