"""``autotp plan MODEL_PY --tp N``: show what autotp would do to a model, without devices or process groups.

The model is built on the meta device (nothing is materialised) and captured on meta tensors in this one
process; the plan, the rank grid and the numbers of :mod:`autotp.plan.report` are printed. A file without
``example_batch()`` is planned on ``autotp.parallelize``'s default batch of token ids (sizes from ``--batch``
and ``--seq`` when given), and the output says so. ``--json`` writes them as data, ``--svg`` / ``--html`` the
same picture as the terminal shows.
"""
from __future__ import annotations

import io
import json
import math
import os
import re
from pathlib import Path
from typing import NamedTuple

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autotp.capture.tracer import stand_ins
from autotp.cli.common import EXPERT_PARALLEL, MICROBATCHES, SEQUENCE_PARALLEL, USAGE_ERROR, VIRTUAL_STAGES
from autotp.cli.plan_format import DIRECTION, fmt_count, fmt_size, fmt_ratio, fmt_kind, fmt_shape
from autotp.cli.plan_tables import (fsdp_units_table, fsdp_memory_table, fsdp_traffic_table, stages_table, ranks_table, p2p_table, schedule_table)
from autotp.cli.run import DEBUG, abort
from autotp.errors import AutotpError, PipelineError, PlanSizeError
from autotp.distributed.layout import RankLayout
from autotp.capture.modelfile import load_model_file, planning_batch
from autotp.parallel.planning import plan_model
from autotp.plan.pipeline_report import PipelineReport, PipelineSpec, pipeline_report
from autotp.plan.plan import Plan
from autotp.plan.report import FSDPReport, Report, build_report, fsdp_from_rows
from autotp.plan.stages import StageRequest
from autotp.plan.symbols import size_ranges

# the first numbered path component (``transformer.h.3``) names a layer; tables draw a line between layers
_LAYER = re.compile(r"^(.*?\.\d+)(\.|$)")


def rank_grid(layout: RankLayout) -> Table:
    """One row per TP group (a (pp, dp) coordinate): the global ranks of its tp coordinates, and its node.

    TP groups never straddle a node (RankLayout checks), so a line between rows marks a node boundary.
    """
    nodes = layout.gpus_per_node is not None
    table = Table(title="ranks (one row per tp group)")
    table.add_column("pp", justify="right")
    table.add_column("dp", justify="right")
    wide = layout.tp <= 8
    for t in range(layout.tp) if wide else ():
        table.add_column(f"tp {t}", justify="right")
    if not wide:
        table.add_column(f"tp 0..{layout.tp - 1}", justify="right")
    if nodes:
        table.add_column("node", justify="right")
    groups = [(p, d) for p in range(layout.pp) for d in range(layout.dp)]
    for i, (p, d) in enumerate(groups):
        ranks = [layout.rank(t, d, p) for t in range(layout.tp)]
        cells = [str(r) for r in ranks] if wide else [f"{ranks[0]}–{ranks[-1]}"]
        node = layout.coords(ranks[0]).get("node")
        if i + 1 < len(groups):
            nxt = layout.coords(layout.rank(0, groups[i + 1][1], groups[i + 1][0])).get("node")
        else:
            nxt = node
        table.add_row(str(p), str(d), *cells, *([str(node)] if nodes else []), end_section=nxt != node)
    return table


def world_line(layout: RankLayout) -> str:
    line = f"world {layout.world_size} = tp {layout.tp} × dp {layout.dp} × pp {layout.pp}"
    if layout.gpus_per_node is not None:
        line += f", {layout.num_nodes} node(s) of {layout.gpus_per_node} GPUs (a line in the grid is a node boundary)"
    return line


# what a weight whole by design is (the plan's reason names it first): shown as its role
_WHOLE_ROLES = {"router kept whole": "router (whole)", "gate kept whole": "gate (whole)",
                "down-projection kept whole": "latent down-proj (whole)"}


def layer_table(report: Report, names: list[str], whole: dict[str, str] | None = None) -> Table:
    """One row per module that owns parameters, in the model's order, with the collectives next to it.
    ``whole``: the plan's reasons for weights every rank holds whole (a router's names its role). A run of
    three or more consecutive layers whose rows are the same but for the layer's number is shown once, as
    ``layers.1–79``."""
    by_alias = {a: row for row in report.params for a in row.aliases}
    modules: dict[str, list[tuple[str, object]]] = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        modules.setdefault(module or "<root>", []).append((leaf, by_alias[name]))
    coll: dict[str, list] = {}
    for c in report.collectives:
        coll.setdefault(c.at, []).append(c)
    table = Table(title=f"per layer (tp {report.tp}; collectives per step for b={report.batch}, s={report.seq})")
    for col, justify in (("module", "left"), ("role", "left"), ("param", "left"), ("full", "right"),
                         ("local", "right"), ("collectives", "left")):
        table.add_column(col, justify=justify, overflow="fold")
    items = list(modules.items()) + [(m, []) for m in coll if m not in modules]
    # sections: the rows of one layer (``transformer.h.3``), or one row outside every layer
    sections: list[tuple[str | None, list[tuple[str, ...]]]] = []
    for module, params in items:
        here = _LAYER.match(module)
        layer = here.group(1) if here else None
        row = _layer_row(module, params, report, coll.get(module, []), whole or {})
        if layer is not None and sections and sections[-1][0] == layer:
            sections[-1][1].append(row)
        else:
            sections.append((layer, [row]))
    collapsed = False
    for layer, rows, last in _runs(sections):
        if last != layer:
            collapsed = True
            head = f"{layer}–{last.rpartition('.')[2]}"
            rows = [(head + r[0][len(layer):], *r[1:]) for r in rows]
        for i, r in enumerate(rows):
            table.add_row(escape(r[0]), *r[1:], end_section=layer is not None and i == len(rows) - 1)
    if collapsed:
        table.caption = "layers a–b: each of layers a to b has these rows (the same shards and collectives)"
    return table


def _layer_row(module: str, params: list, report: Report, colls: list, whole: dict[str, str]) -> tuple[str, ...]:
    """(module, role, params, full shapes, local shapes, collectives) of one module's row."""
    roles = [row.role for _, row in params if row.role != "replicated"]
    designed = [r for _, row in params for key, r in _WHOLE_ROLES.items() if whole.get(row.name, "").startswith(key)]
    role = roles[0] if roles else ("replicated" if params else "—")
    shown = designed[0] if designed and not roles else role
    if role == "experts":
        count = params[0][1].full_shape[0]
        shown = f"experts ({count // report.tp} of {count} whole per rank)"
    elif any(len(row.full_shape) == 3 and row.role != "replicated" for _, row in params):
        shown += f" ({params[0][1].full_shape[0]} experts)"
    leaves = []
    for leaf, row in params:
        tied = [a for a in row.aliases if a.rpartition(".")[0] != module]
        notes = ([row.role] if row.role != role else []) + ([f"tied to {tied[0]}"] if tied else [])
        leaves.append(escape(leaf + (f" ({', '.join(notes)})" if notes else "")))
    cs = [f"{DIRECTION.get(c.direction, c.direction)} {fmt_kind(c.kind, c.op)} {c.shape} = {fmt_count(c.elements)}"
          for c in colls]
    return (module, shown, "\n".join(leaves), "\n".join(fmt_shape(row.full_shape) for _, row in params),
            "\n".join(fmt_shape(row.local_shape) for _, row in params), escape("\n".join(cs)))


def _runs(sections: list[tuple[str | None, list[tuple[str, ...]]]]):
    """(first layer, its rows, last layer of its run) per run of three or more consecutive layers that differ
    only in their number (a tied weight's note names another layer: then they differ); other sections alone."""
    def same(a: tuple[str, list], b: tuple[str, list]) -> bool:
        return len(a[1]) == len(b[1]) and all(
            ra[0][len(a[0]):] == rb[0][len(b[0]):] and ra[1:] == rb[1:] for ra, rb in zip(a[1], b[1]))

    def follows(a: str, b: str) -> bool:
        pa, _, ia = a.rpartition(".")
        pb, _, ib = b.rpartition(".")
        return pa == pb and int(ib) == int(ia) + 1

    i = 0
    while i < len(sections):
        layer, rows = sections[i]
        j = i
        if layer is not None:
            while (j + 1 < len(sections) and sections[j + 1][0] is not None
                   and follows(sections[j][0], sections[j + 1][0]) and same(sections[i], sections[j + 1])):
                j += 1
        if j - i + 1 >= 3:
            yield layer, rows, sections[j][0]
            i = j + 1
        else:
            yield layer, rows, layer
            i += 1


def replicated_table(report: Report, replicated: tuple[tuple[str, str], ...]) -> Table:
    table = Table(title="left replicated")
    table.add_column("what", overflow="fold")
    table.add_column("reason", overflow="fold")
    table.add_column("parameters", justify="right")
    for module, reason in replicated:
        n = sum(math.prod(r.full_shape) for r in report.params if r.name.startswith(module + "."))
        table.add_row(escape(module), escape(reason), fmt_count(n))
    reasons: dict[str, list] = {}
    for r in report.params:
        if r.role == "replicated" and not any(r.name.startswith(m + ".") for m, _ in replicated):
            reasons.setdefault(r.reason, []).append(r)
    for reason, rows in reasons.items():
        table.add_row(f"{len(rows)} tensor(s), e.g. {escape(rows[0].name)}", escape(reason),
                      fmt_count(sum(math.prod(r.full_shape) for r in rows)))
    return table


def not_sharded_table(report: Report, whole) -> Table:
    """Every weight of a linear, embedding or matmul that each rank holds whole, and why: the gaps."""
    by_alias = {a: r for r in report.params for a in r.aliases}
    table = Table(title=f"not sharded: {len(whole)} weight(s) every rank holds whole")
    for col, justify in (("parameter", "left"), ("shape", "right"), ("elements", "right"), ("reason", "left")):
        table.add_column(col, justify=justify, overflow="fold")
    for w in whole:
        row = by_alias.get(w.name)
        shape = row.full_shape if row is not None else ()
        table.add_row(escape(w.name), fmt_shape(shape), fmt_count(math.prod(shape)) if shape else "", escape(w.reason))
    return table


def totals_table(report: Report, layout: RankLayout, ddp: bool = True, staged: bool = False) -> Table:
    """``ddp``: data parallelism all-reduces the gradients (False with --fsdp: its own tables say what moves);
    ``staged``: the pipeline's stages are shown (--pp), each holding its share of these totals."""
    m = report.memory
    table = Table(title="totals per tp rank", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column()
    table.add_row("parameters", fmt_count(m.local), f"of {fmt_count(m.params)} ({m.sharded:,} sharded, {m.replicated:,} replicated)")
    table.add_row("parameter bytes", fmt_size(m.bytes_per_rank), f"of {fmt_size(m.bytes_full)} unsharded")
    table.add_row("training memory (16 B/param)", fmt_size(m.train_bytes_per_rank), f"of {fmt_size(m.train_bytes_full)}")
    table.add_row("  formula 16·P_sharded/t + 16·P_replicated", fmt_size(m.formula_bytes), f"ratio {fmt_ratio(m.formula_ratio)}")
    table.add_row("  ideal 16·P/t", fmt_size(m.ideal_bytes), f"ratio {fmt_ratio(m.ideal_ratio)}")
    if layout.dp > 1 and ddp:
        table.add_row("dp gradient all-reduce / step", fmt_count(m.local),
                      f"elements over dp {layout.dp} ({fmt_size(m.local * report.act_bytes)})")
    if layout.pp > 1 and staged:
        table.add_row("pipeline", f"pp {layout.pp}", "these are the whole model's; each pipeline rank holds its "
                      "stages' share (pipeline stages below)")
    elif layout.pp > 1:
        table.add_row("pipeline", "not planned", f"numbers assume every stage holds the whole model (pp {layout.pp})")
    return table


def comm_table(report: Report) -> Table:
    t = report.tp
    table = Table(title=f"tp communication per training step, per rank: b={report.batch}, s={report.seq}, "
                        f"h={fmt_count(report.hidden)}, L={report.layers:g}")
    for col in ("pass", "collective", "count", "formula", "ratio", "elements", "formula", "ratio", "bytes"):
        table.add_column(col, justify="left" if col in ("pass", "collective") else "right")
    lines = [*report.comm, report.total()]
    for i, c in enumerate(lines):
        name = "all" if c.kind == "all" else fmt_kind(c.kind, c.op)
        direction = DIRECTION.get(c.direction, c.direction)
        table.add_row(direction, name, str(c.count), str(c.formula_count), fmt_ratio(c.count_ratio), fmt_count(c.elements),
                      fmt_count(c.formula_elements), fmt_ratio(c.elements_ratio), fmt_size(c.bytes), end_section=i == len(lines) - 2)
    terms = "; ".join(f"{x.direction} {x.count}×{x.each} ({x.what})" for x in report.formula)
    if terms and any(x.kind != "all_reduce" for x in report.formula):
        table.caption = (f"Megatron-SP formula (Korthikanti et al. 2022; README 'Sequence parallelism'): {terms}. "
                         f"A ring reduce-scatter or all-gather sends ≈ {(t - 1) / t:.2f}× the full tensor's bytes "
                         "per rank.")
    elif terms:
        ring = 2 * (t - 1) / t
        table.caption = f"Megatron formula (Shoeybi et al. 2019; README 'What a step costs'): {terms}. A ring all-reduce sends ≈ {ring:.2f}× its bytes per rank."
    return table


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Planned(NamedTuple):
    plan: Plan
    report: Report
    names: list[str]  # every parameter name of the model, in its order
    batch_note: str  # says when the default batch was used ("" otherwise)
    pipeline: PipelineReport | None = None  # with --pp > 1
    cached: Path | None = None  # the plan cache entry read or written


def make_report(model: str, tp: int, batch: int | None = None, seq: int | None = None,
                vocab_multiple: int = 1, sequence_parallel: bool = False, autocast: str | None = None,
                expert_parallel: bool = False, pipeline: PipelineSpec | None = None, cache: bool = True) -> Planned:
    """Load, build on meta, capture, plan, and compute the report; no printing. ``autocast`` ("bf16" or
    "fp16"): capture under ``torch.autocast`` as a training script runs the forward, so the collectives are
    counted in the dtypes that travel then (the parameters are CPU stand-ins for that capture: address
    space, never written). ``pipeline``: cut the blocks into its pp × v stages and report them; its
    micro-batches must divide the batch, which is checked before the capture.
    """
    mf = load_model_file(model)
    with torch.device("meta"):
        net = mf.build()
    args, kwargs, b, s, batch_note = planning_batch(mf, net, batch, seq)
    if pipeline is not None:
        from autotp.parallel.pipeline import check_pipeline  # torch.distributed.pipelining: only when asked for

        check_pipeline(pipeline.pp, pipeline.schedule, pipeline.virtual_stages, pipeline.microbatches, b)
    # a pipeline's report reads the graph itself: it is captured every time
    cached = cache and pipeline is None
    # a module-level instance was built before the meta context: capture reads it without computing
    cpu, swap, amp = torch.device("cpu"), None, None
    if autocast is not None:  # autocast acts on CPU tensors, not on meta ones
        swap = stand_ins({**dict(net.named_parameters(remove_duplicate=False)),
                          **dict(net.named_buffers(remove_duplicate=False))}, cpu)
        amp = torch.autocast("cpu", dtype=AUTOCAST[autocast])
    stages = None if pipeline is None else StageRequest(len(pipeline.ranks), pipeline.split_points)
    planned = plan_model(net, args, kwargs, [tp], cache=cached,
                         options={"vocab_multiple": vocab_multiple, "sequence_parallel": sequence_parallel,
                                  "expert_parallel": expert_parallel, "autocast": autocast},
                         vocab_multiple=vocab_multiple, sequence_parallel=sequence_parallel,
                         expert_parallel=expert_parallel, stages=stages, params=swap, device=cpu, amp=amp,
                         extra=lambda gm: {"ranges": size_ranges(gm)})
    plan, gm = planned.plans[tp], planned.gm
    report = build_report(plan, net.named_parameters(remove_duplicate=False), b, s)
    ranges = {k: tuple(v) for k, v in planned.found.extra.get("ranges", {}).items()} if gm is None \
        else size_ranges(gm)
    _check_sizes(report, ranges)
    stored = planned.path
    names = [n for n, _ in net.named_parameters(remove_duplicate=False)]
    # under autocast the blocks' activations are 16-bit, as Korthikanti et al.'s formula counts them
    pipe = None if pipeline is None else pipeline_report(gm, plan, report, pipeline,
                                                         2 if autocast is not None else None)
    return Planned(plan, report, names, batch_note, pipe, stored)


def _check_sizes(report: Report, ranges: dict[str, tuple[int, int | None]]) -> None:
    """The numbers are for --batch / --seq; refuse sizes the model's forward would reject.

    Export's lower bound of 2 is its own (it specialises 0 and 1), not the model's, so only a larger one counts.
    """
    for sym, role in report.symbols.items():
        lo, hi = ranges.get(sym, (0, None))
        value, what, flag = (report.batch, "batch", "--batch") if role == "b" else (report.seq, "sequence", "--seq")
        if (hi is not None and value > hi) or (lo > 2 and value < lo):
            bounds = f"{lo}..{hi if hi is not None else '∞'}"
            raise PlanSizeError(f"{what} size {value} is outside what the model's forward accepts ({bounds}, "
                                "found when capturing it)", hint=f"pass a {flag} in {bounds}")


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
    world_size: int | None = typer.Option(None, "--world-size", "-w", help="Total ranks; default tp × dp × pp."),
    gpus_per_node: int | None = typer.Option(None, "--gpus-per-node", help="GPUs per node: marks node boundaries."),
    batch: int | None = typer.Option(None, "--batch", help="Batch size the numbers are for (default: the "
                                     "example batch's)."),
    seq: int | None = typer.Option(None, "--seq", help="Sequence length the numbers are for."),
    vocab_multiple: int = typer.Option(1, "--vocab-multiple", help="Round each rank's vocab rows up to this."),
    sequence_parallel: bool = SEQUENCE_PARALLEL,
    expert_parallel: bool = EXPERT_PARALLEL,
    fsdp: bool = typer.Option(False, "--fsdp", help="Shard each tp rank's parameters, gradients and optimizer "
                              "state over the --dp ranks (FSDP2): show its units, memory and traffic."),
    autocast: str | None = typer.Option(None, "--autocast", help="bf16 or fp16: count the collectives' bytes "
                                        "as a forward under torch.autocast moves them."),
    json_out: Path | None = typer.Option(None, "--json", help="Write plan, layout and report as JSON here."),
    svg: Path | None = typer.Option(None, "--svg", help="Write the printed tables as an SVG picture here."),
    html: Path | None = typer.Option(None, "--html", help="Write the printed tables as HTML here."),
    auto: bool = typer.Option(False, "--auto", help="Choose the layout: price every tp × dp × pp (FSDP, "
                              "sequence parallelism, virtual stages, micro-batches, recomputation) for "
                              "--world-size devices and show the best; needs --world-size."),
    gpu: str | None = typer.Option(None, "--gpu", help="With --auto: a100, h100 (datasheet presets) or a "
                                   "profile written by `autotp profile` (default ./autotp-profile.json)."),
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
    if auto:
        return _plan_auto(model, tp, dp, pp, world_size, gpus_per_node, gpu, batch, seq, global_batch, autocast,
                          top, json_out, debug)
    if tp is None:
        abort("give --tp N, or --auto to choose the layout", debug, code=USAGE_ERROR)

    for name, value in (("--batch", batch), ("--seq", seq), ("--vocab-multiple", vocab_multiple)):
        if value is not None and value < 1:
            abort(f"{name} must be >= 1, got {value}", debug, code=USAGE_ERROR)
    try:
        world = world_size if world_size is not None else tp * (dp or 1) * pp
        layout = RankLayout.build(world, tp, pp=pp, dp=dp, gpus_per_node=gpus_per_node)
    except (ValueError, TypeError) as exc:
        abort(str(exc), debug, code=USAGE_ERROR)
    if fsdp and layout.dp < 2:
        abort(f"--fsdp shards over the data-parallel ranks: it needs --dp 2 or more (dp is {layout.dp})", debug,
              code=USAGE_ERROR)
    if autocast is not None and autocast not in AUTOCAST:
        abort(f"--autocast must be one of {', '.join(AUTOCAST)}, got {autocast}", debug, code=USAGE_ERROR)
    spec = _pipeline_spec(pp, schedule, virtual_stages, microbatches, split_points, batch, debug,
                          fsdp=fsdp, sequence_parallel=sequence_parallel, expert_parallel=expert_parallel)
    try:
        the_plan, report, names, batch_note, pipe, cached = make_report(
            model, tp, batch, seq, vocab_multiple, sequence_parallel, autocast, expert_parallel, spec, cache)
    except PipelineError as exc:  # micro-batches the batch does not divide, more stages than blocks, split points
        abort(_as_flags(str(exc)), debug, code=USAGE_ERROR)
    except (AutotpError, ValueError) as exc:  # a ValueError of the plan names the sizes (experts tp does not divide)  # model file, capture and sharding problems: the user's to fix
        abort(str(exc), debug, code=USAGE_ERROR)
    fsdp_info = None
    if fsdp:
        from autotp.parallel.fsdp import check_fsdp_plan  # torch.distributed.fsdp: imported only when asked for

        try:  # what autotp.parallelize(fsdp=True) would refuse for this plan
            check_fsdp_plan(the_plan, tp)
        except AutotpError as exc:
            abort(str(exc), debug, code=USAGE_ERROR)
        fsdp_info = fsdp_from_rows(the_plan, report.params, layout.dp)

    console = _console()
    render(console, model, the_plan, report, layout, names, batch_note, fsdp_info, pipe)
    if cached is not None:
        Console(stderr=True).print(f"[dim]plan cache: {escape(str(cached))} (--no-cache plans again)[/dim]",
                                   soft_wrap=True)
    if json_out is not None:
        data = {"plan": the_plan.to_dict(), "layout": layout.groups(),
                "world": {k: v for k, v in layout.to_dict().items() if k != "groups"},
                "report": report.to_dict()}
        if fsdp_info is not None:
            data["fsdp"] = fsdp_info.to_dict()
        if pipe is not None:
            data["pipeline"] = pipe.to_dict()
        json_out.write_text(json.dumps(data, indent=2))
    if svg is not None or html is not None:
        # drawn again, off screen and at least 160 columns wide, so a file does not inherit a narrow
        # (or absent, under a pipe) terminal's wrapping
        pic = Console(record=True, file=io.StringIO(), width=max(console.width, 160), force_terminal=True)
        render(pic, model, the_plan, report, layout, names, batch_note, fsdp_info, pipe)
        if svg is not None:  # save_svg clears the recording unless told not to; keep it for the html
            pic.save_svg(str(svg), title=f"autotp plan {model}", clear=html is None)
        if html is not None:
            pic.save_html(str(html))


def _plan_auto(model: str, tp: int | None, dp: int | None, pp: int, world_size: int | None,
               gpus_per_node: int | None, gpu: str | None, batch: int | None, seq: int | None,
               global_batch: int | None, autocast: str | None, top: int, json_out: Path | None, debug: bool) -> None:
    from autotp.cli import plan_auto  # the cost model: only when asked for

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


def _pipeline_spec(pp: int, schedule: str | None, virtual_stages: int | None, microbatches: int | None,
                   split_points: str | None, batch: int | None, debug: bool, *, fsdp: bool,
                   sequence_parallel: bool, expert_parallel: bool) -> PipelineSpec | None:
    """The checked pipeline options (None without --pp > 1), or exit 2 before anything is captured; the
    micro-batches are checked against the example's batch once it is known (make_report)."""
    given = [flag for flag, value in (("--schedule", schedule), ("--virtual-stages", virtual_stages),
                                      ("--microbatches", microbatches), ("--split-points", split_points))
             if value is not None]
    if pp == 1:
        if given:
            abort(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to pipeline stages: give --pp 2 "
                  "or more", debug, code=USAGE_ERROR)
        return None
    # what autotp.pipeline runs its stages with: plain tensor parallelism, data parallelism by DDP
    used = [f for f, on in (("--fsdp", fsdp), ("--sequence-parallel", sequence_parallel),
                            ("--expert-parallel", expert_parallel)) if on]
    if used:
        abort(f"--pp with {', '.join(used)} is not supported yet", debug, code=USAGE_ERROR)
    from autotp.parallel.pipeline import SCHEDULES, check_pipeline, stage_ranks  # torch.distributed.pipelining

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
    """Rich falls back to 80 columns when stdout is no terminal, which folds the tables' numbers: a pipe or
    file gets 160 unless COLUMNS says otherwise."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=160)
    return console


def sequence_table(the_plan, report: Report) -> Table | None:
    """Where sequence parallelism splits, gathers and slices, beyond the pairs' own collectives."""
    seq = the_plan.sequence
    if seq is None:
        return None
    table = Table(title="sequence parallelism: regions between the pairs hold s/t positions per rank")
    table.add_column("what", overflow="fold")
    table.add_column("where", overflow="fold")
    table.add_column("note", overflow="fold")
    by_node = {(c.direction, c.kind, c.node): c for c in report.collectives}
    for e in seq.enters:
        c = by_node.get(("forward", "all_gather", e.node))
        table.add_row("all-gather → columns", escape(f"{e.module} ({e.node})"),
                      (f"{c.shape} = {fmt_count(c.elements)}; " if c else "") + "reduce-scatter backward"
                      + ("; only s/t kept, gathered again backward" if e.regather else ""))
    for x in seq.leaves:
        c = by_node.get(("forward", "reduce_scatter", x.node))
        table.add_row("reduce-scatter", escape(f"{x.module} ({x.node})"),
                      (f"{c.shape} = {fmt_count(c.elements)}; " if c else "") + "all-gather backward")
    for g in seq.gathers:
        c = by_node.get(("forward", "all_gather", g.value))
        table.add_row("all-gather → whole sequence", escape(f"{g.value} for {', '.join(g.consumers)}"),
                      escape(g.reason + (f"; {c.shape} = {fmt_count(c.elements)}" if c else "")))
    for x in seq.slices:
        table.add_row("slice (no communication)", escape(f"{x.value} at {x.consumer}, dim {x.dim}"),
                      "all-gather of its gradient backward" if x.grad else "")
    if seq.grads:
        table.add_row("gradient all-reduce", f"{len(dict.fromkeys(p for _, p in seq.grads))} parameters",
                      "norm weights and row biases see s/t positions: one all-reduce of all their gradients")
    for note in seq.notes:
        table.add_row("plain tensor parallelism", "", escape(note))
    return table


def experts_table(the_plan, report: Report) -> Table | None:
    """Expert parallelism: each layer's experts per rank, and what an all-to-all dispatch would move instead of
    nothing (the tokens are on every rank of the group already)."""
    if not the_plan.experts and not the_plan.experts_kept:
        return None
    tokens = report.batch * report.seq
    table = Table(title=f"expert parallelism (tokens per step b·s = {fmt_count(tokens)})")
    for col in ("layer", "experts per rank", "routed to them", "dispatch, combine"):
        table.add_column(col, overflow="fold")
    for x in the_plan.experts:
        slots = f"b·s·k = {fmt_count(tokens * x.top_k)} token slots" if x.top_k else "the tokens the routing picks"
        a2a = (f"none: every rank holds the tokens (an all-to-all would send b·s·k·h = {fmt_count(tokens * x.top_k * x.width)} "
               "elements each way); combined by the layer's one all-reduce" if x.top_k and x.width else
               "none: every rank holds the tokens; combined by the layer's one all-reduce")
        table.add_row(escape(x.module), f"{x.count // report.tp} of {x.count} (rank r: [r·{x.count // report.tp}, "
                      f"(r+1)·{x.count // report.tp}))", slots + f", ~1/{report.tp} on each rank", a2a)
    for module, reason in the_plan.experts_kept:
        table.add_row(escape(module), "1/tp of every expert", "", escape("expert tensor parallelism kept: " + reason))
    return table


def render(console: Console, model: str, the_plan, report: Report, layout: RankLayout, names: list[str],
           batch_note: str = "", fsdp: FSDPReport | None = None, pipe: PipelineReport | None = None) -> None:
    sp = ", sequence parallel" if the_plan.sequence is not None and the_plan.sequence.leaves else ""
    console.print(f"[bold]{escape(model)}[/bold]: tp {report.tp}{sp}, {len(the_plan.pairs)} column→row pairs, "
                  f"{len(the_plan.collectives)} collectives per step; {world_line(layout)}")
    if batch_note:
        console.print(f"[yellow]note:[/yellow] {escape(batch_note)}")
    console.print(rank_grid(layout))
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
    console.print(totals_table(report, layout, ddp=fsdp is None, staged=pipe is not None))
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


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
