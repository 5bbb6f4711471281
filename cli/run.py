"""``autotp run SCRIPT --tp N [--dp N] [--pp N] -- ARGS...``: start a training script on tp × dp × pp ranks.

``--dp`` counts one node's replicas (world = tp × cp × dp × pp × nnodes); with ``--world-size W`` it counts every
node's, as ``autotp shard --world-size`` reads it (world = tp × cp × dp × pp, W / nnodes ranks per node in
Megatron's order): the same flags give the same ranks under either command.

The script runs as ``python SCRIPT ARGS...`` under torch's elastic launcher, with the job (its sizes, backend
and timeout: one :class:`~autotp.distributed.job.RankJob`) in ``AUTOTP_JOB``. Inside it::

    from autotp.distributed.launch import init_from_env
    ctx = init_from_env()                      # process group + DeviceMesh
    tpm = autotp.parallelize(model, tp_group=ctx.tp_group())
    # data parallelism: DistributedDataParallel(tpm, process_group=ctx.dp_group())

A plain ``autotp.parallelize(model)`` (no ``tp_group``) takes the rank grid's groups, and with ``--dp D``
averages the gradients over the data-parallel ranks itself (torch's DDP, driven from the model's forward; a DDP
the script wraps over ``ctx.dp_group()`` is found at its first call and averages alone). With ``--fsdp``
(``--hsdp GROUPS``) it shards over the rank grid's mesh with FSDP2 instead; build the optimizer after it. With
``--pp P``, ``pipe = autotp.pipeline(model, example_inputs=batch, microbatches=M)`` cuts it into stages over the
rank grid's pipeline ranks (``pipe.step(x, y)`` trains, ``pipe.parameters()`` for the optimizer).

With more than one rank, the ranks' output reaches this terminal as torchrun's ``--tee`` shows it: through
files the launcher tails, each line prefixed with the global rank that printed it (``[rank1]:``) and shown once
it is whole. ``--ranks 0,1`` shows only those local ranks (torchrun's ``--local-ranks-filter``), ``--log-dir DIR``
keeps the files (torchrun's ``--log-dir``).
"""
from __future__ import annotations

import functools
import inspect
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from autotp.cli.common import USAGE_ERROR, fail
from autotp.cli.common import as_flags as spelled  # this module's as_flags reads a LaunchError's fields
from autotp.distributed.restarts import Failure
from autotp.errors import LaunchError, LaunchInterrupted, RankFailedError

if TYPE_CHECKING:
    from autotp.distributed.launch import LaunchSpec, RankOutput

# Shared by `autotp run` and `autotp shard`; typer reads these at registration time.
TP = typer.Option(..., "--tp", help="Tensor-parallel size: ranks that share one model replica.")
DP = typer.Option(1, "--dp", help="Data-parallel replicas: per node (world = tp × cp × dp × pp × nnodes), or with "
                  "--world-size in all (world = tp × cp × dp × pp, as autotp shard --world-size reads it).")
PP = typer.Option(1, "--pp", help="Pipeline stages' ranks (outermost; Megatron's order tp, dp, pp).")
NNODES = typer.Option(1, "--nnodes", help="Number of nodes; run the same command on each.")
NODE_RANK = typer.Option(0, "--node-rank", help="This node's index in [0, nnodes); node 0 hosts the rendezvous.")
MASTER_ADDR = typer.Option(None, "--master-addr", help="Address of node 0 (required with --nnodes > 1).")
MASTER_PORT = typer.Option(None, "--master-port", help="Rendezvous port on node 0 (default: a free local port).")
DEBUG = typer.Option(False, "--debug", help="Show tracebacks and the launcher's own logs.")
TIMEOUT = typer.Option(None, "--timeout", metavar="SECONDS",
                       help="Collective timeout (init_process_group's timeout): a rank waiting longer for its "
                            "peers fails instead of hanging. Default: torch's.")
MAX_RESTARTS = typer.Option(0, "--max-restarts", help="Restart the whole job this many times after a rank fails "
                            "(the elastic launcher's max_restarts).")
BIND_CORES = typer.Option(True, "--bind-cores/--no-bind-cores",
                          help="CPU ranks: bind each to its own share of this node's cores (dealt round them "
                               "when there are fewer cores than ranks; no effect on GPU ranks).")
FSDP = typer.Option(False, "--fsdp", help="Also shard every parameter's TP shard over the data-parallel ranks "
                    "(FSDP2, one unit per transformer block): 1/(tp·dp) of the training state per rank.")
HSDP = typer.Option(None, "--hsdp", metavar="GROUPS", help="With --fsdp: shard within GROUPS replica groups of "
                    "dp / GROUPS ranks, each inside a node, and replicate across them (HSDP; e.g. the number of "
                    "nodes). Without it FSDP shards over every data-parallel rank, across nodes too.")
CP = typer.Option(1, "--cp", help="Context-parallel ranks (between tp and dp): each runs 1/cp of every sequence, "
                  "attention as a ring over them; sequence lengths must be multiples of 2·cp.")
DEVICE = typer.Option("auto", "--device", help="cuda (one GPU per rank, nccl), cpu (gloo), or auto: cuda when "
                      "this node has a GPU for every rank, else cpu.")


def one_line(text: str) -> str:
    """Collapse a multi-line message (an error and its hint) into one line."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def abort(message: str, debug: bool, code: int = 1, trace: str | None = None) -> NoReturn:
    """One red line (and exit ``code``); with ``--debug`` first ``trace``, by default the exception handled now."""

    if debug:
        trace = traceback.format_exc() if trace is None else trace
        if trace and not trace.startswith("NoneType: None"):
            print(trace, file=sys.stderr)
    fail(one_line(message), code=code)


def say_restart(failure: Failure) -> None:
    """The launcher restarts a failed job (--max-restarts): say which rank failed, how, and where, at once."""
    Console(stderr=True).print(f"[yellow]restart:[/yellow] {escape(failure.line())}", soft_wrap=True)


class Launcher(NamedTuple):
    """The launcher's options, as ``autotp run`` and ``autotp shard`` both take them (:func:`with_launcher`)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    timeout: float | None = None
    max_restarts: int = 0
    device: str = "auto"
    bind_cores: bool = True
    fsdp: bool = False
    hsdp: int | None = None  # None: FSDP over every data-parallel rank, across nodes too
    cp: int = 1


# each field of Launcher: its type and its option, declared once here
_LAUNCHER_OPTIONS = {"nnodes": (int, NNODES), "node_rank": (int, NODE_RANK), "master_addr": (str | None, MASTER_ADDR),
                     "master_port": (int | None, MASTER_PORT), "timeout": (float | None, TIMEOUT),
                     "max_restarts": (int, MAX_RESTARTS), "device": (str, DEVICE), "bind_cores": (bool, BIND_CORES),
                     "fsdp": (bool, FSDP), "hsdp": (int | None, HSDP), "cp": (int, CP)}


def with_launcher(command: Callable) -> Callable:
    """``command`` with the launcher's options added to its command line; they reach it as one
    ``launcher: Launcher`` argument. typer reads the options from the signature this gives the command."""
    own = [p for name, p in inspect.signature(command).parameters.items() if name != "launcher"]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
             for name, (kind, option) in _LAUNCHER_OPTIONS.items()]

    @functools.wraps(command)
    def call(*args, **kwargs):
        launcher = Launcher(**{name: kwargs.pop(name) for name in _LAUNCHER_OPTIONS})
        return command(*args, launcher=launcher, **kwargs)

    call.__signature__ = inspect.signature(command).replace(parameters=[*own, *added])
    return call


def rank_output(world_size: int, nproc_per_node: int, ranks: str | None, log_dir: Path | None,
                debug: bool) -> RankOutput | None:
    """How the ranks' output reaches this terminal: through torch's tee with a rank on every line once there
    is more than one rank or --ranks or --log-dir asks for it; else (one rank) straight, as a plain run."""
    from autotp.distributed.launch import RankOutput

    shown = None
    if ranks is not None:
        try:
            shown = frozenset(int(r) for r in ranks.split(","))
        except ValueError:
            abort(f"--ranks {ranks!r}: give local ranks separated by commas, e.g. --ranks 0,1", debug,
                  code=USAGE_ERROR)
        outside = sorted(r for r in shown if not 0 <= r < nproc_per_node)
        if outside:
            abort(f"--ranks {ranks}: this node runs local ranks 0 to {nproc_per_node - 1}, not "
                  f"{', '.join(map(str, outside))}", debug, code=USAGE_ERROR)
    if log_dir is not None and log_dir.exists() and not log_dir.is_dir():
        abort(f"--log-dir {log_dir} exists and is not a folder", debug, code=USAGE_ERROR)
    if world_size == 1 and shown is None and log_dir is None:
        return None
    return RankOutput(ranks=shown, log_dir=None if log_dir is None else str(log_dir))


def say_logs(folder: str) -> None:
    """--log-dir: where this run's files are, once its ranks have ended."""
    Console(stderr=True).print(f"rank logs: {escape(folder)} (attempt_<n>/<local rank>/stdout.log, stderr.log)",
                               soft_wrap=True)


def launch_spec(tp: int, dp: int, pp: int, launcher: Launcher, debug: bool, world: int | None = None) -> LaunchSpec:
    """The job's launch, its sizes checked (exit 2 naming the flags). ``world``: ``--world-size``, with which
    ``dp`` counts every node's replicas rather than one node's."""
    from autotp.distributed.launch import LaunchSpec  # torch: only once a command runs, never for --help

    try:
        return LaunchSpec(tp=tp, dp=dp, pp=pp, world=world, **launcher._asdict())
    except LaunchError as exc:
        abort(as_flags(exc), debug, code=USAGE_ERROR)


def as_flags(exc: LaunchError) -> str:
    """The error with the settings it names spelled as this command's flags (``node_rank`` -> ``--node-rank``)."""
    return spelled(str(exc), exc.fields)


@with_launcher
def run(
    script: Path = typer.Argument(..., metavar="SCRIPT", help="Python script to run on every rank."),
    args: list[str] | None = typer.Argument(None, help="Arguments for the script, after `--`."),
    tp: int = TP,
    dp: int = DP,
    pp: int = PP,
    world_size: int | None = typer.Option(None, "--world-size", "-w", help="Ranks in all, over every node: --dp "
                                          "then counts every node's replicas (world = tp × cp × dp × pp, world / "
                                          "nnodes ranks per node in Megatron's order, tp fastest then cp, dp, pp: "
                                          "a pipeline's stages may sit on different nodes), as autotp shard reads it."),
    ranks: str | None = typer.Option(None, "--ranks", metavar="RANK,RANK,...", help="Show only these ranks' "
                                     "output: local ranks, this node's from 0 (on one node, the global ranks). "
                                     "--log-dir still keeps every rank's."),
    log_dir: Path | None = typer.Option(None, "--log-dir", metavar="DIR", help="Keep each rank's stdout and "
                                        "stderr in files under DIR, in torch's layout: DIR/<run>/attempt_<n>/"
                                        "<local rank>/stdout.log and stderr.log."),
    debug: bool = DEBUG,
    launcher: Launcher = Launcher(),
) -> None:
    """Run SCRIPT on tp × cp × dp × pp ranks per node with torch's elastic launcher (c10d rendezvous).

    With more than one rank, each line the ranks print starts with the global rank that printed it: [rank1]:."""

    from autotp.cli.progress import Phases

    # on stderr: stdout is the script's own (a script may print data there)
    phases = Phases(console=Console(stderr=True, highlight=False), quiet=launcher.node_rank != 0)
    phases.say("check", f"{script} and the layout, before any rank starts")
    # what needs no torch first (a second or more to import): a mistake is said at once
    if not script.is_file():
        what = "is a folder, not a script" if script.is_dir() else "does not exist"
        abort(f"script {script} {what}", debug, code=USAGE_ERROR)
    if log_dir is not None and log_dir.exists() and not log_dir.is_dir():
        abort(f"--log-dir {log_dir} exists and is not a folder", debug, code=USAGE_ERROR)
    from autotp.distributed.launch import launch

    spec = launch_spec(tp, dp, pp, launcher, debug, world=world_size)
    output = rank_output(spec.world_size, spec.nproc_per_node, ranks, log_dir, debug)
    node = f" on node {launcher.node_rank} of {launcher.nnodes}" if launcher.nnodes > 1 else ""
    phases.say("launch", f"starting {spec.nproc_per_node} ranks{node}: tp {spec.tp}"
               + (f" × cp {spec.cp}" if spec.cp > 1 else "") + f" × dp {spec.data_parallel}"
               + (f" × pp {spec.pp}" if spec.pp > 1 else "") + (" (FSDP)" if spec.fsdp else "")
               + f"; each runs python {script}" + (" " + " ".join(args) if args else ""))
    try:
        # through autotp.distributed.script_rank: the exception that ends a rank is recorded for the launcher
        launch(spec, sys.executable, "-m", "autotp.distributed.script_rank", str(script), *(args or []),
               quiet=not debug, on_restart=say_restart, output=output, on_logs=say_logs)
    except LaunchInterrupted as exc:
        fail(f"{script}: {exc} (the ranks were sent it and have ended)", code=exc.code)
    except RankFailedError as exc:
        code = exc.exitcode if 0 < exc.exitcode < 256 else 1
        recorded = exc.exitcode < 0 or exc.message and not exc.message.startswith("(pid ")
        how = exc.said() if recorded else f"failed on rank {exc.rank} with exit code {exc.exitcode}"
        abort(f"{script}: {how} (of {spec.world_size} ranks)", debug, code=code,
              trace="")  # the script printed its own traceback
    if debug:
        Console(stderr=True).print(f"{script}: {spec.world_size} ranks finished")


def register(app: typer.Typer) -> None:
    app.command("run", short_help="Run a training script on tp × cp × dp × pp ranks.")(run)
