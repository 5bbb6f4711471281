"""The ``autotp`` command (``autotp.cli.main:app``), a typer app with five commands:

- ``layout``: the rank grid, which ranks form the tp, cp, dp, pp, model and embedding groups (defined here);
- ``plan``: the sharding plan of a model file, its collectives and memory (:mod:`autotp.cli.plan`);
- ``shard``: shard a model file over ranks, check it against the unsharded model, train, checkpoint
  (:mod:`autotp.cli.shard`);
- ``run``: a training script on every rank with torch's elastic launcher (:mod:`autotp.cli.run`);
- ``profile``: measure this node (matmuls, memory, collectives per group size) and write the hardware
  profile the layout planner reads (:mod:`autotp.cli.profile`).

Each of those modules has a ``register(app)`` that adds its command; what they share (``fail``,
``USAGE_ERROR``) is in :mod:`autotp.cli.common`. Their module level holds only what declares the commands
and options (typer, rich, torch-free autotp modules); torch and the capture stack are imported inside the
commands, so ``autotp --help`` and each command's ``--help`` answer without importing torch (a second or more).
"""

from __future__ import annotations

import gc
import json

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autotp.cli import plan as _plan, profile as _profile, run as _run, shard as _shard
from autotp.cli.common import Startup, fail
from autotp.distributed.rank_grid import GROUP_KINDS, RankGrid

app = typer.Typer(
    name="autotp",
    help="autotp: automatic tensor parallelism for PyTorch GPT models",
    no_args_is_help=True,
    add_completion=False,
    # click's plain help: at 80 columns rich's panels cut long option names (--sequence-paral…) and show flags
    # with a <bool> metavar; click gives each option its whole name and wraps only the text beside it
    rich_markup_mode=None,
    pretty_exceptions_show_locals=False,
)

_GROUP_TITLES = {
    "tp": "tensor",
    "cp": "context",
    "dp": "data",
    "pp": "pipeline",
    "mp": "model",
    "embedding": "embedding",
}


def _version(asked: bool) -> None:
    if asked:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"autotp {version('autotp')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            print("autotp (not installed: no version recorded)")
        raise typer.Exit()


@app.callback()
def main(show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                           help="Print autotp's version and exit.")) -> None:
    """autotp: automatic tensor parallelism for PyTorch GPT models."""


def _members(groups: list[list[int]]) -> str:
    return " ".join("[" + ",".join(str(r) for r in g) + "]" for g in groups)


def groups_table(grid: RankGrid) -> Table:
    """One row per group kind."""
    from autotp.cli.fit import FitTable

    cp = f" × cp {grid.cp}" if grid.cp > 1 else ""
    title = f"world {grid.world_size}: tp {grid.tp}{cp} × dp {grid.dp} × pp {grid.pp}"
    table = FitTable(title=title)
    table.add_column("group", style="bold")
    table.add_column("count", justify="right", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("members")
    for kind, groups in grid.groups().items():
        size = len(groups[0]) if groups else 0
        title = _GROUP_TITLES[kind]
        name = title if title == kind else f"{title} ({kind})"
        table.add_row(name, str(len(groups)), str(size), escape(_members(groups)))
    return table


def rank_grid(grid: RankGrid) -> Table:
    """One row per rank with its coordinates."""
    from autotp.cli.fit import FitTable

    with_node = grid.gpus_per_node is not None
    table = FitTable(title="ranks")
    table.add_column("rank", justify="right", style="bold", no_wrap=True)
    dims = ("tp", "cp", "dp", "pp") if grid.cp > 1 else ("tp", "dp", "pp")
    for dim in dims:
        table.add_column(dim, justify="right", no_wrap=True)
    if with_node:
        table.add_column("node", justify="right", no_wrap=True)
    for rank in range(grid.world_size):
        c = grid.coords(rank)
        row = [str(rank), *(str(c[dim]) for dim in dims)]
        if with_node:
            row.append(str(c["node"]))
        table.add_row(*row)
    return table


@app.command(short_help="The rank grid: which ranks form the tp, cp, dp, pp groups.")
def layout(
    world_size: int | None = typer.Option(
        None, "--world-size", "-w", help="Total number of ranks; default tp × cp × dp × pp when --dp is given."
    ),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size (innermost, adjacent ranks)."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel size (outermost)."),
    cp: int = typer.Option(1, "--cp", help="Context-parallel size (between tp and dp): ranks sharing a sequence."),
    dp: int | None = typer.Option(
        None, "--dp", help="Data-parallel size; default world / (tp × cp × pp)."
    ),
    gpus_per_node: int | None = typer.Option(
        None, "--gpus-per-node", help="GPUs per node; checks TP groups stay inside a node."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the groups as one JSON object."),
) -> None:
    """Show the rank grid: which ranks form the tp, (cp,) dp, pp, model and embedding groups."""
    if world_size is None:
        if dp is None:
            fail("give --world-size, or --dp (the world is then tp × cp × dp × pp)")
        small = [f"{k} ({v})" for k, v in (("tp", tp), ("cp", cp), ("dp", dp), ("pp", pp)) if v < 1]
        if small:
            fail(f"{', '.join(small)} must be >= 1")
        world_size = tp * cp * dp * pp
    try:
        grid = RankGrid.build(world_size, tp, pp=pp, dp=dp, gpus_per_node=gpus_per_node, cp=cp)
    except (ValueError, TypeError) as exc:
        fail(str(exc))
    groups = grid.groups()
    if as_json:
        # Plain print: no rich markup or wrapping may touch machine-readable output.
        print(json.dumps({kind: groups[kind] for kind in GROUP_KINDS if kind in groups}))
        return
    console = Console()
    console.print(groups_table(grid))
    console.print(rank_grid(grid))


for _command in (_run, _shard, _plan, _profile):
    _command.register(app)


def run(warm: tuple[str, ...] = ()) -> None:
    """The ``autotp`` console script: the app, then an exit that skips the final collection of every
    object torch's import made (half a second of a warm ``autotp plan``; nothing is left to free). ``warm``: the
    modules of the command's ranks (:mod:`autotp.cli.entry`), for :func:`autotp.cli.common.warm_ranks`."""
    try:
        app(obj=Startup(warm))
    finally:
        gc.freeze()


if __name__ == "__main__":
    run()
