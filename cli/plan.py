"""``autotp plan MODEL_PY --tp N``: show what autotp would do to a model, without devices or process groups.

The model is built on the meta device (nothing is materialised) and captured on meta tensors in this one
process; the plan, the rank grid and the numbers of :mod:`autotp.plan.report` are printed. A file without
``example_batch()`` is planned on ``autotp.parallelize``'s default batch of token ids (sizes from ``--batch``
and ``--seq`` when given), and the output says so. ``--json`` writes them as data, ``--svg`` / ``--html`` the
same picture as the terminal shows.
"""
from __future__ import annotations

import contextlib
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

from autotp.capture.tracer import capture, stand_ins
from autotp.cli.common import USAGE_ERROR
from autotp.cli.run import DEBUG, abort
from autotp.errors import AutotpError, PipelineError, PlanSizeError
from autotp.distributed.layout import RankLayout
from autotp.capture.modelfile import DEFAULT_BATCH_SHAPE, ModelFile, ModelFileError, default_example, load_model_file
from autotp.plan.pipeline_report import PipelineReport, PipelineSpec, pipeline_report
from autotp.plan.plan import Plan
from autotp.plan.planner import make_plan
from autotp.plan.report import FSDPReport, FSDPUnitRow, Report, build_report, fsdp_from_rows
from autotp.plan.stages import StageRequest
from autotp.plan.symbols import size_ranges

_DIR = {"forward": "fwd", "backward": "bwd"}
# the first numbered path component (``transformer.h.3``) names a layer; tables draw a line between layers
_LAYER = re.compile(r"^(.*?\.\d+)(\.|$)")


def _n(x: int | None) -> str:
    return "?" if x is None else f"{x:,}"


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _r(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _kind(kind: str, op: str) -> str:
    """``all-reduce(sum)``, ``reduce-scatter(sum)``, ``all-gather``."""
    return kind.replace("_", "-") + (f"({op})" if op else "")


def _shape(s: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]"


# -- the tables ----------------------------------------------------------------------------------------
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
    ``whole``: the plan's reasons for weights every rank holds whole (a router's names its role)."""
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
    for i, (module, params) in enumerate(items):
        roles = [row.role for _, row in params if row.role != "replicated"]
        designed = [r for _, row in params for key, r in _WHOLE_ROLES.items()
                    if (whole or {}).get(row.name, "").startswith(key)]
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
        cs = [f"{_DIR.get(c.direction, c.direction)} {_kind(c.kind, c.op)} {c.shape} = {_n(c.elements)}"
              for c in coll.get(module, [])]
        nxt = _LAYER.match(items[i + 1][0]) if i + 1 < len(items) else None
        here = _LAYER.match(module)
        table.add_row(escape(module), shown, "\n".join(leaves),
                      "\n".join(_shape(row.full_shape) for _, row in params),
                      "\n".join(_shape(row.local_shape) for _, row in params),
                      escape("\n".join(cs)),
                      end_section=bool(here and nxt and here.group(1) != nxt.group(1)))
    return table


def replicated_table(report: Report, replicated: tuple[tuple[str, str], ...]) -> Table:
    table = Table(title="left replicated")
    table.add_column("what", overflow="fold")
    table.add_column("reason", overflow="fold")
    table.add_column("parameters", justify="right")
    for module, reason in replicated:
        n = sum(math.prod(r.full_shape) for r in report.params if r.name.startswith(module + "."))
        table.add_row(escape(module), escape(reason), _n(n))
    reasons: dict[str, list] = {}
    for r in report.params:
        if r.role == "replicated" and not any(r.name.startswith(m + ".") for m, _ in replicated):
            reasons.setdefault(r.reason, []).append(r)
    for reason, rows in reasons.items():
        table.add_row(f"{len(rows)} tensor(s), e.g. {escape(rows[0].name)}", escape(reason),
                      _n(sum(math.prod(r.full_shape) for r in rows)))
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
        table.add_row(escape(w.name), _shape(shape), _n(math.prod(shape)) if shape else "", escape(w.reason))
    return table


def totals_table(report: Report, layout: RankLayout, ddp: bool = True, staged: bool = False) -> Table:
    """``ddp``: data parallelism all-reduces the gradients (False with --fsdp: its own tables say what moves);
    ``staged``: the pipeline's stages are shown (--pp), each holding its share of these totals."""
    m = report.memory
    table = Table(title="totals per tp rank", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column()
    table.add_row("parameters", _n(m.local), f"of {_n(m.params)} ({m.sharded:,} sharded, {m.replicated:,} replicated)")
    table.add_row("parameter bytes", _size(m.bytes_per_rank), f"of {_size(m.bytes_full)} unsharded")
    table.add_row("training memory (16 B/param)", _size(m.train_bytes_per_rank), f"of {_size(m.train_bytes_full)}")
    table.add_row("  formula 16·P_sharded/t + 16·P_replicated", _size(m.formula_bytes), f"ratio {_r(m.formula_ratio)}")
    table.add_row("  ideal 16·P/t", _size(m.ideal_bytes), f"ratio {_r(m.ideal_ratio)}")
    if layout.dp > 1 and ddp:
        table.add_row("dp gradient all-reduce / step", _n(m.local),
                      f"elements over dp {layout.dp} ({_size(m.local * report.act_bytes)})")
    if layout.pp > 1 and staged:
        table.add_row("pipeline", f"pp {layout.pp}", "these are the whole model's; each pipeline rank holds its "
                      "stages' share (pipeline stages below)")
    elif layout.pp > 1:
        table.add_row("pipeline", "not planned", f"numbers assume every stage holds the whole model (pp {layout.pp})")
    return table


def comm_table(report: Report) -> Table:
    t = report.tp
    table = Table(title=f"tp communication per training step, per rank: b={report.batch}, s={report.seq}, "
                        f"h={_n(report.hidden)}, L={report.layers:g}")
    for col in ("pass", "collective", "count", "formula", "ratio", "elements", "formula", "ratio", "bytes"):
        table.add_column(col, justify="left" if col in ("pass", "collective") else "right")
    lines = [*report.comm, report.total()]
    for i, c in enumerate(lines):
        name = "all" if c.kind == "all" else _kind(c.kind, c.op)
        direction = _DIR.get(c.direction, c.direction)
        table.add_row(direction, name, str(c.count), str(c.formula_count), _r(c.count_ratio), _n(c.elements),
                      _n(c.formula_elements), _r(c.elements_ratio), _size(c.bytes), end_section=i == len(lines) - 2)
    terms = "; ".join(f"{x.direction} {x.count}×{x.each} ({x.what})" for x in report.formula)
    if terms and any(x.kind != "all_reduce" for x in report.formula):
        table.caption = (f"Megatron-SP formula (Korthikanti et al. 2022; README 'Sequence parallelism'): {terms}. "
                         f"A ring reduce-scatter or all-gather sends ≈ {(t - 1) / t:.2f}× the full tensor's bytes "
                         "per rank.")
    elif terms:
        ring = 2 * (t - 1) / t
        table.caption = f"Megatron formula (Shoeybi et al. 2019; README 'What a step costs'): {terms}. A ring all-reduce sends ≈ {ring:.2f}× its bytes per rank."
    return table


def _unit_name(u: FSDPUnitRow) -> str:
    return "what no unit owns" if u.kind == "root" else escape(" + ".join(u.modules or (u.module,)))


_KEEPS = {"first": "fwd, bwd", "block": "fwd, bwd", "last": "fwd, kept", "root": "fwd, kept"}


def fsdp_units_table(fsdp: FSDPReport) -> Table:
    """One row per FSDP unit, in the order they run: first (embeddings), the blocks, last (final norm, LM
    head), then the root."""
    table = Table(title=f"fsdp units: each tp rank's shards cut again over dp {fsdp.dp} (tp {fsdp.tp})")
    for col, justify in (("kind", "left"), ("unit", "left"), ("gathered in", "left"), ("tensors", "right"),
                         ("parameters", "right"), ("per tp rank", "right"), ("gathered / rank", "right"),
                         ("sharded / rank", "right")):
        table.add_column(col, justify=justify, overflow="fold")
    for i, u in enumerate(fsdp.units):
        table.add_row(u.kind, _unit_name(u), _KEEPS.get(u.kind, ""), str(u.tensors), _n(u.params), _n(u.local),
                      _size(u.gathered_bytes), _size(u.sharded_bytes), end_section=i == len(fsdp.units) - 1)
    us = fsdp.units
    table.add_row("all", "", "", str(sum(u.tensors for u in us)), _n(sum(u.params for u in us)),
                  _n(sum(u.local for u in us)), _size(sum(u.gathered_bytes for u in us)),
                  _size(sum(u.sharded_bytes for u in us)))
    table.caption = ("first: the modules read only before the blocks; last: only after them; root: what no unit "
                     "owns (a tied embedding / LM head). gathered in: fwd, bwd = freed after forward and gathered "
                     "again for backward; fwd, kept = kept from forward into backward. gathered: the unit's tp "
                     "shards whole, as an all-gather over dp leaves them; sharded: what a rank keeps between "
                     "gathers (dim 0 of each shard in d pieces, FSDP's padding included)")
    return table


def fsdp_memory_table(fsdp: FSDPReport) -> Table:
    """FSDP's training memory per rank, term by term, against plain data parallelism's."""
    t, d = fsdp.tp, fsdp.dp
    table = Table(title=f"training memory per rank with fsdp (16 B/param, tp {t} × dp {d}, "
                        "resharded after forward)", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column()
    table.add_row("  state 16·(P/t)/d", _size(fsdp.state_bytes),
                  f"weights, gradients, Adam: 16 × {_n(fsdp.local)} elements per tp rank / {d}")
    kept = {u.kind for u in fsdp.kept}
    if kept:
        what = ("root and last unit gathered, kept until their backward" if kept == {"root", "last"} else
                f"{'root' if 'root' in kept else 'last unit'} gathered, kept until its backward")
        table.add_row("  kept gathered", _size(fsdp.kept_bytes), what)
    resharded = fsdp.resharded
    sizes = [u.gathered_bytes for u in resharded]
    if len(resharded) > 1:
        i = max(range(len(sizes) - 1), key=lambda j: sizes[j] + sizes[j + 1])
        pair = f"{_unit_name(resharded[i])} + {_unit_name(resharded[i + 1])}"
        table.add_row("  units gathered", _size(fsdp.prefetch_bytes),
                      f"the running unit and the prefetched next one (largest pair: {pair})")
    elif resharded:
        table.add_row("  units gathered", _size(fsdp.prefetch_bytes), "the one resharded unit, while it runs")
    table.add_row("fsdp per rank", _size(fsdp.peak_bytes),
                  "+ activations (not estimated here) + gradients awaiting their reduce-scatter", end_section=True)
    table.add_row("ddp per rank 16·P/t", _size(fsdp.ddp_bytes),
                  f"fsdp holds {_r(fsdp.saving)}× less" if fsdp.saving else "")
    return table


def fsdp_traffic_table(fsdp: FSDPReport) -> Table:
    d = fsdp.dp
    table = Table(title=f"fsdp communication per training step, per rank, over dp {d}")
    for col in ("pass", "collective", "count", "what", "bytes", "ring sends"):
        table.add_column(col, justify="left" if col in ("pass", "collective", "what") else "right")
    lines = fsdp.traffic
    for i, x in enumerate(lines):
        table.add_row(_DIR.get(x.direction, x.direction), _kind(x.kind, "sum" if x.kind == "reduce_scatter" else ""),
                      str(x.count), x.what, _size(x.bytes), _size(x.sent), end_section=i == len(lines) - 1)
    table.add_row("all", "all", str(sum(x.count for x in lines)), "", _size(sum(x.bytes for x in lines)),
                  _size(sum(x.sent for x in lines)))
    table.caption = ("bytes: the units' tp shards whole, in the parameters' dtypes (no fsdp mixed precision); "
                     f"a ring all-gather or reduce-scatter sends ≈ (d−1)/d = {(d - 1) / d:.2f}× them per rank. "
                     "Replaces data parallelism's gradient all-reduce.")
    return table


# -- pipeline stages (--pp) ------------------------------------------------------------------------------
def _blocks(blocks: tuple[str, ...]) -> str:
    """``transformer.h.0 … transformer.h.3 (4)``."""
    if len(blocks) == 1:
        return f"{blocks[0]} (1)"
    return f"{blocks[0]} … {blocks[-1]} ({len(blocks)})"


def _flops(n: int) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:,} FLOP"


def _in_flight_rule(pipe: PipelineReport) -> str:
    """The micro-batches a rank keeps, in words, for the caption (autotp.plan.pipeline_report.in_flight)."""
    p, v, m = pipe.pp, pipe.virtual_stages, pipe.microbatches
    return {
        "GPipe": f"GPipe keeps every micro-batch: m = {m}",
        "1F1B": "1F1B keeps min(m, p − r) on pipeline rank r",
        "Interleaved1F1B": "Interleaved1F1B keeps min(v·m, (v − 1)·m_round + 2·(p − 1 − r) + 1) stage-micro-batches "
                           "on rank r (torch's warm-up; Narayanan et al. 2021 §2.2, Korthikanti et al. §4.2.3: "
                           "L·(1 + (p − 1)/(v·p)) layers' worth on rank 0)",
        "InterleavedZeroBubble": "InterleavedZeroBubble keeps min(v·m, (v − 1)·m_round + (p − 1 − r) + 1) "
                                 "stage-micro-batches on rank r (torch's warm-up)",
        "LoopedBFS": f"LoopedBFS runs every micro-batch through a stage before the next: v·m = {v * m}",
        "ZBVZeroBubble": f"ZBVZeroBubble keeps 2·p = {2 * p} stage-micro-batches on every rank (torch's warm-up)",
    }[pipe.schedule]


def stages_table(pipe: PipelineReport) -> Table:
    """One row per pipeline stage: where it runs, its blocks, what it holds and computes per micro-batch."""
    one = pipe.virtual_stages == 1
    a = pipe.activations
    table = Table(title=f"pipeline stages: pp {pipe.pp} × v {pipe.virtual_stages}, {pipe.schedule}, "
                        f"{pipe.microbatches} micro-batches of b={pipe.micro_batch}, s={pipe.seq}, tp {pipe.tp}")
    cols = ["stage", "pp rank", "blocks", "also runs", "params", "bytes", "fwd FLOPs", "activations"]
    if one:
        cols += ["in flight", "act. on rank"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("blocks", "also runs") else "right", overflow="fold")
    for st in pipe.stages:
        also = [w for w, on in (("embeddings", st.first),
                                ("final norm, LM head, loss", st.last)) if on]
        cells = [str(st.index), str(st.rank), escape(_blocks(st.blocks)), "\n".join(also) or "—", _n(st.params),
                 _size(st.param_bytes), _flops(st.flops), _size(st.activation_bytes)]
        if one:
            r = pipe.ranks[st.rank]
            cells += [str(r.in_flight), _size(r.activation_bytes)]
        table.add_row(*cells, end_section=st.index == len(pipe.stages) - 1)
    stages = pipe.stages
    total = ["all", "", f"{sum(len(st.blocks) for st in stages)} blocks", "", _n(sum(st.params for st in stages)),
             _size(sum(st.param_bytes for st in stages)), _flops(sum(st.flops for st in stages)),
             _size(sum(st.activation_bytes for st in stages))]
    table.add_row(*total, *(["", ""] if one else []))
    formula = (f"{a.layer_bytes:,} B per block = s·b·h·({4 * a.elem + 2 * a.dropout} + {12 * a.elem}/t)"
               + ("" if a.fused or a.heads is None else f" + {a.elem + a.dropout * (1 + a.elem)}·a·s²·b/t")
               + f" at h={_n(a.hidden)}" + (f", a={a.heads}" if a.heads and not a.fused else ""))
    table.caption = escape(
        "params, bytes: what one tp rank of the stage holds" + (
            f" ({', '.join(pipe.shared)} in every stage that reads it, so the column adds up to more than the model)"
            if pipe.shared else "") + ". fwd FLOPs: matmuls and attention of one micro-batch through the whole "
        "stage, each tp rank doing ≈ 1/t. activations: one micro-batch's, per tp rank, the blocks' own (Korthikanti et al. 2022, DESIGN §4, GPT block with a "
        f"4h MLP; {a.elem}-byte activations, {'1-byte dropout masks' if a.dropout else 'no dropout'}, "
        f"{'fused attention: no s×s scores' if a.fused else 's×s scores kept'}): {formula}; embeddings, LM head "
        f"and loss not counted." + (f" Assumed in flight: {_in_flight_rule(pipe)}." if one else ""))
    return table


def ranks_table(pipe: PipelineReport) -> Table:
    """With several stages per rank: what each pipeline rank keeps at its peak."""
    table = Table(title=f"pipeline ranks: {pipe.virtual_stages} stages each; per tp rank, activations at the peak")
    for col in ("pp rank", "stages", "blocks", "params", "bytes", "in flight", "act. on rank"):
        table.add_column(col, justify="left" if col in ("stages",) else "right")
    for r in pipe.ranks:
        blocks = sum(len(pipe.stages[s].blocks) for s in r.stages)
        table.add_row(str(r.rank), ", ".join(map(str, r.stages)), str(blocks), _n(r.params), _size(r.param_bytes),
                      str(r.in_flight), _size(r.activation_bytes))
    table.caption = ("params: every tensor its stages read, once. in flight: (stage, micro-batch) pairs whose "
                     f"activations the rank holds at once, each at its stages' mean size. {_in_flight_rule(pipe)}.")
    return table


def p2p_table(pipe: PipelineReport) -> Table:
    """What crosses each cut per micro-batch: sent forward, its gradient sent back."""
    table = Table(title=f"pipeline point-to-point per micro-batch (b={pipe.micro_batch}, s={pipe.seq}), "
                        "each tp rank to its peer")
    for col in ("cut", "pp ranks", "value", "computed by", "shape", "dtype", "fwd bytes", "bwd bytes"):
        table.add_column(col, justify="right" if col in ("shape", "fwd bytes", "bwd bytes") else "left",
                         overflow="fold")
    for c in pipe.cuts:
        where = f"{c.src} → {c.dst}" if c.sent else f"{c.src} (same rank: not sent)"
        for i, x in enumerate(c.values):
            by = ": ".join(w for w in (x.module or "<root>", x.code) if w)
            table.add_row(f"{c.after} → {c.after + 1}" if i == 0 else "", where if i == 0 else "", escape(x.name),
                          escape(by), _shape(x.shape), x.dtype, _size(x.bytes if c.sent else 0),
                          _size(x.bytes if c.sent and x.grad else 0), end_section=i == len(c.values) - 1)
        if not c.values:
            table.add_row(f"{c.after} → {c.after + 1}", where, "nothing", "", "", "", _size(0), _size(0),
                          end_section=True)
    m, sent = pipe.microbatches, sum(c.sent for c in pipe.cuts)
    table.add_row("per micro-batch", f"{sent} cut{'s' if sent != 1 else ''}", "", "", "", "",
                  _size(pipe.forward_bytes), _size(pipe.backward_bytes))
    table.add_row(f"per step (× m = {m})", "", "", "", "", "", _size(m * pipe.forward_bytes),
                  _size(m * pipe.backward_bytes))
    table.caption = (
        "values computed before a cut and read after it, as autotp.pipeline sends them (the graph's inputs reach "
        "every stage locally; parameters and buffers are read where they are used). bwd: the gradients of the "
        "floating-point values computed from parameters. Per step: every micro-batch over every cut"
        + (f"; {pipe.virtual_stages} stages per rank make p·v − 1 = {len(pipe.cuts)} cuts (p − 1 = {pipe.pp - 1} "
           f"with one stage per rank: about v× the traffic)" if pipe.virtual_stages > 1 else "")
        + f": {_size(pipe.step_bytes)} both ways.")
    return table


def schedule_table(pipe: PipelineReport) -> Table:
    """The schedule, its sizes and its bubble."""
    p, v, m, bub = pipe.pp, pipe.virtual_stages, pipe.microbatches, pipe.bubble
    table = Table(title=f"pipeline schedule {pipe.schedule}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column()
    table.add_row("stages", str(p * v), f"p {p} × v {v}; pipeline rank of stage 0, 1, …: "
                  + ", ".join(str(st.rank) for st in pipe.stages))
    table.add_row("micro-batches", str(m), f"of b/m = {pipe.micro_batch} sequences each")
    values = f"({p} − 1)/{m}" if bub.formula == "(p − 1)/m" else f"({p} − 1)/({v}·{m})"
    note = "; an upper bound: the schedule fills most of it with weight-gradient work" if bub.upper_bound else ""
    table.add_row("bubble", f"{bub.fraction:.2f}", f"{bub.formula} = {values} of the ideal step time (a step ≈ "
                  f"{1 + bub.fraction:.2f}× the ideal){note}")
    table.caption = "Narayanan et al. 2021, §2.2: GPipe/1F1B (p − 1)/m, interleaved (p − 1)/(v·m)."
    return table


# -- building ------------------------------------------------------------------------------------------
def _batch(mf: ModelFile, net: torch.nn.Module, batch: int | None,
           seq: int | None) -> tuple[tuple, dict, int, int, str]:
    """The capture's inputs, the (b, s) the numbers are computed for, and a note when the default batch stands
    in for a missing example_batch()."""
    if mf.batch_fn is None:
        # autotp.parallelize's own default (use_cache=False included), at --batch / --seq when given; real (tiny)
        # ids, not meta: capture turns them into meta itself, and may need real ones
        b = batch if batch is not None else DEFAULT_BATCH_SHAPE[0]
        s = seq if seq is not None else DEFAULT_BATCH_SHAPE[1]
        args, kwargs = default_example(net.forward, shape=(b, s))
        sizes = " (sizes from --batch/--seq)" if batch is not None or seq is not None else ""
        return args, kwargs, b, s, (f"{mf.path} defines no example_batch(): planned on the default batch, "
                                    f"({b}, {s}) token ids{sizes}, as autotp.parallelize without example_inputs")
    args, kwargs = mf.example_batch()
    first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.dim() >= 2), None)
    if first is None and (batch is None or seq is None):
        raise ModelFileError(f"example_batch() in {mf.path} has no tensor of at least 2 dims (batch, sequence)",
                             hint="pass --batch B --seq S")
    b = batch if batch is not None else first.shape[0]
    s = seq if seq is not None else first.shape[1]
    return args, kwargs, int(b), int(s), ""


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Planned(NamedTuple):
    plan: Plan
    report: Report
    names: list[str]  # every parameter name of the model, in its order
    batch_note: str  # says when the default batch was used ("" otherwise)
    pipeline: PipelineReport | None = None  # with --pp > 1


def make_report(model: str, tp: int, batch: int | None = None, seq: int | None = None,
                vocab_multiple: int = 1, sequence_parallel: bool = False, autocast: str | None = None,
                expert_parallel: bool = False, pipeline: PipelineSpec | None = None) -> Planned:
    """Load, build on meta, capture, plan, and compute the report; no printing. ``autocast`` ("bf16" or
    "fp16"): capture under ``torch.autocast`` as a training script runs the forward, so the collectives are
    counted in the dtypes that travel then (the parameters are CPU stand-ins for that capture: address
    space, never written). ``pipeline``: cut the blocks into its pp × v stages and report them; its
    micro-batches must divide the batch, which is checked before the capture.
    """
    mf = load_model_file(model)
    with torch.device("meta"):
        net = mf.build()
    args, kwargs, b, s, batch_note = _batch(mf, net, batch, seq)
    if pipeline is not None:
        from autotp.parallel.pipeline import check_pipeline  # torch.distributed.pipelining: only when asked for

        check_pipeline(pipeline.pp, pipeline.schedule, pipeline.virtual_stages, pipeline.microbatches, b)
    # a module-level instance was built before the meta context: capture reads it without computing
    cpu, swap, amp = torch.device("cpu"), None, contextlib.nullcontext()
    if autocast is not None:  # autocast acts on CPU tensors, not on meta ones
        swap = stand_ins({**dict(net.named_parameters(remove_duplicate=False)),
                          **dict(net.named_buffers(remove_duplicate=False))}, cpu)
        amp = torch.autocast("cpu", dtype=AUTOCAST[autocast])
    with amp:
        gm, _ = capture(net, args, kwargs, params=swap, device=cpu)
    stages = None if pipeline is None else StageRequest(len(pipeline.ranks), pipeline.split_points)
    plan = make_plan(gm, tp, vocab_multiple, sequence_parallel=sequence_parallel, expert_parallel=expert_parallel,
                     stages=stages)
    report = build_report(plan, net.named_parameters(remove_duplicate=False), b, s)
    _check_sizes(report, size_ranges(gm))
    names = [n for n, _ in net.named_parameters(remove_duplicate=False)]
    # under autocast the blocks' activations are 16-bit, as Korthikanti et al.'s formula counts them
    pipe = None if pipeline is None else pipeline_report(gm, plan, report, pipeline,
                                                         2 if autocast is not None else None)
    return Planned(plan, report, names, batch_note, pipe)


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
    tp: int = typer.Option(..., "--tp", help="Tensor-parallel size."),
    dp: int | None = typer.Option(None, "--dp", help="Data-parallel size; default world / (tp × pp), or 1."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel size: cut the blocks into pipeline stages and "
                           "show each stage, what crosses each cut and the bubble."),
    virtual_stages: int | None = typer.Option(None, "--virtual-stages", help="With --pp: stages per rank "
                                              "(default 1; 2 for the interleaved and V schedules)."),
    schedule: str | None = typer.Option(None, "--schedule", help="With --pp: the pipeline schedule (GPipe, 1F1B, "
                                        "Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble; "
                                        "default 1F1B)."),
    microbatches: int | None = typer.Option(None, "--microbatches", help="With --pp: micro-batches per step "
                                            "(default: pp); they must divide the batch."),
    split_points: str | None = typer.Option(None, "--split-points", metavar="BLOCK,BLOCK,...",
                                            help="With --pp: the blocks that start stages 1, 2, ... (default: "
                                            "balanced by forward FLOPs)."),
    world_size: int | None = typer.Option(None, "--world-size", "-w", help="Total ranks; default tp × dp × pp."),
    gpus_per_node: int | None = typer.Option(None, "--gpus-per-node", help="GPUs per node: marks node boundaries."),
    batch: int | None = typer.Option(None, "--batch", help="Batch size the numbers are for (default: the "
                                     "example batch's)."),
    seq: int | None = typer.Option(None, "--seq", help="Sequence length the numbers are for."),
    vocab_multiple: int = typer.Option(1, "--vocab-multiple", help="Round each rank's vocab rows up to this."),
    sequence_parallel: bool = typer.Option(False, "--sequence-parallel", help="Split the norm/dropout/residual "
                                           "regions along the sequence (Megatron-SP)."),
    expert_parallel: bool = typer.Option(False, "--expert-parallel", help="E/tp whole experts of each "
                                         "mixture-of-experts layer per rank (default: 1/tp of every expert)."),
    fsdp: bool = typer.Option(False, "--fsdp", help="Shard each tp rank's parameters, gradients and optimizer "
                              "state over the --dp ranks (FSDP2): show its units, memory and traffic."),
    autocast: str | None = typer.Option(None, "--autocast", help="bf16 or fp16: count the collectives' bytes "
                                        "as a forward under torch.autocast moves them."),
    json_out: Path | None = typer.Option(None, "--json", help="Write plan, layout and report as JSON here."),
    svg: Path | None = typer.Option(None, "--svg", help="Write the printed tables as an SVG picture here."),
    html: Path | None = typer.Option(None, "--html", help="Write the printed tables as HTML here."),
    debug: bool = DEBUG,
) -> None:
    """Show how MODEL_PY would be sharded: rank grid, per-layer plan, memory and communication per step; with
    --pp, its pipeline stages, what crosses each cut and the bubble."""

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
        the_plan, report, names, batch_note, pipe = make_report(model, tp, batch, seq, vocab_multiple,
                                                                sequence_parallel, autocast, expert_parallel, spec)
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
                      (f"{c.shape} = {_n(c.elements)}; " if c else "") + "reduce-scatter backward"
                      + ("; only s/t kept, gathered again backward" if e.regather else ""))
    for x in seq.leaves:
        c = by_node.get(("forward", "reduce_scatter", x.node))
        table.add_row("reduce-scatter", escape(f"{x.module} ({x.node})"),
                      (f"{c.shape} = {_n(c.elements)}; " if c else "") + "all-gather backward")
    for g in seq.gathers:
        c = by_node.get(("forward", "all_gather", g.value))
        table.add_row("all-gather → whole sequence", escape(f"{g.value} for {', '.join(g.consumers)}"),
                      escape(g.reason + (f"; {c.shape} = {_n(c.elements)}" if c else "")))
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
    table = Table(title=f"expert parallelism (tokens per step b·s = {_n(tokens)})")
    for col in ("layer", "experts per rank", "routed to them", "dispatch, combine"):
        table.add_column(col, overflow="fold")
    for x in the_plan.experts:
        slots = f"b·s·k = {_n(tokens * x.top_k)} token slots" if x.top_k else "the tokens the routing picks"
        a2a = (f"none: every rank holds the tokens (an all-to-all would send b·s·k·h = {_n(tokens * x.top_k * x.width)} "
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
