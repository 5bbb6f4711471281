"""Matmuls no pair holds that read a row-parallel output whole: computed whole on every rank, as Megatron computes
what runs between a row's all-reduce and the next column.

Zamba2's hybrid layer projects its shared transformer's output, ``linear(down_proj(..))`` (h -> h), into the
residual stream, where a norm reads it before the next pair. Once ``down_proj`` is the row of the MLP's pair, the
linear's input is that row's all-reduced output, whole on every rank: it cannot be a row itself (its input is not
cut by features) and, its output joining the replicated stream, it is no column of a later pair. So it stays
whole, named as such, not reported as a block left replicated. So does the B of a low-rank adapter added to a row
projection (``o(y) + B(A(y))``): A reads the row's sharded input, row-parallel beside it, and B its all-reduced
``(b, s, r)`` output.

A linear may also read a row's output after the replicated ops between the pairs (a residual add, a norm, a
mean over the sequence): GIT projects its vision tower's normed output, ``LayerNorm(Linear(post_layernorm(x)))``
(h_v -> h), into the text tower, where the image tokens are joined to the token embeddings by ``cat`` along the
sequence before the text's first pair. Its input is whole on every rank, and its output reaches nothing but the
columns of later pairs (and a vocab-parallel LM head), each reading it whole through f: it is what runs between a
row's all-reduce and the next column, whole as well. Cut, its output would be gathered before the norm that reads
all its features. A linear whose output reaches any other matmul first is left as it was: a gap, not this."""
from __future__ import annotations

import torch
import torch.fx as fx

from autotp.analysis.matmuls import ParamMatmul
from autotp.analysis.op_rules import is_cast, kind_of
from autotp.analysis.pairs import Analysis

# what passes a value on unchanged but for its layout: views, dim moves, casts, a tuple's item
_THROUGH = ("view", "flatten", "move", "getitem")


def name_after_rows(a: Analysis, heads: frozenset[fx.Node] = frozenset()) -> None:
    """Move the generic 'outside every column→row pair' entry of each unpaired matmul of ``a.replicated`` that
    reads a row's output whole (:func:`row_read`, or :func:`stream_read` through the replicated ops between the
    pairs; ``heads``: the matmuls of the vocab-parallel LM heads) to ``a.by_design``, with that reason."""
    paired = {m.node for p in a.pairs for m in (*p.columns, p.row, *p.sides, *p.reduces)}
    for m in a.matmuls:
        if m.node in paired or m.expert is not None or m.kind == "embedding":
            continue
        entry = next((e for e in a.replicated if e[0] == m.module and e[1].startswith("linear kept whole")), None)
        if entry is None:
            continue
        row, through = row_read(m, a), ""
        if row is None and (found := stream_read(m, a, heads)) is not None:
            row, ops = found
            through = f", through {', '.join(ops)}"
        if row is None:
            continue
        a.replicated.remove(entry)
        shape, source = f"{m.in_features}→{m.out_features}", row.weight.removesuffix(".weight")
        a.by_design.append((m.module, (
            f"post-row linear kept whole: its {shape} linear reads the all-reduced output of the row-parallel "
            f"{source} whole (at {m.node.name}{through}), and no row-parallel matmul reads its output: every rank "
            f"computes it whole, as Megatron computes what runs between a row's all-reduce and the next column "
            f"(cutting it would add a gather of its {m.out_features} features)")))


def row_read(m: ParamMatmul, a: Analysis) -> ParamMatmul | None:
    """The paired row (or a row-parallel matmul beside it: a low-rank adapter's A on the same sharded input) whose
    output ``m`` reads through views, dim moves and casts of it alone; None where ``m``'s input is computed from
    anything else."""
    rows = {m.node: m for p in a.pairs for m in (p.row, *p.sides)}
    n = m.x
    while n not in rows:
        inputs = [x for x in n.all_input_nodes if isinstance(x.meta.get("val"), torch.Tensor)]
        if n.op != "call_function" or len(inputs) != 1 or not (kind_of(n.target) in _THROUGH or is_cast(n.target)):
            return None
        n = inputs[0]
    return rows[n]


def stream_read(m: ParamMatmul, a: Analysis, heads: frozenset[fx.Node]) -> tuple[ParamMatmul, list[str]] | None:
    """(the nearest row whose all-reduced output ``m`` reads, the ops on the way) when ``m``'s input is computed
    from rows' outputs by ops outside every pair's region (residual adds, norms, means: whole on every rank) with
    no matmul but an embedding on the way, and everything computed from ``m``'s output reaches only the columns of
    pairs and ``heads`` (each reading it whole through f) before any other matmul, the loss or the graph's
    output; None otherwise."""
    rows = {r.node: r for p in a.pairs for r in (p.row, *p.sides)}
    cut = {n for p in a.pairs for n in p.region.specs}
    matmuls = {x.node: x for x in a.matmuls}
    found: list[fx.Node] = []
    todo, after = [m.x], {m.x: None}  # a node -> the node it was reached from (nearer ``m``)
    while todo:  # back to the rows, breadth first: the nearest row names it
        n = todo.pop(0)
        if n in rows:
            found.append(n)
            continue
        if n in cut or (n in matmuls and matmuls[n].kind != "embedding"):
            return None  # a sharded value, or what a whole matmul computed: more than the stream between pairs
        if n.op != "call_function" or n in matmuls:
            continue
        for x in n.all_input_nodes:
            if isinstance(x.meta.get("val"), torch.Tensor) and x not in after:
                after[x] = n
                todo.append(x)
    columns = {c.node for p in a.pairs for c in p.columns}
    if not found or not _read_by_columns(m.node, columns | heads, set(matmuls)):
        return None
    ops, n = [], after[found[0]]
    while n is not None:  # the ops from the row to m, in the order they run
        ops.append(n.name)
        n = after[n]
    return rows[found[0]], ops


def _read_by_columns(node: fx.Node, readers: set[fx.Node], matmuls: set[fx.Node]) -> bool:
    """Does every path from ``node`` reach one of ``readers`` before any other matmul, the loss or the output?
    Ops that read only its shape (``ones_like``, ``new_zeros``: a mask made for its positions) are no reads."""
    todo, seen, reached = list(node.users), set(), False
    while todo:
        n = todo.pop()
        if n in seen or kind_of(n.target) in ("no_output", "sym_size", "like", "new_like"):
            continue
        seen.add(n)
        if n in readers:
            reached = True
            continue
        if n in matmuls or n.op == "output" or kind_of(n.target) in ("cross_entropy", "nll_loss"):
            return False
        todo.extend(n.users)
    return reached
