"""``autotp plan MODEL_PY --tp N``: show what autotp would do to a model, without devices or process groups.

The model is built on the meta device (nothing is materialised) and captured on meta tensors in this one
process; the plan, the rank grid and the numbers of :mod:`autotp.reports.sharding` are printed. A file without
``example_batch()`` is planned on ``autotp.parallelize``'s default batch of token ids (sizes from ``--batch``
and ``--seq`` when given), and the output says so. ``--json`` writes them as data, ``--svg`` draws the rank
grid and each layer's sharding as a diagram (:mod:`autotp.cli.diagram`), ``--html`` the tables the terminal
shows.
"""
from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape

from autotp.cli.common import (EXPERT_PARALLEL, FSDP_PARAM_DTYPE, MICROBATCHES, SEQUENCE_PARALLEL, USAGE_ERROR,
                               VIRTUAL_STAGES, check_layout_options, fsdp_param_dtype, staged_flags)
from autotp.cli.plan_format import fmt_size
from autotp.cli.run import DEBUG, abort
from autotp.distributed.rank_grid import RankGrid
from autotp.errors import AutotpError, PipelineError

# for annotations only: these modules import torch and the capture stack, which the command imports when it
# runs, so that `autotp plan --help` does not
if TYPE_CHECKING:
    from autotp.reports.pipeline import PipelineReport, PipelineSpec
    from autotp.reports.sharding import FSDPReport, Report


def plan(
    model: str = typer.Argument(..., metavar="MODEL_PY", help="Model file defining build_model() and "
                                "optionally example_batch(); path.py:NAME names another factory."),
    tp: int | None = typer.Option(None, "--tp", help="Tensor-parallel size (required unless --auto)."),
    dp: int | None = typer.Option(None, "--dp", help="Data-parallel size; default world / (tp × pp), or 1."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel size: cut the blocks into pipeline stages and "
                           "show each stage, what crosses each cut and the bubble."),
    virtual_stages: int | None = VIRTUAL_STAGES,
    schedule: str | None = typer.Option(None, "--schedule", help="With --pp: the pipeline schedule (GPipe, 1F1B, "
                                        "Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble; "
                                        "default 1F1B)."),
    microbatches: int | None = MICROBATCHES,
    split_points: str | None = typer.Option(None, "--split-points", metavar="BLOCK,BLOCK,...",
                                            help="With --pp: the blocks that start stages 1, 2, ... (default: "
                                            "balanced by forward FLOPs)."),
    cp: int = typer.Option(1, "--cp", help="Context-parallel size: show what runs on each rank's 1/cp of the "
                           "sequence (attention as rings), its activation memory and K/V traffic."),
    world_size: int | None = typer.Option(None, "--world-size", "-w", help="Total ranks; default tp × cp × dp × pp."),
    gpus_per_node: int | None = typer.Option(None, "--gpus-per-node", help="GPUs per node: marks node boundaries."),
    nnodes: int | None = typer.Option(None, "--nnodes", help="Nodes, as `autotp shard` counts them: world / "
                                      "nnodes GPUs per node; without --world-size, --dp counts one node's "
                                      "replicas (world = tp × cp × dp × pp × nnodes), as autotp shard reads it."),
    batch: int | None = typer.Option(None, "--batch", help="Batch size the numbers are for (default: the "
                                     "example batch's)."),
    seq: int | None = typer.Option(None, "--seq", help="Sequence length the numbers are for."),
    vocab_multiple: int = typer.Option(1, "--vocab-multiple", help="Round each rank's vocab rows up to this."),
    sequence_parallel: bool = SEQUENCE_PARALLEL,
    expert_parallel: bool = EXPERT_PARALLEL,
    fsdp: bool = typer.Option(False, "--fsdp", help="Shard each tp rank's parameters, gradients and optimizer "
                              "state over the --dp ranks (FSDP2): show its units, memory and traffic."),
    fsdp_dtype: str | None = FSDP_PARAM_DTYPE,
    autocast: str | None = typer.Option(None, "--autocast", help="bf16 or fp16: count the collectives' bytes "
                                        "as a forward under torch.autocast moves them."),
    json_out: Path | None = typer.Option(None, "--json", help="Write plan, layout and report as JSON here."),
    svg: Path | None = typer.Option(None, "--svg", help="Draw a diagram here (SVG): the rank grid with its nodes, "
                                    "and each layer's weights as cut, with its collectives."),
    html: Path | None = typer.Option(None, "--html", help="Write the printed tables as HTML here."),
    auto: bool = typer.Option(False, "--auto", help="Choose the layout: price every tp × dp × pp (FSDP, "
                              "sequence parallelism, virtual stages, micro-batches, recomputation) for "
                              "--world-size devices and show the best; needs --world-size."),
    gpu: str | None = typer.Option(None, "--gpu", help="a100, h100 (datasheet presets) or a profile written "
                                   "by `autotp profile` (with --auto, default ./autotp-profile.json); with --pp, "
                                   "the pipeline ranks' memory is checked against the device's."),
    global_batch: int | None = typer.Option(None, "--global-batch", help="With --auto: sequences per step, "
                                            "all replicas together (default: one example batch per replica)."),
    top: int = typer.Option(10, "--top", help="With --auto: layouts to show."),
    cache: bool = typer.Option(True, "--cache/--no-cache", help="Reuse the plan made for the same model code, "
                               "shapes and options (kept in $AUTOTP_CACHE_DIR or ~/.cache/autotp/plans)."),
    debug: bool = DEBUG,
) -> None:
    """Show how MODEL_PY would be sharded: rank grid, per-layer plan, memory and communication per step; with
    --pp, its pipeline stages, what crosses each cut and the bubble; with --auto, the best layouts for
    --world-size devices and why."""
    if auto and (svg is not None or html is not None):  # they draw one layout's plan, which --auto does not make
        abort("--svg and --html draw one layout's plan: drop them with --auto, then plan the layout it chooses "
              "with --tp/--dp/--pp", debug, code=USAGE_ERROR)
    if auto:
        if nnodes is not None and world_size is not None:
            gpus_per_node = _per_node(world_size, nnodes, gpus_per_node, debug)
        return _plan_auto(model, tp, dp, pp, world_size, gpus_per_node, gpu, batch, seq, global_batch, autocast,
                          top, json_out, debug)
    if tp is None:
        abort("give --tp N, or --auto to choose the layout", debug, code=USAGE_ERROR)
    if nnodes is not None and world_size is None:  # autotp shard's per-node --dp: the nodes multiply it
        if nnodes < 1:
            abort(f"--nnodes must be >= 1, got {nnodes}", debug, code=USAGE_ERROR)
        dp, world_size = (dp or 1) * nnodes, tp * cp * (dp or 1) * pp * nnodes
    if nnodes is not None:
        gpus_per_node = _per_node(world_size, nnodes, gpus_per_node, debug)

    for name, value in (("--batch", batch), ("--seq", seq), ("--vocab-multiple", vocab_multiple)):
        if value is not None and value < 1:
            abort(f"{name} must be >= 1, got {value}", debug, code=USAGE_ERROR)
    try:
        world = world_size if world_size is not None else tp * cp * (dp or 1) * pp
        grid = RankGrid.build(world, tp, pp=pp, dp=dp, gpus_per_node=gpus_per_node, cp=cp)
    except (ValueError, TypeError) as exc:
        abort(str(exc), debug, code=USAGE_ERROR)
    try:
        param_dtype = fsdp_param_dtype(fsdp_dtype)
    except ValueError as exc:
        abort(str(exc), debug, code=USAGE_ERROR)
    # what runs together: the rule autotp shard, its launcher and the library ask (FSDP over dp × cp ranks)
    check_layout_options(pp=pp, fsdp=fsdp, sequence_parallel=sequence_parallel, expert_parallel=expert_parallel,
                         compile_=False, schedule=schedule, cp=cp, dp=grid.dp, fsdp_dtype=fsdp_dtype,
                         staged=staged_flags(schedule=schedule, virtual_stages=virtual_stages,
                                             microbatches=microbatches, split_points=split_points))
    from autotp.parallel.planning import AUTOCAST, plan_file
    from autotp.reports.sharding import fsdp_from_rows

    if autocast is not None and autocast not in AUTOCAST:
        abort(f"--autocast must be one of {', '.join(AUTOCAST)}, got {autocast}", debug, code=USAGE_ERROR)
    spec = _pipeline_spec(pp, schedule, virtual_stages, microbatches, split_points, batch, debug)
    try:
        # with --cp the context plan and its report come from the same capture
        the_plan, report, names, batch_note, pipe, cached, context = plan_file(
            model, tp, batch, seq, vocab_multiple, sequence_parallel, autocast, expert_parallel, spec, cache, fsdp,
            grid.dp, cp)
    except PipelineError as exc:  # micro-batches the batch does not divide, more stages than blocks, split points
        abort(_as_flags(str(exc)), debug, code=USAGE_ERROR)
    except (AutotpError, ValueError) as exc:  # a ValueError of the plan names the sizes (experts tp does not divide)  # model file, capture and sharding problems: the user's to fix
        # (and with --cp an op that mixes positions, or a length 2·cp does not divide)
        abort(str(exc), debug, code=USAGE_ERROR)
    fsdp_info = None
    if fsdp and spec is None:  # with pipeline stages each stage is one unit: the per-block tables do not apply
        # with --fsdp-param-dtype the gathers (and the units held gathered) in that dtype, the reduce-scatters in
        # float32, as autotp shard's FSDPConfig sets FSDP2's MixedPrecisionPolicy
        fsdp_info = fsdp_from_rows(the_plan, report.params, grid.dp, param_dtype,
                                   "float32" if param_dtype is not None else None, cp=grid.cp)

    console = _console()
    render(console, model, the_plan, report, grid, names, batch_note, fsdp_info, pipe, fsdp)
    if context is not None:
        from autotp.cli.plan_tables import context_table

        console.print(context_table(context, tp_collectives=tp > 1, fsdp=fsdp))
    if fsdp and spec is not None:
        console.print(f"fsdp with pipeline stages: each of a rank's stages is one FSDP2 unit over dp {grid.dp}; "
                      "per step one all-gather of each stage before its first micro-batch (kept gathered to the "
                      "last one's backward, as torchtitan pipelines) and one reduce-scatter after the last",
                      soft_wrap=True)
    if param_dtype is not None:  # FSDP2's MixedPrecisionPolicy, as autotp shard --fsdp-param-dtype sets it
        console.print(f"fsdp mixed precision: parameters gathered and computed in {param_dtype}, gradients "
                      f"reduced in float32 (the sharded weights and optimizer state stay in the model's dtype)",
                      soft_wrap=True)
    if pipe is not None and gpu is not None:
        _device_memory(console, pipe, gpu, debug)
    if cached is not None:
        Console(stderr=True).print(f"[dim]plan cache: {escape(str(cached))} (--no-cache plans again)[/dim]",
                                   soft_wrap=True)
    if json_out is not None:
        data = {"plan": the_plan.to_dict(), "layout": grid.groups(),
                "world": {k: v for k, v in grid.to_dict().items() if k != "groups"},
                "report": report.to_dict()}
        if fsdp_info is not None:
            data["fsdp"] = fsdp_info.to_dict()
        if param_dtype is not None:
            data["fsdp_param_dtype"] = param_dtype
        if pipe is not None:
            data["pipeline"] = pipe.to_dict()
        if context is not None:
            data["context"] = context.to_dict()
        json_out.write_text(json.dumps(data, indent=2))
    if svg is not None:
        from autotp.cli.diagram import draw

        drawn = draw(f"autotp plan {model}", the_plan, report, grid, names, pipe, fsdp)
        _write(svg, drawn.svg, "--svg", debug)
        console.print(f"wrote diagram {escape(str(svg))} ({drawn.ranks} ranks, {drawn.layers} modules)",
                      soft_wrap=True)
    if html is not None:
        # drawn again, off screen and at least 160 columns wide, so a file does not inherit a narrow
        # (or absent, under a pipe) terminal's wrapping
        pic = Console(record=True, file=io.StringIO(), width=max(console.width, 160), force_terminal=True)
        render(pic, model, the_plan, report, grid, names, batch_note, fsdp_info, pipe, fsdp)
        _write(html, pic.export_html(), "--html", debug)
        console.print(f"wrote tables {escape(str(html))}", soft_wrap=True)


def _per_node(world: int, nnodes: int, gpus_per_node: int | None, debug: bool) -> int:
    """The GPUs per node ``--nnodes`` implies: equal shares of the world, agreeing with --gpus-per-node."""
    if nnodes < 1 or world % nnodes:
        abort(f"--nnodes {nnodes}: the {world} ranks do not divide into {nnodes} equal nodes", debug,
              code=USAGE_ERROR)
    if gpus_per_node is not None and gpus_per_node != world // nnodes:
        abort(f"--gpus-per-node {gpus_per_node} and --nnodes {nnodes} disagree: {nnodes} nodes of {world} ranks hold "
              f"{world // nnodes} each; give one of them", debug, code=USAGE_ERROR)
    return world // nnodes


def _write(path: Path, text: str, flag: str, debug: bool) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:  # a missing folder or no permission: the user's to fix, said in one line
        abort(f"{flag}: cannot write {path}: {exc.strerror or exc}", debug, code=USAGE_ERROR)


def _plan_auto(model: str, tp: int | None, dp: int | None, pp: int, world_size: int | None,
               gpus_per_node: int | None, gpu: str | None, batch: int | None, seq: int | None,
               global_batch: int | None, autocast: str | None, top: int, json_out: Path | None, debug: bool) -> None:
    from autotp.cli import plan_auto  # the cost model: only when asked for
    from autotp.parallel.planning import AUTOCAST

    given = [f for f, v in (("--tp", tp), ("--dp", dp), ("--pp", None if pp == 1 else pp)) if v is not None]
    if given:
        abort(f"--auto chooses the layout: drop {', '.join(given)}", debug, code=USAGE_ERROR)
    if world_size is None:
        abort("--auto needs --world-size N: the devices to lay the model out on", debug, code=USAGE_ERROR)
    for name, value in (("--world-size", world_size), ("--gpus-per-node", gpus_per_node),
                        ("--global-batch", global_batch), ("--top", top)):
        if value is not None and value < 1:
            abort(f"{name} must be >= 1, got {value}", debug, code=USAGE_ERROR)
    if autocast is not None and autocast not in AUTOCAST:
        abort(f"--autocast must be one of {', '.join(AUTOCAST)}, got {autocast}", debug, code=USAGE_ERROR)
    try:
        hw = plan_auto.hardware(gpu)
    except ValueError as exc:
        abort(str(exc), debug, code=USAGE_ERROR)
    try:
        found = plan_auto.run_search(model, world_size, gpus_per_node, hw, batch, seq, global_batch, autocast)
    except (AutotpError, ValueError) as exc:
        abort(str(exc), debug, code=USAGE_ERROR)
    plan_auto.render(_console(), model, found, top)
    if json_out is not None:
        json_out.write_text(json.dumps(plan_auto.to_dict(found, top), indent=2, default=str))
    if found.result.best is None:
        raise typer.Exit(code=1)


def _device_memory(console: Console, pipe: PipelineReport, gpu: str, debug: bool) -> None:
    """The busiest pipeline rank's memory against what ``gpu`` leaves usable (the layout search's reserve)."""
    from autotp.search.cost import RESERVED
    from autotp.search.hardware import resolve

    try:
        hw = resolve(gpu)
    except (ValueError, OSError) as exc:
        abort(f"--gpu: {exc}", debug, code=USAGE_ERROR)
    usable = (1 - RESERVED) * hw.memory_bytes
    peak = max(pipe.ranks, key=lambda r: r.memory_bytes)
    fits = "fits" if peak.memory_bytes <= usable else "does NOT fit"
    console.print(f"memory per rank: at most {fmt_size(peak.memory_bytes)} (pipeline rank {peak.rank}) of "
                  f"{fmt_size(round(usable))} usable on {hw.name} ({peak.memory_bytes / usable:.0%}): {fits}; "
                  f"{RESERVED:.0%} of the device kept for the context, buffers and fragmentation", soft_wrap=True)


def _pipeline_spec(pp: int, schedule: str | None, virtual_stages: int | None, microbatches: int | None,
                   split_points: str | None, batch: int | None, debug: bool) -> PipelineSpec | None:
    """The checked pipeline options (None without --pp > 1, where check_layout_options refused them), or exit 2
    before anything is captured; the micro-batches are checked against the example's batch once it is known
    (plan_file)."""
    if pp == 1:
        return None
    from autotp.parallel.pipeline import SCHEDULES, check_pipeline, stage_ranks  # torch.distributed.pipelining
    from autotp.reports.pipeline import PipelineSpec

    m = microbatches if microbatches is not None else pp
    try:
        name, v = check_pipeline(pp, schedule or "1F1B", virtual_stages, m, batch)
    except AutotpError as exc:
        abort(_as_flags(str(exc)), debug, code=USAGE_ERROR)
    points = tuple(p.strip() for p in split_points.split(",")) if split_points is not None else ()
    if any(not p for p in points):
        abort(f"--split-points {split_points!r} names an empty block: give BLOCK,BLOCK,... (the blocks that "
              "start stages 1, 2, ...)", debug, code=USAGE_ERROR)
    ranks = tuple(stage_ranks(pp, pp * v, SCHEDULES[name].placement))
    return PipelineSpec(pp, v, m, name, ranks, points)


# autotp.pipeline's argument names in its errors, as this command spells them
_PIPELINE_FLAGS = {"virtual_stages": "--virtual-stages", "microbatches": "--microbatches",
                   "split_points": "--split-points"}


def _as_flags(message: str) -> str:
    return re.sub(r"(?<![\w-])(virtual_stages|microbatches|split_points)\b", lambda x: _PIPELINE_FLAGS[x[1]],
                  message)


def _console() -> Console:
    """The console the tables print to: as wide as COLUMNS says, else the terminal's width, else (no terminal
    anywhere) rich's 80 columns. The tables fit any of them without cutting a number (autotp.cli.fit), so a
    pipe or file is not widened past what a terminal would show."""
    return Console()


def render(console: Console, model: str, the_plan, report: Report, grid: RankGrid, names: list[str],
           batch_note: str = "", fsdp: FSDPReport | None = None, pipe: PipelineReport | None = None,
           sharded_dp: bool = False) -> None:
    from autotp.cli.plan_tables import (fsdp_memory_table, fsdp_traffic_table, fsdp_units_table, p2p_table,
                                        ranks_table, schedule_table, stages_table)
    from autotp.cli.tp_tables import (comm_table, experts_table, layer_table, not_sharded_table, rank_grid,
                                      replicated_table, sequence_table, totals_table, world_line)

    if report.tp == 1 and grid.cp > 1:  # no weight is cut: the per-layer and tp tables would say nothing
        return _render_context_only(console, model, report, grid, batch_note, fsdp, sharded_dp)
    sp = ", sequence parallel" if the_plan.sequence is not None and the_plan.sequence.leaves else ""
    console.print(f"[bold]{escape(model)}[/bold]: tp {report.tp}{sp}, {len(the_plan.pairs)} column→row pairs, "
                  f"{len(the_plan.collectives)} collectives per step; {world_line(grid, int(sharded_dp))}")
    if batch_note:
        console.print(f"[yellow]note:[/yellow] {escape(batch_note)}")
    console.print(rank_grid(grid))
    console.print(layer_table(report, names, {w.name: w.reason for w in the_plan.whole}))
    console.print(replicated_table(report, the_plan.replicated))
    if the_plan.whole:
        console.print(not_sharded_table(report, the_plan.whole))
    elif report.tp > 1:
        console.print("every weight of a linear, embedding or matmul is sharded")
    seq = sequence_table(the_plan, report)
    if seq is not None:
        console.print(seq)
    experts = experts_table(the_plan, report)
    if experts is not None:
        console.print(experts)
    console.print(totals_table(report, grid, ddp=fsdp is None, staged=pipe is not None))
    console.print(comm_table(report))
    if fsdp is not None:
        console.print(fsdp_units_table(fsdp))
        console.print(fsdp_memory_table(fsdp))
        console.print(fsdp_traffic_table(fsdp))
    if pipe is not None:
        console.print(stages_table(pipe))
        if pipe.virtual_stages > 1:
            console.print(ranks_table(pipe))
        console.print(p2p_table(pipe))
        console.print(schedule_table(pipe))
    for note in report.notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")


def _render_context_only(console: Console, model: str, report: Report, grid: RankGrid, batch_note: str,
                         fsdp: FSDPReport | None, sharded_dp: bool) -> None:
    """tp 1 with cp: every weight whole on every rank, each rank 1/cp of every sequence. The header, the rank
    grid and what a rank holds; the context-parallelism table (printed after this) says what cp does."""
    from autotp.cli.plan_tables import context_totals_table, fsdp_memory_table, fsdp_traffic_table, fsdp_units_table
    from autotp.cli.tp_tables import rank_grid, world_line

    console.print(f"[bold]{escape(model)}[/bold]: cp {grid.cp}, tp 1: no weight is cut (every rank holds the "
                  f"whole model) and each rank runs 1/{grid.cp} of every sequence; "
                  f"{world_line(grid, int(sharded_dp))}", soft_wrap=True)
    if batch_note:
        console.print(f"[yellow]note:[/yellow] {escape(batch_note)}")
    console.print(rank_grid(grid))
    console.print(context_totals_table(report, grid, ddp=fsdp is None))
    if fsdp is not None:
        console.print(fsdp_units_table(fsdp))
        console.print(fsdp_memory_table(fsdp))
        console.print(fsdp_traffic_table(fsdp))
    for note in report.notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")


def register(app: typer.Typer) -> None:
    app.command("plan", short_help="A model file's sharding plan; --auto: the best layouts.")(plan)
