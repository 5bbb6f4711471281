"""The commands' tables at 80 columns, rich's width when no stream is a terminal (``autotp plan ... | cat``):
no line is longer, nothing is cut with an ellipsis, and the numbers and paths appear whole.

Every test renders in this process (``autotp plan`` plans on meta tensors; the shard summary is drawn from a
report made up here): no rank is launched.
"""
from __future__ import annotations

import io
import os
import re

import pytest
from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

from autotp.cli.fit import FitTable
from autotp.cli.main import app
from ranks import ROOT

NANOGPT = os.path.join(ROOT, "examples", "nanogpt.py")
LLAMA70B = os.path.join(ROOT, "benchmarks", "llama70b.py")
WIDTH = 80
runner = CliRunner()
# rich's mark for a cell it cut: "…" right after the last character kept, then the cell's padding and its
# border (or the line's end); a table's own "…" (blocks "h.0 … h.3", "stage 0, 1, …:") follows a space
CUT = re.compile(r"\S…(\s*[│┃]|\s*$)")


def _no_terminal(*args):
    raise OSError("not a terminal")  # what os.get_terminal_size says of a pipe


def _check(text: str, width: int = WIDTH) -> list[str]:
    lines = text.splitlines()
    assert lines
    wide = [line for line in lines if len(line) > width]
    assert not wide, "\n".join(wide)
    cut = [line for line in lines if CUT.search(line)]
    assert not cut, "\n".join(cut)
    return lines


def _plan(*args: str, env: dict[str, str | None] | None = None) -> str:
    result = runner.invoke(app, ["plan", *args], env=env if env is not None else {"COLUMNS": str(WIDTH)})
    assert result.exit_code == 0, result.output
    return result.stdout


def test_piped_console_is_80_columns_unless_columns_says(monkeypatch) -> None:
    """No terminal on any stream and no COLUMNS: rich's 80 columns (a pipe is not widened); COLUMNS wins."""
    from autotp.cli.plan import _console

    monkeypatch.setattr(os, "get_terminal_size", _no_terminal)
    monkeypatch.delenv("COLUMNS", raising=False)
    assert _console().width == 80
    monkeypatch.setenv("COLUMNS", "123")
    assert _console().width == 123


def test_plan_tp2_piped(monkeypatch) -> None:
    """``autotp plan examples/nanogpt.py --tp 2 | cat``: the tables fill 80 columns and cut nothing; the
    communication table's counts, elements and bytes are whole (it is split in two to fit)."""
    monkeypatch.setattr(os, "get_terminal_size", _no_terminal)
    text = _plan(NANOGPT, "--tp", "2", env={"COLUMNS": None})
    assert "…" not in text
    lines = _check(text)
    assert max(len(line) for line in lines) == WIDTH  # the width is rich's 80, not a wider one
    assert "┃ collective " in text and "┃ elements " in text  # headers whole
    total = [line for line in lines if line.startswith("│ total ")]
    assert len(total) == 2 and " 13 " in total[0] and "82,304" in total[1] and "321.5 KiB" in total[1]
    assert "41,216" in text and "161.0 KiB" in text
    assert "transformer.h.0.attn.c_attn" in text and "[192, 64]" in text and "[96, 64]" in text
    assert "transformer.wpe.weight" in text


def test_plan_fsdp_at_80() -> None:
    lines = _check(_plan(NANOGPT, "--tp", "2", "--fsdp", "--dp", "2"))
    text = "\n".join(lines)
    assert "┃ gathered / rank ┃" in text and "┃ sharded / rank ┃" in text
    assert "245.2 KiB" in text and "122.6 KiB" in text
    assert "reduce-scatter(sum)" in text and "703.2 KiB" in text


def test_plan_pp_at_80() -> None:
    lines = _check(_plan(NANOGPT, "--tp", "2", "--pp", "2"))
    text = "\n".join(lines)
    for header in ("fwd FLOPs", "activations", "act. on rank", "fwd bytes", "bwd bytes"):
        assert header in text
    assert "15.73 MFLOP" in text and "[2, 32, 64]" in text and "937.5 KiB" in text


@pytest.mark.extended
def test_plan_auto_70b_at_80() -> None:
    """The layout search's 13 columns at 80: split into tables that each repeat # and the layout; every
    header and every number whole (before: ``token…``, ``TFLO…``, ``memo…``, and 1-character columns)."""
    text = _plan(LLAMA70B, "--auto", "--world-size", "64", "--gpus-per-node", "8", "--gpu", "h100",
                 "--global-batch", "256")
    # the prose lines above and under the tables are printed whole, for the terminal to wrap
    table = text[text.index("\n") + 1:text.index("best:")]
    lines = _check(table)
    assert "…" not in text
    for header in ("tokens/s", "TFLOP/s", "memory", "bubble", "dp comm", "optim"):
        assert header in table
    # the layout column wraps at a space when a longer layout (tp4 dp4·fsdp(bf16) pp4 v4 …) sets its width
    assert re.search(r"│ +1 │ tp4 dp4·fsdp\(bf16\) pp4 v4[^│]*│ 14\.51 s │", table)
    assert "64.4 GiB (96%)" in table and "1.50 s" in table
    assert "assumed, not measured on h100" in table  # a preset's terms: datasheet numbers
    assert sum(line.startswith("│  1 │") for line in lines) >= 2  # split, the rank and layout repeated


def _shard_report(checkpoint: str):
    from autotp.cli.shard_worker import Parity, RankStats, ShardReport

    comm = (("forward", "all_reduce", "sum", 7, 7, 41216, 41216, 164864),
            ("backward", "all_reduce", "sum", 5, 5, 40960, 40960, 163840),
            ("forward", "all_reduce", "max", 1, 1, 128, 128, 512),
            ("total", "all", "", 13, 13, 82304, 82304, 329216))
    return ShardReport(
        model="/work/examples/nanogpt.py", tp=2, dp=1, backend="gloo", unsharded_bytes=482304,
        ranks=(RankStats(0, 0, 0, 251136, (0.0123, 0.0125), peak_memory=450_000_000),
               RankStats(1, 1, 0, 251136, (0.0124, 0.0126), peak_memory=451_000_000)),
        collectives=(("forward", "all_reduce", "sum", 7), ("backward", "all_reduce", "sum", 5),
                     ("forward", "all_reduce", "max", 1)),
        parity=Parity(1.2e-7, 3.4e-7), losses=(5.5412, 5.4021, 5.2766), final_loss=5.1,
        plan_path=checkpoint.rsplit("/checkpoints", 1)[0] + "/plan.json", checkpoint_path=checkpoint, comm=comm,
        batch="the file's example_batch(): (4, 32) token ids", tokens_per_step=128,
        metrics_path=checkpoint.rsplit("/checkpoints", 1)[0] + "/metrics.jsonl")


def _shard_text(checkpoint: str) -> str:
    from autotp.cli.shard import render

    console = Console(file=io.StringIO(), width=WIDTH)
    render(_shard_report(checkpoint), console)
    return console.file.getvalue()


def test_shard_summary_at_80() -> None:
    """The summary ``autotp shard`` prints last (before: ``checkpoin…``, ``colle…``, ``eleme…``)."""
    checkpoint = "/tmp/autotp-out/checkpoints/step-3"
    text = _shard_text(checkpoint)
    assert "…" not in text
    lines = _check(text)
    assert f"checkpoint: {checkpoint}" in lines
    assert "plan: /tmp/autotp-out/plan.json" in lines
    assert "7 × all_reduce(sum)" in text and "5 × all_reduce(sum)" in text
    assert "┃ collective " in text and "┃ elements " in text and "82,304" in text and "321.5 KiB" in text
    assert "5.5412 → 5.4021 → 5.2766" in text and "12.4 ms" in text
    assert "metrics: /tmp/autotp-out/metrics.jsonl" in lines and "429.2 MiB" in text
    assert "10,323 tokens/s," in text and "5,161 per" in text  # 128 tokens / 12.4 ms, over 2 ranks


def test_shard_summary_long_path_whole() -> None:
    """A checkpoint path wider than the console is printed whole on a line of its own (the terminal wraps it
    where it likes; a copy of the line is the path)."""
    checkpoint = "/scratch/" + "/".join(["a-rather-long-folder-name"] * 4) + "/autotp-out/checkpoints/step-3"
    assert len(checkpoint) > WIDTH
    text = _shard_text(checkpoint)
    assert f"checkpoint: {checkpoint}" in text.splitlines()
    _check(text.replace(checkpoint, "PATH").replace(checkpoint.rsplit("/checkpoints", 1)[0], "OUT"))


def _numbers(rows: int, cols: int) -> Table:
    table = FitTable(title="a table of numbers wider than the console", keys=2, caption="what the numbers are")
    table.add_column("name")
    table.add_column("kind of thing")
    for c in range(cols):
        table.add_column(f"column {c}", justify="right", no_wrap=True)
    for r in range(rows):
        table.add_row(f"row.{r}.name", "a few words", *(f"{(r + 1) * (c + 1) * 123_457:,} B" for c in range(cols)))
    return table


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_fit_table_splits_instead_of_cutting(width: int) -> None:
    console = Console(file=io.StringIO(), width=width)
    console.print(_numbers(3, 9))
    text = console.file.getvalue()
    assert "…" not in text
    _check(text, width)
    for r in range(3):
        for c in range(9):
            assert f"{(r + 1) * (c + 1) * 123_457:,} B" in text  # each number whole, on one line
    assert text.count("row.0.name") > 1  # the parts repeat the keys
    assert text.index("a table of numbers") < text.index("what the numbers are")


def test_fit_table_that_fits_is_rich_s_own() -> None:
    """A table that fits is drawn as rich draws it: the fitting changes nothing there."""
    wide, plain = Console(file=io.StringIO(), width=400), Console(file=io.StringIO(), width=400)
    table = _numbers(3, 9)
    wide.print(table)
    reference = Table(title=table.title, caption=table.caption)
    for column in table.columns:
        reference.add_column(column.header, justify=column.justify, no_wrap=column.no_wrap)
    for r in range(3):
        reference.add_row(*(list(column.cells)[r] for column in table.columns))
    plain.print(reference)
    assert wide.file.getvalue() == plain.file.getvalue()


def test_fit_table_folds_only_a_word_wider_than_the_console() -> None:
    """A cell one word wider than the console (a long list of ranks) is folded, the table kept whole."""
    table = FitTable(title="groups")
    table.add_column("group")
    table.add_column("count", justify="right", no_wrap=True)
    table.add_column("members")
    table.add_row("model (mp)", "2", "[" + ",".join(str(r) for r in range(48)) + "]")
    console = Console(file=io.StringIO(), width=60)
    console.print(table)
    lines = _check(console.file.getvalue(), 60)
    assert sum("┃ group" in line for line in lines) == 1 and "(continued)" not in console.file.getvalue()


def test_profile_tables_at_80() -> None:
    """``autotp profile``'s tables, from a profile made up here: a column per message size, split to fit."""
    from autotp.cli.profile import render
    from autotp.search.hardware import Hardware, Link, Measured

    link = Link(35e-6, 12e9)
    sizes = [2 ** e for e in range(10, 28, 2)]
    measured = tuple(Measured(kind, 8, link, tuple((s, link.latency + s / link.bandwidth) for s in sizes))
                     for kind in ("all_reduce", "all_gather", "reduce_scatter", "send"))
    hw = Hardware("h100-node", 6e14, 9.9e14, 3.35e12, 80 * 2**30, 8, link, link, overhead=5e-6, optimizer=2e-10,
                  measured=measured, matmuls=((8192, 8192, 8192, 6.1e14), (16384, 8192, 28672, 6.3e14)),
                  extra={"device": "cuda", "dtype": "bf16", "threads_per_rank": 4})
    console = Console(file=io.StringIO(), width=WIDTH)
    render(hw, console)
    text = console.file.getvalue()
    assert "…" not in text
    _check(text)
    assert "35.0 µs + bytes / 12.00 GB/s" in text and "630.00 TFLOP/s" in text
    assert "reduce-scatter" in text and "1.43 ms" in text and "5.63 ms" in text and "610.00 TFLOP/s" in text


def test_shard_summary_says_why_fsdp_steps_are_slower(monkeypatch) -> None:
    """The FSDP summary's step times (before: 592 ms against 165 ms, unexplained) come with the reasons: more
    ranks than cores, and FSDP's per-unit collectives on a model this small."""
    import dataclasses

    from autotp.cli.shard_worker import RankStats

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    ranks = tuple(RankStats(r, r % 2, r // 2, 125568, (t, t), peak_memory=450_000_000)
                  for r, t in enumerate((0.115, 0.092, 0.117, 0.090)))
    report = dataclasses.replace(_shard_report("/tmp/o/checkpoints/step-3"), dp=2, ranks=ranks, fsdp=1,
                                 fsdp_units=("transformer.wpe", "transformer.h.0", "transformer.h.1"))
    console = Console(file=io.StringIO(), width=600)  # one line per row: the phrases unbroken
    from autotp.cli.shard import render

    render(report, console)
    text = " ".join(console.file.getvalue().split())
    assert "4 ranks share this machine's 2 CPU cores" in text
    assert "FSDP2 adds an all-gather per unit forward and backward and a reduce-scatter per unit" in text
    assert "medians range 90.0–117.0 ms across ranks" in text
    # one device per rank and no FSDP: nothing to explain
    plain = Console(file=io.StringIO(), width=200)
    render(_shard_report("/tmp/o/checkpoints/step-3"), plain)
    assert "step time" not in plain.file.getvalue()


def test_help_at_80_columns_names_every_option_whole() -> None:
    """``COLUMNS=80 autotp CMD --help``: no line is longer, every option's name appears whole (rich's panels cut
    them: ``--sequence-paral…``), a flag is shown as a flag (no ``<bool>``), and the commands' summaries are
    whole sentences (not cut with "...")."""
    import typer

    group = typer.main.get_command(app)
    top = runner.invoke(app, ["--help"], env={"COLUMNS": str(WIDTH)})
    assert top.exit_code == 0 and "..." not in top.stdout.split("Commands:")[1], top.stdout
    assert "--version" in top.stdout
    for name, command in group.commands.items():
        result = runner.invoke(app, [name, "--help"], env={"COLUMNS": str(WIDTH)})
        assert result.exit_code == 0, result.output
        text = result.stdout
        assert not [line for line in text.splitlines() if len(line) > WIDTH], text
        assert "…" not in text and "<bool>" not in text, text
        names = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("--")}
        # each name at the start of its row, whole: "  --sequence-parallel   Split ..." or "-w, --world-size <int>"
        rows = {word.rstrip(",") for line in text.splitlines() for word in line.split()[:4]}
        assert names <= rows, (name, sorted(names - rows))
