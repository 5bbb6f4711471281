"""What the commands share: the usage-error exit code, the one-line error printer, and the options that
choose how a model is sharded (``autotp plan`` and ``autotp shard`` read them alike)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

# Exit code for a bad combination of sizes, the same one click uses for usage errors.
USAGE_ERROR = 2

SEQUENCE_PARALLEL = typer.Option(False, "--sequence-parallel", help="Split the norm/dropout/residual regions "
                                 "along the sequence (Megatron-SP).")
VIRTUAL_STAGES = typer.Option(None, "--virtual-stages", help="With --pp: stages per rank (default 1; 2 for the "
                              "interleaved and V schedules).")
MICROBATCHES = typer.Option(None, "--microbatches", help="With --pp: micro-batches per step (default: pp); they "
                            "must divide the batch.")
FSDP_PARAM_DTYPE = typer.Option(None, "--fsdp-param-dtype", metavar="bf16|fp16", help="With --fsdp: gather the "
                                 "parameters in this dtype and compute in it, reducing gradients in float32 (FSDP2's "
                                 "mixed precision; the sharded weights and optimizer state stay in the model's dtype).")
FSDP_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # --fsdp-param-dtype -> torch dtype name
EXPERT_PARALLEL = typer.Option(False, "--expert-parallel", help="Place E/tp whole experts of each "
                               "mixture-of-experts layer on every rank (default: 1/tp of every expert).")


def fsdp_param_dtype(value: str | None) -> str | None:
    """``--fsdp-param-dtype``'s torch dtype name, or None; ValueError naming the flag when it is not one of
    :data:`FSDP_DTYPES` (without ``--fsdp`` it is the rule's to refuse: :func:`check_layout_options`)."""
    if value is None:
        return None
    if value not in FSDP_DTYPES:
        raise ValueError(f"--fsdp-param-dtype must be one of {', '.join(FSDP_DTYPES)}, got {value}")
    return FSDP_DTYPES[value]


@dataclass(frozen=True)
class Startup:
    """What the console script hands the command (click's context object): the modules its ranks' fork server
    preloads; none when the app is called otherwise (a test's CliRunner): ranks are then spawned, or forked
    from a server the caller started."""

    warm: tuple[str, ...] = ()


def warm_ranks(ctx: typer.Context) -> None:
    """Start the fork server of the command's ranks, if the console script asked for one: called once the
    checks that need no torch have passed and before torch is imported, so the server imports beside the
    command's own imports, not beside its first checks."""
    if isinstance(ctx.obj, Startup) and ctx.obj.warm:
        from autotp.distributed.warm import warm_ranks as start

        start(ctx.obj.warm)


def fail(message: str, code: int = USAGE_ERROR) -> NoReturn:
    """Print a one-line red error to stderr and exit with ``code``."""
    # soft_wrap keeps the message on one line whatever the terminal width.
    Console(stderr=True).print(
        f"[bold red]error:[/bold red] [red]{escape(message)}[/red]", soft_wrap=True
    )
    raise typer.Exit(code=code)


def check_layout_options(*, pp: int, fsdp: bool, sequence_parallel: bool, expert_parallel: bool,
                         compile_: bool, schedule: str | None = None, cp: int = 1, dp: int | None = None,
                         hsdp: int | None = None, staged: tuple[str, ...] = (), fsdp_dtype: str | None = None,
                         verify: bool = False) -> None:
    """What ``autotp.parallelize`` and the launcher would refuse for these flags, said before any rank starts:
    the one rule (:func:`autotp.combinations.refused`) the library, the launcher, ``autotp shard``, ``autotp
    plan`` and the layout search share, its settings spelled as flags. ``dp``: the whole job's data-parallel
    size (every node's replicas; None: not known yet); ``staged``: the pipeline flags given, as the rule names
    them (``schedule``, ``virtual_stages``, ``microbatches``, ``split_points``); ``verify``: the parity check
    runs."""
    from autotp.combinations import refused

    reason = refused(pipeline=pp, schedule=schedule, fsdp=fsdp, sequence_parallel=sequence_parallel,
                     expert_parallel=expert_parallel, compile=compile_, context_parallel=cp, dp=dp, hsdp=hsdp,
                     staged=staged, fsdp_param_dtype=fsdp_dtype, parity_check=verify)
    if reason is not None:
        fail(as_flags(f"{reason.message}; {reason.hint}", reason.fields))


def staged_flags(**given: object) -> tuple[str, ...]:
    """The pipeline options given (not None), by the names the rule uses: ``staged_flags(schedule=...,
    virtual_stages=..., microbatches=..., split_points=...)``."""
    return tuple(name for name, value in given.items() if value is not None)


def as_flags(text: str, fields: tuple[str, ...]) -> str:
    """``text`` with the settings it names spelled as the command's flags (``node_rank`` -> ``--node-rank``)."""
    for name in fields:
        text = re.sub(rf"(?<![\w-]){name}\b", "--" + name.replace("_", "-"), text)
    return text
