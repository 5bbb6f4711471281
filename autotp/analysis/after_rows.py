"""Matmuls no pair holds that read a row-parallel output whole: computed whole on every rank, as Megatron computes
what runs between a row's all-reduce and the next column.

Zamba2's hybrid layer projects its shared transformer's output, ``linear(down_proj(..))`` (h -> h), into the
residual stream, where a norm reads it before the next pair. Once ``down_proj`` is the row of the MLP's pair, the
linear's input is that row's all-reduced output, whole on every rank: it cannot be a row itself (its input is not
cut by features) and, its output joining the replicated stream, it is no column of a later pair. So it stays
whole, named as such, not reported as a block left replicated. So does the B of a low-rank adapter added to a row
projection (``o(y) + B(A(y))``): A reads the row's sharded input, row-parallel beside it, and B its all-reduced
``(b, s, r)`` output."""
from __future__ import annotations

import torch
import torch.fx as fx

from autotp.analysis.matmuls import ParamMatmul
from autotp.analysis.op_rules import is_cast, kind_of
from autotp.analysis.pairs import Analysis

# what passes a value on unchanged but for its layout: views, dim moves, casts, a tuple's item
_THROUGH = ("view", "flatten", "move", "getitem")


def name_after_rows(a: Analysis) -> None:
    """Move the generic 'outside every column→row pair' entry of each unpaired matmul of ``a.replicated`` that
    reads a row's output whole (:func:`row_read`) to ``a.by_design``, with that reason."""
    paired = {m.node for p in a.pairs for m in (*p.columns, p.row, *p.sides, *p.reduces)}
    for m in a.matmuls:
        if m.node in paired or m.expert is not None or m.kind == "embedding":
            continue
        row = row_read(m, a)
        entry = next((e for e in a.replicated if e[0] == m.module and e[1].startswith("linear kept whole")), None)
        if row is None or entry is None:
            continue
        a.replicated.remove(entry)
        shape, source = f"{m.in_features}→{m.out_features}", row.weight.removesuffix(".weight")
        a.by_design.append((m.module, (
            f"post-row linear kept whole: its {shape} linear reads the all-reduced output of the row-parallel "
            f"{source} whole (at {m.node.name}), and no row-parallel matmul reads its output: every rank computes it "
            f"whole, as Megatron computes what runs between a row's all-reduce and the next column (cutting it would "
            f"add a gather of its {m.out_features} features)")))


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
