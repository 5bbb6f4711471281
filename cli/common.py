"""What the commands share: the usage-error exit code, the one-line error printer, and the options that
choose how a model is sharded (``autotp plan`` and ``autotp shard`` read them alike)."""
from __future__ import annotations

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
EXPERT_PARALLEL = typer.Option(False, "--expert-parallel", help="Place E/tp whole experts of each "
                               "mixture-of-experts layer on every rank (default: 1/tp of every expert).")


def fail(message: str, code: int = USAGE_ERROR) -> NoReturn:
    """Print a one-line red error to stderr and exit with ``code``."""
    # soft_wrap keeps the message on one line whatever the terminal width.
    Console(stderr=True).print(
        f"[bold red]error:[/bold red] [red]{escape(message)}[/red]", soft_wrap=True
    )
    raise typer.Exit(code=code)


def check_layout_options(*, pp: int, fsdp: bool, sequence_parallel: bool, expert_parallel: bool,
                         compile_: bool, schedule: str | None = None, cp: int = 1) -> None:
    """What ``autotp.parallelize`` would refuse for these flags, said before any rank starts: the one rule
    (:func:`autotp.options.refused`) the library, ``autotp shard``, ``autotp plan`` and the layout search
    share."""
    from autotp.options import refused

    reason = refused(pipeline=pp, schedule=schedule, fsdp=fsdp, sequence_parallel=sequence_parallel,
                     expert_parallel=expert_parallel, compile=compile_, context_parallel=cp)
    if reason is not None:
        fail(f"{reason.message}; {reason.hint}")
