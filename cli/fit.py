"""How the commands' tables meet the console's width: no number, name or header is ever cut with an ellipsis.

Every table the CLI prints is a :class:`FitTable`. At the width it is drawn at (a terminal's, COLUMNS, or
rich's 80 columns when no stream is a terminal) it lays its columns out itself rather than leaving it to
rich, whose last resort when a table is too wide is to cut every cell to the same width with an ellipsis:

- a column added with ``no_wrap=True`` holds numbers (counts, sizes, shapes, times): each cell stays on one
  line, so a number is never split;
- every other cell, and every header, wraps at its spaces and never inside a word;
- when the columns need more than the width, the table is drawn as several: each repeats the first ``keys``
  columns (what names a row) with as many of the others as fit, in their order;
- only a word too wide for the console even beside the key columns alone (a long list of ranks without a
  space) is folded onto the next lines: still all there, never cut.

The widths come from rich's own measurement of each cell (:class:`rich.measure.Measurement`).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from rich.constrain import Constrain
from rich.measure import Measurement
from rich.table import Table

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, JustifyMethod, RenderableType, RenderResult
    from rich.style import StyleType


class FitTable(Table):
    """A rich ``Table`` that fits the width it is drawn at without cutting anything (see the module's
    docstring). ``keys``: the leading columns that name a row, repeated in each part of a split table;
    ``breaks``: the columns a part had best start at (those after them belong together, as a count, its
    formula and their ratio), kept to while such a run fits beside the keys."""

    def __init__(self, *args, keys: int = 1, breaks: tuple[int, ...] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.keys = keys
        self.breaks = breaks

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if not self.columns:
            yield from Table.__rich_console__(self, console, options)
            return
        width = options.max_width
        head, need, body, want = (list(x) for x in zip(*(self._measure(console, options, c) for c in self.columns)))
        keys = list(range(min(self.keys, len(self.columns))))
        # a column with a word too wide for the console even beside the keys alone is folded in any layout:
        # splitting the table does not help it, so it asks for no more than its header and takes what is left
        alone = width - self._border(len(keys) + 1) - sum(need[k] for k in keys)
        for i in range(len(keys), len(need)):
            if need[i] > alone:
                need[i] = head[i]
        groups = self._groups(need, keys, width)
        split = len(groups) > 1
        parts = []
        for n, group in enumerate(groups):
            cols = keys + group
            # a split table's title goes above all its parts and its caption below them, as wide as the widest
            title = None if self.title is None else self.title if not split else "(continued)" if n else None
            part = self._part(cols, title, None if split else self.caption)
            room = width - self._border(len(cols))
            if sum(need[i] for i in cols) <= room:  # else keys wider than the console: rich folds them
                # the cells on one line before the headers: a header wraps once, a cell on every row
                widths = [need[i] for i in cols]
                for goal in (body, want):
                    widths = _spread(widths, [goal[i] for i in cols], room)
                for column, w in zip(part.columns, widths):
                    column.width = w - self._pad()
            # a title's or caption's longest word widens a narrower table (up to the console) rather than fold
            words = [Measurement.get(console, options, t).minimum for t in (title, part.caption) if t is not None]
            part.min_width = min(width, max(words, default=0))
            parts.append(part)
        widest = max(Measurement.get(console, options, p).maximum for p in parts)
        if split and self.title is not None:
            yield self._note(console, self.title, self.title_style or "table.title", self.title_justify, widest)
        for part in parts:
            yield from Table.__rich_console__(part, console, options)
        if split and self.caption is not None:
            yield self._note(console, self.caption, self.caption_style or "table.caption", self.caption_justify,
                             widest)

    @staticmethod
    def _note(console: Console, text: RenderableType, style: StyleType, justify: JustifyMethod,
              width: int) -> Constrain:
        """A split table's title or caption, styled as rich draws them, over ``width`` columns."""
        if isinstance(text, str):
            text = console.render_str(text, style=style, highlight=False)
            text.justify = justify
        return Constrain(text, width)

    def _groups(self, need: list[int], keys: list[int], width: int) -> list[list[int]]:
        """The columns after the keys, split into parts that fit the width beside the keys: one part when the
        whole table fits; else the runs between ``breaks`` when each fits, packed whole; else as few parts as
        fit, of about equal widths (so the keys get about the same room in each)."""
        rest = list(range(len(keys), len(need)))

        def fits(cols: list[int]) -> bool:
            return sum(need[i] for i in cols) + self._border(len(cols)) <= width

        if not rest or fits(keys + rest):
            return [rest]
        runs: list[list[int]] = []
        for i in rest:
            if runs and i not in self.breaks:
                runs[-1].append(i)
            else:
                runs.append([i])
        if len(runs) > 1 and all(fits(keys + run) for run in runs):
            groups: list[list[int]] = []
            for run in runs:
                if groups and fits(keys + groups[-1] + run):
                    groups[-1].extend(run)
                else:
                    groups.append(list(run))
            return groups
        parts = 1  # the fewest parts: packed greedily, column by column
        group: list[int] = []
        for i in rest:
            if group and not fits(keys + group + [i]):
                parts, group = parts + 1, []
            group.append(i)
        return _balanced(rest, [need[i] + 1 for i in rest], parts)  # + 1: the line between two columns

    def _measure(self, console: Console, options: ConsoleOptions, column) -> tuple[int, int, int, int]:
        """(head, need, body, want) of a column, padding included: head, its header's longest word; need, the
        narrowest it shows every cell whole (a ``no_wrap`` column's cells on one line, the others' longest
        words, the header's too); body, every cell but the header on one line; want, the header too."""
        pad = self._pad()
        if column.width is not None:
            return (column.width + pad,) * 4
        head = Measurement.get(console, options, column.header) if self.show_header else Measurement(0, 0)
        cells = [Measurement.get(console, options, cell) for cell in column.cells]
        need = max([head.minimum, *(m.maximum if column.no_wrap else m.minimum for m in cells)])
        body = max([need, *(m.maximum for m in cells)])
        return head.minimum + pad, need + pad, body + pad, max(body, head.maximum) + pad

    def _pad(self) -> int:
        _, right, _, left = self.padding
        return left + right

    def _border(self, columns: int) -> int:
        """The characters a row's box lines take beside its cells."""
        if not self.box:
            return 0
        return (2 if self.show_edge else 0) + max(columns - 1, 0)

    def _part(self, cols: list[int], title: RenderableType | None, caption: RenderableType | None) -> FitTable:
        """The table with only the columns ``cols``: cells that wrap at spaces, and fold only a word wider than
        the console (a number column's cells already have the width they need)."""
        part = copy.copy(self)
        part.columns, part.rows = [], []
        part.title, part.caption = title, caption
        for i in cols:
            c = self.columns[i]
            part.add_column(c.header, c.footer, header_style=c.header_style, highlight=c.highlight,
                            footer_style=c.footer_style, style=c.style, justify=c.justify, vertical=c.vertical,
                            overflow="fold", width=c.width, min_width=c.min_width, max_width=c.max_width,
                            ratio=c.ratio, no_wrap=False)
        cells = [list(c.cells) for c in self.columns]
        for r, row in enumerate(self.rows):
            part.add_row(*(cells[i][r] for i in cols), style=row.style, end_section=row.end_section)
        return part


def _spread(low: list[int], goal: list[int], room: int) -> list[int]:
    """Widths between ``low`` and ``goal`` that add up to at most ``room`` (at least sum(low)): the widest
    narrowed first, one column at a time, as rich narrows a table too wide for its console, but never below
    ``low``: the columns that wrap are the widest, each to about the same width."""
    widths = [max(g, lo) for lo, g in zip(low, goal)]
    for _ in range(sum(widths) - room):
        i = max((i for i in range(len(widths)) if widths[i] > low[i]), key=lambda i: widths[i])
        widths[i] -= 1
    return widths


def _balanced(items: list[int], costs: list[int], parts: int) -> list[list[int]]:
    """``items`` cut into ``parts`` runs, in order, the costliest run as cheap as can be."""
    n = len(items)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][j]: (the costliest run, where the last run starts) cutting the first j items into k runs
    best = [[(0, 0)] + [(float("inf"), 0)] * n]
    for k in range(1, parts + 1):
        row = [(float("inf"), 0)] * (n + 1)
        for j in range(k, n + 1):
            row[j] = min((max(best[-1][i][0], prefix[j] - prefix[i]), i) for i in range(k - 1, j))
        best.append(row)
    runs, j = [], n
    for k in range(parts, 0, -1):
        i = best[k][j][1]
        runs.append(items[i:j])
        j = i
    return runs[::-1]
