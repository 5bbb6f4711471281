"""The tensor-parallel tables of ``autotp plan``: the rank grid, the plan per layer, what is left whole or
replicated and why, the totals per rank, the communication of a step against Megatron's formula, and the
sequence- and expert-parallel regions. Each takes the plan's report and returns a rich ``Table``."""
from __future__ import annotations

import math
import re

from rich.markup import escape
from rich.table import Table

from autotp.cli.fit import FitTable
from autotp.cli.plan_format import DIRECTION, data_parallel_name, fmt_count, fmt_kind, fmt_ratio, fmt_shape, fmt_size
from autotp.distributed.rank_grid import RankGrid
from autotp.reports.sharding import Report

# the first numbered path component (``transformer.h.3``) names a layer; tables draw a line between layers
_LAYER = re.compile(r"^(.*?\.\d+)(\.|$)")


def rank_grid(grid: RankGrid) -> Table:
    """One row per TP group (a (pp, dp) coordinate): the global ranks of its tp coordinates, and its node.

    TP groups never straddle a node (RankGrid checks), so a line between rows marks a node boundary.
    """
    nodes = grid.gpus_per_node is not None
    table = FitTable(title="ranks (one row per tp group)", keys=3 if grid.cp > 1 else 2)
    table.add_column("pp", justify="right", no_wrap=True)
    table.add_column("dp", justify="right", no_wrap=True)
    if grid.cp > 1:
        table.add_column("cp", justify="right", no_wrap=True)
    wide = grid.tp <= 8
    for t in range(grid.tp) if wide else ():
        table.add_column(f"tp {t}", justify="right", no_wrap=True)
    if not wide:
        table.add_column(f"tp 0..{grid.tp - 1}", justify="right", no_wrap=True)
    if nodes:
        table.add_column("node", justify="right", no_wrap=True)
    groups = [(p, d, c) for p in range(grid.pp) for d in range(grid.dp) for c in range(grid.cp)]
    for i, (p, d, c) in enumerate(groups):
        ranks = [grid.rank(t, d, p, c) for t in range(grid.tp)]
        cells = [str(r) for r in ranks] if wide else [f"{ranks[0]}–{ranks[-1]}"]
        node = grid.coords(ranks[0]).get("node")
        if i + 1 < len(groups):
            p2, d2, c2 = groups[i + 1]
            nxt = grid.coords(grid.rank(0, d2, p2, c2)).get("node")
        else:
            nxt = node
        table.add_row(str(p), str(d), *([str(c)] if grid.cp > 1 else []), *cells,
                      *([str(node)] if nodes else []), end_section=nxt != node)
    return table


def world_line(grid: RankGrid, fsdp: int = 0) -> str:
    """``world 4 = tp 2 × dp 2 · DDP × pp 1``: the grid, with the data parallelism its dp runs (``fsdp``:
    FSDP replica groups, 0 without FSDP)."""
    cp = f" × cp {grid.cp}" if grid.cp > 1 else ""
    kind = data_parallel_name(grid.dp, fsdp)
    dp = f" × dp {grid.dp}" + (f" · {kind}" if kind else "")
    line = f"world {grid.world_size} = tp {grid.tp}{cp}{dp} × pp {grid.pp}"
    if grid.gpus_per_node is not None:
        line += f", {grid.num_nodes} node(s) of {grid.gpus_per_node} GPUs (a line in the grid is a node boundary)"
    return line


# what a weight whole by design is (the plan's reason names it first): shown as its role
_WHOLE_ROLES = {"router kept whole": "router (whole)", "gate kept whole": "gate (whole)",
                "down-projection kept whole": "latent down-proj (whole)", "indexer kept whole": "indexer (whole)",
                "latent kept whole": "latent (whole)"}


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
    table = FitTable(title=f"per layer (tp {report.tp}; collectives per step for b={report.batch}, s={report.seq})")
    for col, justify in (("module", "left"), ("role", "left"), ("param", "left"), ("full", "right"),
                         ("local", "right"), ("collectives", "left")):
        table.add_column(col, justify=justify, no_wrap=justify == "right")
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
    table = FitTable(title="left replicated")
    table.add_column("what")
    table.add_column("reason")
    table.add_column("parameters", justify="right", no_wrap=True)
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
    table = FitTable(title=f"not sharded: {len(whole)} weight(s) every rank holds whole")
    for col, justify in (("parameter", "left"), ("shape", "right"), ("elements", "right"), ("reason", "left")):
        table.add_column(col, justify=justify, no_wrap=justify == "right")
    for w in whole:
        row = by_alias.get(w.name)
        shape = row.full_shape if row is not None else ()
        table.add_row(escape(w.name), fmt_shape(shape), fmt_count(math.prod(shape)) if shape else "", escape(w.reason))
    return table


def totals_table(report: Report, grid: RankGrid, ddp: bool = True, staged: bool = False) -> Table:
    """``ddp``: data parallelism all-reduces the gradients (False with --fsdp: its own tables say what moves);
    ``staged``: the pipeline's stages are shown (--pp), each holding its share of these totals."""
    m = report.memory
    table = FitTable(title="totals per tp rank", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right", no_wrap=True)
    table.add_column()
    table.add_row("parameters", fmt_count(m.local), f"of {fmt_count(m.params)} ({m.sharded:,} sharded, {m.replicated:,} replicated)")
    table.add_row("parameter bytes", fmt_size(m.bytes_per_rank), f"of {fmt_size(m.bytes_full)} unsharded")
    table.add_row("training memory (16 B/param)", fmt_size(m.train_bytes_per_rank), f"of {fmt_size(m.train_bytes_full)}")
    table.add_row("  formula 16·P_sharded/t + 16·P_replicated", fmt_size(m.formula_bytes), f"ratio {fmt_ratio(m.formula_ratio)}")
    table.add_row("  ideal 16·P/t", fmt_size(m.ideal_bytes), f"ratio {fmt_ratio(m.ideal_ratio)}")
    if grid.dp > 1 and ddp:
        table.add_row("dp gradient all-reduce / step", fmt_count(m.local),
                      f"elements over dp {grid.dp} ({fmt_size(m.local * report.act_bytes)})")
    if grid.pp > 1 and staged:
        table.add_row("pipeline", f"pp {grid.pp}", "these are the whole model's; each pipeline rank holds its "
                      "stages' share (pipeline stages below)")
    elif grid.pp > 1:
        table.add_row("pipeline", "not planned", f"numbers assume every stage holds the whole model (pp {grid.pp})")
    return table


def comm_table(report: Report) -> Table:
    t = report.tp
    table = FitTable(title=f"tp communication per training step, per rank: b={report.batch}, s={report.seq}, "
                           f"h={fmt_count(report.hidden)}, L={report.layers:g}", keys=2, breaks=(5,))
    for col in ("pass", "collective", "count", "formula", "ratio", "elements", "formula", "ratio", "bytes"):
        number = col not in ("pass", "collective")
        table.add_column(col, justify="right" if number else "left", no_wrap=number)
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


def sequence_table(the_plan, report: Report) -> Table | None:
    """Where sequence parallelism splits, gathers and slices, beyond the pairs' own collectives."""
    seq = the_plan.sequence
    if seq is None:
        return None
    table = FitTable(title="sequence parallelism: the code between the pairs holds s/t positions per rank")
    table.add_column("what")
    table.add_column("where")
    table.add_column("note")
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
    table = FitTable(title=f"expert parallelism (tokens per step b·s = {fmt_count(tokens)})")
    for col in ("layer", "experts per rank", "routed to them", "dispatch, combine"):
        table.add_column(col)
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
