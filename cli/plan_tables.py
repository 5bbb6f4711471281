"""The tables of ``autotp plan`` for data-parallel sharding (FSDP units, memory, traffic) and pipeline stages
(stages, ranks, point-to-point traffic, schedule): rendering only, of :mod:`autotp.reports.sharding` and
:mod:`autotp.reports.pipeline`'s numbers."""
from __future__ import annotations


from rich.table import Table
from rich.markup import escape

from autotp.cli.fit import FitTable
from autotp.reports.context import ContextReport
from autotp.reports.pipeline import PipelineReport
from autotp.distributed.rank_grid import RankGrid
from autotp.reports.sharding import FSDPReport, FSDPUnitRow, Report
from autotp.cli.plan_format import DIRECTION, fmt_count, fmt_kind, fmt_ratio, fmt_shape, fmt_size


def _unit_name(u: FSDPUnitRow) -> str:
    return "what no unit owns" if u.kind == "root" else escape(" + ".join(u.modules or (u.module,)))


_KEEPS = {"first": "fwd, bwd", "block": "fwd, bwd", "last": "fwd, kept", "root": "fwd, kept"}


def _over(fsdp: FSDPReport) -> str:
    """The ranks FSDP shards over: ``dp 2``, or with context parallelism ``dp 1 × cp 2 = 2 ranks``."""
    return f"dp {fsdp.dp}" if fsdp.cp == 1 else f"dp {fsdp.dp} × cp {fsdp.cp} = {fsdp.ranks} ranks"


def fsdp_units_table(fsdp: FSDPReport) -> Table:
    """One row per FSDP unit, in the order they run: first (embeddings), the blocks, last (final norm, LM
    head), then the root."""
    table = FitTable(title=f"fsdp units: each tp rank's shards cut again over {_over(fsdp)} (tp {fsdp.tp})", keys=2)
    for col, justify in (("kind", "left"), ("unit", "left"), ("gathered in", "left"), ("tensors", "right"),
                         ("parameters", "right"), ("per tp rank", "right"), ("gathered / rank", "right"),
                         ("sharded / rank", "right")):
        table.add_column(col, justify=justify, no_wrap=justify == "right")
    for i, u in enumerate(fsdp.units):
        table.add_row(u.kind, _unit_name(u), _KEEPS.get(u.kind, ""), str(u.tensors), fmt_count(u.params), fmt_count(u.local),
                      fmt_size(u.gathered_bytes), fmt_size(u.sharded_bytes), end_section=i == len(fsdp.units) - 1)
    us = fsdp.units
    table.add_row("all", "", "", str(sum(u.tensors for u in us)), fmt_count(sum(u.params for u in us)),
                  fmt_count(sum(u.local for u in us)), fmt_size(sum(u.gathered_bytes for u in us)),
                  fmt_size(sum(u.sharded_bytes for u in us)))
    table.caption = ("first: the modules read only before the blocks; last: only after them; root: what no unit "
                     "owns (a tied embedding / LM head). gathered in: fwd, bwd = freed after forward and gathered "
                     "again for backward; fwd, kept = kept from forward into backward. gathered: the unit's tp "
                     "shards whole, as an all-gather over dp leaves them; sharded: what a rank keeps between "
                     "gathers (dim 0 of each shard in d pieces, FSDP's padding included)")
    return table


def fsdp_memory_table(fsdp: FSDPReport) -> Table:
    """FSDP's training memory per rank, term by term, against plain data parallelism's."""
    t, d = fsdp.tp, fsdp.ranks
    table = FitTable(title=f"training memory per rank with fsdp (16 B/param, tp {t} × {_over(fsdp)}, "
                           "resharded after forward)", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right", no_wrap=True)
    table.add_column()
    table.add_row("  state 16·(P/t)/d", fmt_size(fsdp.state_bytes),
                  f"weights, gradients, Adam: 16 × {fmt_count(fsdp.local)} elements per tp rank / {d}")
    kept = {u.kind for u in fsdp.kept}
    if kept:
        what = ("root and last unit gathered, kept until their backward" if kept == {"root", "last"} else
                f"{'root' if 'root' in kept else 'last unit'} gathered, kept until its backward")
        table.add_row("  kept gathered", fmt_size(fsdp.kept_bytes), what)
    resharded = fsdp.resharded
    sizes = [u.gathered_bytes for u in resharded]
    if len(resharded) > 1:
        i = max(range(len(sizes) - 1), key=lambda j: sizes[j] + sizes[j + 1])
        pair = f"{_unit_name(resharded[i])} + {_unit_name(resharded[i + 1])}"
        table.add_row("  units gathered", fmt_size(fsdp.prefetch_bytes),
                      f"the running unit and the prefetched next one (largest pair: {pair})")
    elif resharded:
        table.add_row("  units gathered", fmt_size(fsdp.prefetch_bytes), "the one resharded unit, while it runs")
    table.add_row("fsdp per rank", fmt_size(fsdp.peak_bytes),
                  "+ activations (not estimated here) + gradients awaiting their reduce-scatter", end_section=True)
    table.add_row("ddp per rank 16·P/t", fmt_size(fsdp.ddp_bytes),
                  f"fsdp holds {fmt_ratio(fsdp.saving)}× less" if fsdp.saving else "")
    return table


def fsdp_traffic_table(fsdp: FSDPReport) -> Table:
    d = fsdp.ranks
    table = FitTable(title=f"fsdp communication per training step, per rank, over {_over(fsdp)}", keys=2)
    for col in ("pass", "collective", "count", "what", "bytes", "ring sends"):
        number = col not in ("pass", "collective", "what")
        table.add_column(col, justify="right" if number else "left", no_wrap=number)
    lines = fsdp.traffic
    for i, x in enumerate(lines):
        table.add_row(DIRECTION.get(x.direction, x.direction), fmt_kind(x.kind, "sum" if x.kind == "reduce_scatter" else ""),
                      str(x.count), x.what, fmt_size(x.bytes), fmt_size(x.sent), end_section=i == len(lines) - 1)
    table.add_row("all", "all", str(sum(x.count for x in lines)), "", fmt_size(sum(x.bytes for x in lines)),
                  fmt_size(sum(x.sent for x in lines)))
    dtypes = ("in the parameters' dtypes (no fsdp mixed precision)" if fsdp.param_dtype is None else
              f"gathered in {fsdp.param_dtype}, reduced in {fsdp.reduce_dtype or 'the parameters dtypes'} (fsdp "
              "mixed precision)")
    table.caption = (f"bytes: the units' tp shards whole, {dtypes}; "
                     f"a ring all-gather or reduce-scatter sends ≈ (d−1)/d = {(d - 1) / d:.2f}× them per rank. "
                     "Replaces data parallelism's gradient all-reduce.")
    return table


# -- context parallelism (--cp) --------------------------------------------------------------------------
def context_table(c: ContextReport, tp_collectives: bool = True, fsdp: bool = False) -> Table:
    """What runs on each rank's 1/cp of the sequence, and what it costs per rank (``tp_collectives``: with tp
    > 1, what cp does to the tp communication table above it; ``fsdp``: FSDP shards over dp × cp and its
    reduce-scatter sums the gradients over cp)."""
    table = FitTable(title=f"context parallelism: cp {c.cp}, each rank runs {c.seq // c.cp} of the {c.seq} "
                           f"tokens (chunks r and {2 * c.cp - 1}−r of {2 * c.cp})", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    written = f", {c.written} written out by hand run as SDPA" if c.written else ""
    keyed = f"; {c.keyed} written out with scores no ring computes, their keys and values all-gathered" \
        if c.keyed else ""
    table.add_row("attention", f"{c.rings} as rings over the cp group ({c.causal} causal{written}){keyed}")
    table.add_row("positions", f"{c.positions} arange(s) → the chunk's global positions; {c.tables} table(s) read "
                               "up to the length → the chunk's rows")
    if c.whole:
        table.add_row("on the whole inputs", f"{c.whole} op(s) on the inputs alone (a label shift), their results cut")
    table.add_row("loss", f"{c.losses} cross-entropy mean(s) over every counted token of the group (2 all-reduces "
                          "of one number each)")
    kept = ", the gathered K and V whole" if c.keyed else ""
    table.add_row("activations / rank", f"{fmt_size(c.activation_bytes)} of {fmt_size(c.activation_unsharded)} "
                                        f"unsharded (÷ cp{kept}), attention layers at b {c.batch} × s {c.seq}")
    table.add_row("K/V received / layer", f"{fmt_size(c.kv_bytes)} forward, as much again backward "
                                          f"(2·b·s·h_kv·(cp−1)/cp each way)")
    table.add_row("gradients", "summed over the cp group by FSDP's reduce-scatter over dp × cp (averaged over dp "
                               "only)" if fsdp else "summed over the cp group in one all-reduce of them all (with dp: "
                               "then averaged over dp)")
    if tp_collectives:
        table.add_row("tp collectives", f"each carries 1/{c.cp} of the elements counted above (b·s/cp rows)")
    table.caption = ("activations: Korthikanti et al. 2022 with fused attention, no dropout (64·sbh + 4·asb + "
                     "16·sb fp32 bytes per layer); measured at 1.00× by benchmarks/context_parallel.py")
    return table


def context_totals_table(report: Report, grid: RankGrid, ddp: bool = True) -> Table:
    """What each rank holds at tp 1 with cp: the whole model (cp cuts the sequence, not the weights), and the
    gradients' sum over the cp group each step."""
    m = report.memory
    table = FitTable(title=f"per rank (tp 1 × cp {grid.cp}: every weight whole)", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right", no_wrap=True)
    table.add_column()
    table.add_row("parameters", fmt_count(m.params), f"{fmt_size(m.bytes_full)}, as on one device")
    if not ddp:  # FSDP over dp × cp: its tables (below) say what a rank holds and sends
        table.add_row("training memory (16 B/param)", fmt_size(m.train_bytes_full), "without fsdp, as on one "
                      f"device; fsdp shards it over dp {grid.dp} × cp {grid.cp} (below); the activations are "
                      "1/cp (below)")
        return table
    table.add_row("training memory (16 B/param)", fmt_size(m.train_bytes_full), "weights, gradients and AdamW "
                  "state, as on one device; the activations are 1/cp (below)")
    over = f" then over dp {grid.dp}" if grid.dp > 1 else ""
    table.add_row("gradient all-reduce / step", fmt_count(m.params),
                  f"elements over cp {grid.cp}{over} ({fmt_size(m.bytes_full)}: the parameters' dtype)")
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
    """The micro-batches a rank keeps, in words, for the caption (autotp.reports.pipeline.in_flight)."""
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
    table = FitTable(title=f"pipeline stages: pp {pipe.pp} × v {pipe.virtual_stages}, {pipe.schedule}, "
                           f"{pipe.microbatches} micro-batches of b={pipe.micro_batch}, s={pipe.seq}, tp {pipe.tp}",
                     breaks=(4, 8))  # split narrow: where it runs, what one micro-batch costs, what the rank keeps
    cols = ["stage", "pp rank", "blocks", "also runs", "params", "bytes", "fwd FLOPs", "activations"]
    if one:
        cols += ["in flight", "act. on rank", "memory"]
    for col in cols:
        number = col not in ("blocks", "also runs")
        table.add_column(col, justify="right" if number else "left", no_wrap=number)
    for st in pipe.stages:
        also = [w for w, on in (("embeddings", st.first),
                                ("final norm, LM head, loss", st.last)) if on]
        cells = [str(st.index), str(st.rank), escape(_blocks(st.blocks)), "\n".join(also) or "—", fmt_count(st.params),
                 fmt_size(st.param_bytes), _flops(st.flops), fmt_size(st.activation_bytes)]
        if one:
            r = pipe.ranks[st.rank]
            cells += [str(r.in_flight), fmt_size(r.activation_bytes), fmt_size(r.memory_bytes)]
        table.add_row(*cells, end_section=st.index == len(pipe.stages) - 1)
    stages = pipe.stages
    total = ["all", "", f"{sum(len(st.blocks) for st in stages)} blocks", "", fmt_count(sum(st.params for st in stages)),
             fmt_size(sum(st.param_bytes for st in stages)), _flops(sum(st.flops for st in stages)),
             fmt_size(sum(st.activation_bytes for st in stages))]
    table.add_row(*total, *(["", "", ""] if one else []))
    whole, split = 4 * a.elem + 2 * a.dropout, 12 * a.elem
    formula = (f"{a.layer_bytes:,} B per block = s·b·h·"
               + (f"{whole + split}/t" if a.sequence_parallel else f"({whole} + {split}/t)")
               + ("" if a.fused or a.heads is None else f" + {a.elem + a.dropout * (1 + a.elem)}·a·s²·b/t")
               + f" at h={fmt_count(a.hidden)}" + (f", a={a.heads}" if a.heads and not a.fused else ""))
    table.caption = escape(
        "params, bytes: what one tp rank of the stage holds" + (
            f" ({', '.join(pipe.shared)} in every stage that reads it, so the column adds up to more than the model)"
            if pipe.shared else "") + ". fwd FLOPs: matmuls and attention of one micro-batch through the whole "
        "stage, each tp rank doing ≈ 1/t. activations: one micro-batch's, per tp rank, the blocks' own (Korthikanti et al. 2022, README \"What a step costs\", GPT block with a "
        f"4h MLP; {a.elem}-byte activations, {'1-byte dropout masks' if a.dropout else 'no dropout'}, "
        f"{'fused attention: no s×s scores' if a.fused else 's×s scores kept'}): {formula}; embeddings, LM head "
        f"and loss not counted." + (f" Assumed in flight: {_in_flight_rule(pipe)}. {MEMORY_NOTE}" if one else ""))
    return table


# what the memory column of the pipeline tables adds up
MEMORY_NOTE = ("memory: per tp rank at its peak, the training state of its stages' parameters (16 B each: fp32 "
               "weights, gradients and AdamW's two moments; split over dp under fsdp) plus act. on rank.")


def ranks_table(pipe: PipelineReport) -> Table:
    """With several stages per rank: what each pipeline rank keeps at its peak."""
    table = FitTable(title=f"pipeline ranks: {pipe.virtual_stages} stages each; per tp rank, activations at the peak")
    for col in ("pp rank", "stages", "blocks", "params", "bytes", "in flight", "act. on rank", "memory"):
        table.add_column(col, justify="left" if col in ("stages",) else "right", no_wrap=col != "stages")
    for r in pipe.ranks:
        blocks = sum(len(pipe.stages[s].blocks) for s in r.stages)
        table.add_row(str(r.rank), ", ".join(map(str, r.stages)), str(blocks), fmt_count(r.params), fmt_size(r.param_bytes),
                      str(r.in_flight), fmt_size(r.activation_bytes), fmt_size(r.memory_bytes))
    table.caption = ("params: every tensor its stages read, once. in flight: (stage, micro-batch) pairs whose "
                     f"activations the rank holds at once, each at its stages' mean size. {_in_flight_rule(pipe)}. "
                     + MEMORY_NOTE)
    return table


def p2p_table(pipe: PipelineReport) -> Table:
    """What crosses each cut per micro-batch: sent forward, its gradient sent back."""
    table = FitTable(title=f"pipeline point-to-point per micro-batch (b={pipe.micro_batch}, s={pipe.seq}), "
                           "each tp rank to its peer", keys=3)
    for col in ("cut", "pp ranks", "value", "computed by", "shape", "dtype", "fwd bytes", "bwd bytes"):
        number = col in ("shape", "fwd bytes", "bwd bytes")
        table.add_column(col, justify="right" if number else "left", no_wrap=number)
    for c in pipe.cuts:
        where = f"{c.src} → {c.dst}" if c.sent else f"{c.src} (same rank: not sent)"
        for i, x in enumerate(c.values):
            by = ": ".join(w for w in (x.module or "<root>", x.code) if w)
            table.add_row(f"{c.after} → {c.after + 1}" if i == 0 else "", where if i == 0 else "", escape(x.name),
                          escape(by), fmt_shape(x.shape), x.dtype, fmt_size(x.bytes if c.sent else 0),
                          fmt_size(x.bytes if c.sent and x.grad else 0), end_section=i == len(c.values) - 1)
        if not c.values:
            table.add_row(f"{c.after} → {c.after + 1}", where, "nothing", "", "", "", fmt_size(0), fmt_size(0),
                          end_section=True)
    m, sent = pipe.microbatches, sum(c.sent for c in pipe.cuts)
    table.add_row("per micro-batch", f"{sent} cut{'s' if sent != 1 else ''}", "", "", "", "",
                  fmt_size(pipe.forward_bytes), fmt_size(pipe.backward_bytes))
    table.add_row(f"per step (× m = {m})", "", "", "", "", "", fmt_size(m * pipe.forward_bytes),
                  fmt_size(m * pipe.backward_bytes))
    table.caption = (
        "values computed before a cut and read after it, as autotp.pipeline sends them (the graph's inputs reach "
        "every stage locally; parameters and buffers are read where they are used). bwd: the gradients of the "
        "floating-point values computed from parameters. Per step: every micro-batch over every cut"
        + (f"; {pipe.virtual_stages} stages per rank make p·v − 1 = {len(pipe.cuts)} cuts (p − 1 = {pipe.pp - 1} "
           f"with one stage per rank: about v× the traffic)" if pipe.virtual_stages > 1 else "")
        + f": {fmt_size(pipe.step_bytes)} both ways.")
    return table


def schedule_table(pipe: PipelineReport) -> Table:
    """The schedule, its sizes and its bubble."""
    p, v, m, bub = pipe.pp, pipe.virtual_stages, pipe.microbatches, pipe.bubble
    table = FitTable(title=f"pipeline schedule {pipe.schedule}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right", no_wrap=True)
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
