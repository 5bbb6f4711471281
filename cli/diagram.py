"""``autotp plan --svg``: the plan as a diagram (the terminal's tables are ``--html``).

Two panels, written as plain SVG text (rects, lines and text; no dependency):

- the ranks: one cell per global rank with its (tp, dp, pp) coordinates, one box per pipeline rank (naming
  its stages' blocks under ``--pp``), and a dashed box around each node when ``--gpus-per-node`` is given;
- the layers, in the model's order: one row per module with parameters, its weight drawn cut into tp bands
  along the dim the plan cuts (column, row, vocab, experts; grey when every rank holds it whole) with each
  rank's shape, and a marker per collective on the weight's input side (left) or output side (right).
  Consecutive blocks that are the same but for their number are drawn once (``transformer.h.0–11 ×12``).

What a test or script looks for carries a class and ``data-`` attributes (``rank``, ``node``, ``layer``,
``collective``). Reads a Plan, its Report and the RankGrid and imports no torch: the command has loaded
it already, and ``autotp plan --help`` must not.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple
from xml.sax.saxutils import escape, quoteattr

from autotp.cli.plan_format import DIRECTION, data_parallel_name, fmt_kind

if TYPE_CHECKING:
    from autotp.distributed.rank_grid import RankGrid
    from autotp.reports.pipeline import PipelineReport
    from autotp.plan.plan import Plan
    from autotp.reports.sharding import Report

_LAYER = re.compile(r"^(.*?\.(\d+))(\.|$)")  # the first numbered component names a block: transformer.h.3
_FONT = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', monospace"
_CW = 0.6  # a monospace character's width per unit of font size: text widths are computed, not measured
ROLE_COLOR = {"column": "#4c78a8", "row": "#f58518", "vocab": "#8e6bb8", "experts": "#2a9d8f",
              "replicated": "#bbbbbb"}
COLL_COLOR = {"all_reduce": "#c0392b", "reduce_scatter": "#b9770e", "all_gather": "#1e8449"}
_SHORT = {"column": "col", "row": "row", "vocab": "vocab", "experts": "experts"}


class Drawing(NamedTuple):
    svg: str
    ranks: int
    layers: int  # modules described (the "per layer" table's rows), before identical blocks are folded


@dataclass(frozen=True)
class _Coll:
    direction: str
    kind: str
    op: str
    shape: str

    def label(self) -> str:
        return f"{DIRECTION.get(self.direction, self.direction)} {fmt_kind(self.kind, self.op)} {self.shape}"


@dataclass(frozen=True)
class _Param:
    leaf: str
    role: str
    dim: int | None
    full: tuple[int, ...]
    local: tuple[int, ...]
    note: str = ""

    def label(self, tp: int) -> str:
        full, local = "×".join(map(str, self.full)), "×".join(map(str, self.local))
        if self.role == "replicated":
            return f"{self.leaf} {full} whole" + (f" ({self.note})" if self.note else "")
        cut = f"{_SHORT.get(self.role, self.role)} dim {self.dim} /{tp}"
        return f"{self.leaf} {full} → {cut}: {local}" + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class _Row:
    module: str  # inside a block, the name after the block's (so rows of two blocks compare equal)
    role: str
    params: tuple[_Param, ...] = ()
    ins: tuple[_Coll, ...] = ()  # on the input: a pair's f (backward all-reduce), sequence-parallel all-gather
    outs: tuple[_Coll, ...] = ()  # on the output: g (forward all-reduce), reduce-scatter, the loss's reductions
    pair: str | None = None  # the column→row pair it belongs to


class _Section(NamedTuple):
    block: str | None  # transformer.h.3, or None outside the blocks
    stage: int | None
    rows: tuple[_Row, ...]
    last: str | None = None  # the last block of a folded run


def _sections(plan: Plan, report: Report, names: Sequence[str]) -> tuple[list[_Section], int]:
    """The layers panel's rows, grouped by block, and how many modules they describe."""
    shards = dict(plan.params)
    by_alias = {a: r for r in report.params for a in r.aliases}
    pair_of = {shards[w].module: p.module for p in plan.pairs for w in (*p.column_weights, p.row_weight)
               if w in shards}
    seq = plan.sequence
    # which side of the weight a collective sits on: the values entering columns and LM heads get f (or the
    # sequence-parallel all-gather); everything else follows what the module computes
    inputs = {n for p in plan.pairs for n in p.enter} | {x for _, x in plan.vocab.heads}
    inputs |= {e.node for e in seq.enters} if seq is not None else set()
    losses = {x.node for x in plan.vocab.losses}
    on_seq = {n.removeprefix("p_") for _, n in seq.grads} if seq is not None and seq.leaves else set()
    colls: dict[str, list] = {}
    for c in report.collectives:
        colls.setdefault(("loss:" if c.node in losses else "") + c.at, []).append(c)
    params: dict[str, list[_Param]] = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        r = by_alias[name]
        shard = shards.get(r.name) if r.role != "replicated" else None
        tied = [a for a in r.aliases if a.rpartition(".")[0] != module]
        notes = [f"tied to {tied[0]}"] if tied else []
        if r.role == "replicated" and name.replace(".", "_") in on_seq:
            notes.append("on s/tp positions")
        params.setdefault(module or "<root>", []).append(
            _Param(leaf, r.role, shard.dim if shard else None, tuple(r.full_shape), tuple(r.local_shape),
                   ", ".join(notes)))
    modules = list(params) + [m for m in colls if not m.startswith("loss:") and m not in params]
    stage_of = {b: i for i, s in enumerate(plan.stages) for b in s.blocks}
    sections: list[_Section] = []
    stage = 0 if plan.stages else None  # the modules before the blocks run in the first stage, after in the last
    for module in modules:
        here = _LAYER.match(module)
        block = here.group(1) if here else None
        if block is not None:
            stage = stage_of.get(block)
        elif plan.stages and any(s.block is not None for s in sections):
            stage = len(plan.stages) - 1
        # a block's rows are named inside it, so that two blocks' rows compare equal
        rel = module if block is None else module[len(block) + 1:] or "(block)"
        ps = tuple(params.get(module, ()))
        roles = [p.role for p in ps if p.role != "replicated"]
        sides: tuple[list[_Coll], list[_Coll]] = ([], [])
        for c in colls.get(module, ()):
            sides[c.node not in inputs].append(_Coll(c.direction, c.kind, c.op, c.shape))
        pair = pair_of.get(module)
        if pair is not None and block is not None and pair.startswith(block + "."):
            pair = pair[len(block) + 1:]
        rows = [_Row(rel, roles[0] if roles else "replicated" if ps else "collectives", ps, tuple(sides[0]),
                     tuple(sides[1]), pair)]
        if "loss:" + module in colls:  # the vocab-parallel loss: its own row, after the head it reads
            rows.append(_Row("loss (vocab-parallel cross-entropy)", "loss", outs=tuple(
                _Coll(c.direction, c.kind, c.op, c.shape) for c in colls["loss:" + module])))
        if block is not None and sections and sections[-1].block == block:
            sections[-1] = sections[-1]._replace(rows=sections[-1].rows + tuple(rows))
        else:
            sections.append(_Section(block, stage, tuple(rows)))
    return _fold(sections), len(modules)


def _fold(sections: list[_Section]) -> list[_Section]:
    """Runs of two or more consecutive blocks of one stage with the same rows become one section."""
    out: list[_Section] = []
    for s in sections:
        prev = out[-1] if out else None
        if (prev is not None and s.block is not None and prev.block is not None and prev.rows == s.rows
                and prev.stage == s.stage):
            last = prev.last or prev.block
            pa, ia = _LAYER.match(last).group(1, 2)
            pb, ib = _LAYER.match(s.block).group(1, 2)
            if pa[:-len(ia)] == pb[:-len(ib)] and int(ib) == int(ia) + 1:
                out[-1] = prev._replace(last=s.block)
                continue
        out.append(s)
    return out


def _pick(n: int, cap: int) -> list[int | None]:
    """Indices 0..n-1 to draw, at most ``cap`` of them: the first and the last few, None for the gap."""
    if n <= cap:
        return list(range(n))
    head = cap - cap // 4
    return [*range(head), None, *range(n - (cap - head - 1), n)]


class _Svg:
    """SVG text, element by element; keyword attributes take '-' for '_' (``font_size``) and drop a trailing
    '_' (``class_``)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.right = self.bottom = 0.0  # how far the drawing reaches: the picture's size

    def reach(self, x: float, y: float) -> None:
        self.right, self.bottom = max(self.right, x), max(self.bottom, y)

    @staticmethod
    def _attrs(attrs: dict) -> str:
        return "".join(f" {k.rstrip('_').replace('_', '-')}={quoteattr(str(v))}" for k, v in attrs.items()
                       if v is not None)

    def add(self, tag: str, text: str | None = None, **attrs) -> None:
        if tag == "rect":
            self.reach(attrs["x"] + attrs["width"], attrs["y"] + attrs["height"])
        body = "/>" if text is None else f">{escape(text)}</{tag}>"
        self.parts.append(f"<{tag}{self._attrs(attrs)}{body}")

    def open(self, tag: str, title: str | None = None, **attrs) -> None:
        self.parts.append(f"<{tag}{self._attrs(attrs)}>")
        if title is not None:  # a tooltip in a browser
            self.add("title", title)

    def close(self, tag: str) -> None:
        self.parts.append(f"</{tag}>")

    def text(self, x: float, y: float, s: str, size: int = 12, **attrs) -> None:
        w = _width(s, size)
        self.reach(x + (w / 2 if attrs.get("text_anchor") == "middle" else w), y + size / 3)
        self.add("text", s, x=round(x, 1), y=round(y, 1), font_size=size, **attrs)


def _width(s: str, size: int = 12) -> float:
    return len(s) * size * _CW


def _grid(svg: _Svg, grid: RankGrid, pipe: PipelineReport | None, x0: float, y0: float) -> tuple[float, float]:
    """The rank grid at (x0, y0): one box per pipeline rank, a row of cells per tp group; its size."""
    cw, ch, gap, pad, head = 74, 38, 6, 10, 22
    tps, dps = _pick(grid.tp, 16), _pick(grid.dp, 12)
    left = x0 + 44  # room for the "dp d" labels
    col_x = {t: left + pad + i * (cw + gap) for i, t in enumerate(tps)}
    shown = _pick(grid.pp, 8)
    titles = {p: _stage_title(p, grid, pipe) for p in shown if p is not None}
    # a box is as wide as its cells or its title, whichever is wider
    inner = max([len(tps) * (cw + gap) - gap] + [_width(t, 11) + 4 for t in titles.values()])
    for t, x in col_x.items():
        svg.text(x + cw / 2, y0 + 12, f"tp {t}" if t is not None else "…", 11, text_anchor="middle", fill="#555")
    y = y0 + 20
    row_y: dict[tuple[int, int], float] = {}  # (pp, dp) -> top of its cells
    for p in shown:
        if p is None:
            svg.text(left + pad, y + 14, "⋮ more pipeline ranks", 11, fill="#555")
            y += 24
            continue
        h = head + len(dps) * (ch + gap) - gap + pad
        svg.add("rect", x=left, y=y, width=inner + 2 * pad, height=h, rx=6, fill="#f7f7f7", stroke="#999",
                class_="stage", data_pp=p)
        svg.text(left + pad, y + 15, titles[p], 11, font_weight="bold")
        ry = y + head
        for d in dps:
            if d is None:
                svg.text(x0, ry + ch / 2 + 4, f"⋮ dp {dps[dps.index(None) - 1] + 1}–{dps[dps.index(None) + 1] - 1}",
                         11, fill="#555")
                ry += ch + gap
                continue
            svg.text(x0, ry + ch / 2 + 4, f"dp {d}", 11, fill="#555")
            row_y[(p, d)] = ry
            for t, cx in col_x.items():
                if t is None:
                    svg.text(cx + cw / 2, ry + ch / 2 + 4, "…", 12, text_anchor="middle")
                    continue
                r = grid.rank(t, d, p)
                node = grid.coords(r).get("node")
                svg.open("g", f"rank {r}: tp {t}, dp {d}, pp {p}" + (f", node {node}" if node is not None else ""),
                         class_="rank", data_rank=r, data_tp=t, data_dp=d, data_pp=p)
                svg.add("rect", x=cx, y=ry, width=cw, height=ch, rx=4, fill="#dde8f3", stroke="#4c78a8")
                svg.text(cx + cw / 2, ry + 16, f"r{r}", 13, text_anchor="middle", font_weight="bold")
                svg.text(cx + cw / 2, ry + 31, f"({t},{d},{p})", 10, text_anchor="middle", fill="#333")
                svg.close("g")
            ry += ch + gap
        y += h + gap + 4
    right = left + inner + 2 * pad
    cells = len(tps) * (cw + gap) - gap
    if grid.gpus_per_node is not None:  # TP groups never straddle a node, so a node is whole rows of cells
        g = grid.gpus_per_node

        def first(pd: tuple[int, int]) -> int:  # the rank of a row's tp 0
            return grid.rank(0, pd[1], pd[0])

        spans: dict[int, list[list[float]]] = {}  # node -> [top, top of last row] of each run of rows drawn
        prev = None
        for pd in sorted(row_y, key=first):
            k = first(pd) // g
            if prev is not None and prev == (k, first(pd) - grid.tp):  # the next rank's row: the same run
                spans[k][-1][1] = row_y[pd]
            else:  # a new node, or rows left out between (a large grid): another box
                spans.setdefault(k, []).append([row_y[pd], row_y[pd]])
            prev = (k, first(pd))
        for k, runs in spans.items():
            svg.open("g", f"node {k}: ranks {k * g}–{min((k + 1) * g, grid.world_size) - 1}", class_="node",
                     data_node=k)
            for top, last in runs:
                svg.add("rect", x=left + pad - 4, y=top - 2, width=cells + 8, height=last + ch - top + 4, rx=5,
                        fill="none", stroke="#d62728", stroke_width=1.5, stroke_dasharray="6 4")
                svg.text(right + 6, top + 12, f"node {k}", 11, fill="#d62728")
            svg.close("g")
        right += 60
    return right - x0, y - y0


def _stage_title(p: int, grid: RankGrid, pipe: PipelineReport | None) -> str:
    if pipe is None:
        return f"pp {p}" + (": every layer" if grid.pp == 1 else "")
    parts = []
    for i in pipe.ranks[p].stages:
        s = pipe.stages[i]
        what = [s.blocks[0] + (f"–{s.blocks[-1].rpartition('.')[2]}" if len(s.blocks) > 1 else "")] * bool(s.blocks)
        what += ["embeddings"] * s.first + ["final norm, LM head, loss"] * s.last
        parts.append(f"stage {i}: {' + '.join(what)}")
    return f"pp {p} · " + "; ".join(parts)


def draw(title: str, plan: Plan, report: Report, grid: RankGrid, names: Sequence[str],
         pipe: PipelineReport | None = None, fsdp: bool = False) -> Drawing:
    """The diagram of ``plan`` on ``grid``: ``title`` heads it; ``names`` are the model's parameter names
    in its order, every alias (``named_parameters(remove_duplicate=False)``)."""
    sections, count = _sections(plan, report, names)
    svg, m = _Svg(), 16
    sp = plan.sequence is not None and bool(plan.sequence.leaves)
    svg.text(m, 24, title, 15, font_weight="bold")
    what = [f"world {grid.world_size} = tp {grid.tp} × dp {grid.dp} × pp {grid.pp}"]
    if grid.gpus_per_node is not None:
        what.append(f"{grid.num_nodes} node(s) of {grid.gpus_per_node} GPUs")
    kind = data_parallel_name(grid.dp, int(fsdp))  # DDP, or FSDP, over the dp ranks ('' at dp 1)
    what += ["sequence parallel"] * sp + [f"{kind} over dp {grid.dp}"] * bool(kind)
    what.append(f"{len(plan.pairs)} column→row pairs, {len(report.collectives)} collectives per step "
                f"(b={report.batch}, s={report.seq})")
    svg.text(m, 44, "; ".join(what), 12, fill="#333")
    svg.text(m, 74, "ranks: cell rN (tp, dp, pp); a row of cells is a tp group, a column in a box a dp group",
             12, font_weight="bold")
    gw, gh = _grid(svg, grid, pipe, m, 84)
    legend_x = m + gw + 40
    rows = [r for sec in sections for r in sec.rows]
    _legend(svg, legend_x, 84, {p.role for r in rows for p in r.params},
            {c.kind for r in rows for c in (*r.ins, *r.outs)}, grid.gpus_per_node is not None)
    y = max(84 + gh, svg.bottom) + 30
    svg.text(m, y, f"layers, in the model's order: each weight cut into tp {grid.tp} bands (rank 0's filled), "
             "its shape per rank, and where the collectives run", 12, font_weight="bold")
    if fsdp:
        unit = "each stage one unit" if plan.stages else "a unit: each block, the embeddings, the final norm and head"
        svg.text(m, y + 18, f"FSDP2 over dp {grid.dp}, {unit}; all-gathered before its forward and its backward, "
                 "its gradients reduce-scattered:", 11, fill="#333")
        svg.text(m, y + 33, f"each dp rank holds 1/{grid.dp} (along dim 0) of every shape below", 11, fill="#333")
        y += 33
    _layers(svg, sections, report.tp, m, y + 14)
    total_w, y = svg.right + m, svg.bottom
    body = "\n".join(svg.parts)
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{round(total_w)}" height="{round(y + m)}" '
            f'viewBox="0 0 {round(total_w)} {round(y + m)}" font-family={quoteattr(_FONT)}>\n'
            f'<rect width="100%" height="100%" fill="white"/>\n')
    return Drawing(head + body + "\n</svg>\n", grid.world_size, count)


def _layers(svg: _Svg, sections: list[_Section], tp: int, x0: float, y0: float) -> None:
    """One row per module in the model's order, a header per block."""
    rows = [r for s in sections for r in s.rows]
    # outside the blocks, a row says which pipeline stage runs it (a block's header says it for its rows)
    names = {id(r): r.module + (f"  · stage {s.stage}" if s.block is None and s.stage is not None else "")
             for s in sections for r in s.rows}
    name_w = max(_width(n) for n in names.values()) + 24
    in_w = max([_width(c.label(), 11) for r in rows for c in r.ins] + [0]) + 26
    par_w = max([_width(p.label(tp), 11) for r in rows for p in r.params] + [0]) + 16
    out_w = max([_width(c.label(), 11) for r in rows for c in r.outs] + [0]) + 26
    x_in, x_w = x0 + name_w, x0 + name_w + in_w
    x_par, x_out = x_w + 56, x_w + 56 + par_w
    right = x_out + out_w
    y = y0
    for s in sections:
        y += 8
        if s.block is not None:
            label = s.block
            if s.last is not None:
                first, last = int(_LAYER.match(s.block).group(2)), int(_LAYER.match(s.last).group(2))
                label += f"–{last}  ×{last - first + 1} (the same shards and collectives)"
            stage = f"  · pipeline stage {s.stage}" if s.stage is not None else ""
            svg.add("rect", x=x0, y=y, width=right - x0, height=20, fill="#eef1f5")
            svg.text(x0 + 6, y + 14, label + stage, 12, font_weight="bold", class_="block")
            y += 24
        bands: dict[str, list[float]] = {}  # pair -> [index of its first row's element, top, bottom]
        for r in s.rows:
            h = max(40, 15 * max(len(r.params), len(r.ins), len(r.outs)) + 12)
            if r.pair is not None:
                bands.setdefault(r.pair, [len(svg.parts), y, y])[2] = y + h
            whole = (s.block + "." if s.block and r.module != "(block)" and r.role != "loss" else "") + r.module
            svg.open("g", "\n".join([whole, *(p.label(tp) for p in r.params)]), class_="layer",
                     data_module=whole if not s.last else f"{s.block}–{_LAYER.match(s.last).group(2)}.{r.module}",
                     data_role=r.role)
            svg.text(x0 + (14 if s.block else 6), y + 17, names[id(r)], 12)
            _weight(svg, r, x_w + 6, y + 5, tp)
            for i, p in enumerate(r.params):
                svg.text(x_par, y + 16 + 15 * i, p.label(tp), 11, fill="#222")
            for i, c in enumerate(r.ins):
                _marker(svg, c, x_in + 8, y + 12 + 15 * i, "in")
            for i, c in enumerate(r.outs):
                _marker(svg, c, x_out + 8, y + 12 + 15 * i, "out")
            svg.close("g")
            y += h
        # a pair's band goes behind its rows: inserted before the first of them, the later pairs first so the
        # earlier ones' places stay put
        for pair, (at, top, bottom) in sorted(bands.items(), key=lambda kv: -kv[1][0]):
            svg.parts.insert(int(at), f'<rect x="{x0}" y="{top - 2}" width="{right - x0}" height="{bottom - top + 4}" '
                             f'rx="4" fill="#fff6e5" stroke="#f0c987" class="pair" data-pair={quoteattr(pair)}/>')
    svg.reach(right, y + 8)


def _weight(svg: _Svg, r: _Row, x: float, y: float, tp: int) -> None:
    """The row's weight, cut into tp bands along its dim (at most 8 drawn); grey and whole if replicated."""
    if not r.params:  # the loss, or a row of collectives alone
        return
    w, h = 44, 30
    color = ROLE_COLOR.get(r.role, "#888")
    main = next((p for p in r.params if p.role == r.role and len(p.full) >= 2), None)
    if main is None or r.role == "replicated":
        svg.add("rect", x=x, y=y, width=w, height=h if main else 8, fill=color, stroke="#888")
        return
    bands = min(tp, 8)
    across = main.dim == len(main.full) - 1 and main.dim > 0  # cut along the last dim: vertical bands
    svg.add("rect", x=x, y=y, width=w, height=h, fill="white", stroke=color, stroke_width=1.5)
    if across:
        svg.add("rect", x=x, y=y, width=w / bands, height=h, fill=color)
    else:
        svg.add("rect", x=x, y=y, width=w, height=h / bands, fill=color)
    for i in range(1, bands):
        if across:
            svg.add("line", x1=x + i * w / bands, y1=y, x2=x + i * w / bands, y2=y + h, stroke=color)
        else:
            svg.add("line", x1=x, y1=y + i * h / bands, x2=x + w, y2=y + i * h / bands, stroke=color)


def _marker(svg: _Svg, c: _Coll, x: float, y: float, side: str | None = None) -> None:
    """Circle: all-reduce; triangle down: reduce-scatter; up: all-gather. Filled: forward, hollow: backward.
    ``side``: "in" or "out" of the weight; None in the legend, whose markers are no collectives of the plan."""
    color = COLL_COLOR.get(c.kind, "#555")
    fill = color if c.direction == "forward" else "white"
    svg.open("g", None, class_="key" if side is None else "collective", data_kind=c.kind,
             data_direction=c.direction, data_side=side)
    if c.kind == "all_reduce":
        svg.add("circle", cx=x, cy=y, r=5, fill=fill, stroke=color, stroke_width=1.5)
    else:
        d = 5 if c.kind == "reduce_scatter" else -5
        svg.add("polygon", points=f"{x - 5},{y - d} {x + 5},{y - d} {x},{y + d}", fill=fill, stroke=color,
                stroke_width=1.5)
    if side is not None:
        svg.text(x + 10, y + 4, c.label(), 11, fill=color)
    svg.close("g")


def _legend(svg: _Svg, x: float, y: float, roles: set[str], kinds: set[str], nodes: bool) -> None:
    """The key to the glyphs this diagram uses."""
    lines = [(role, text) for role, text in (
        ("column", "column-parallel: output features cut"), ("row", "row-parallel: input features cut; partial sums"),
        ("vocab", "vocab-parallel: vocabulary rows cut"), ("experts", "expert-parallel: whole experts per rank"),
        ("replicated", "whole on every rank")) if role in roles or role == "replicated"]
    svg.text(x, y + 10, "legend", 12, font_weight="bold")
    yy = y + 22
    for role, text in lines:
        svg.add("rect", x=x, y=yy, width=22, height=14, fill=ROLE_COLOR[role], stroke="#888")
        svg.text(x + 30, yy + 11, text, 11)
        yy += 22
    yy += 8
    for kind in [k for k in COLL_COLOR if k in kinds]:
        _marker(svg, _Coll("forward", kind, "", ""), x + 6, yy)
        _marker(svg, _Coll("backward", kind, "", ""), x + 22, yy)
        svg.text(x + 34, yy + 4, f"{fmt_kind(kind, '')}: filled forward, hollow backward", 11)
        yy += 20
    gather, scatter = "; an all-gather" * ("all_gather" in kinds), "; a reduce-scatter" * ("reduce_scatter" in kinds)
    notes = [f"left of a weight: on its input (f{gather})", f"right of it: on its output (g{scatter}; the loss)",
             "shaded band: one column→row pair"]
    notes += ["dashed box: one node (--gpus-per-node)"] * nodes
    for n in notes:
        svg.text(x, yy + 4, n, 11, fill="#333")
        yy += 16

