"""Matmuls no pair holds whose output gates a row-parallel output elementwise: computed whole on every rank, the
gate applied after the row's all-reduce.

RWKV's feed-forward (its "channel mixing") is ``sigmoid(receptance(xr)) * value(relu(key(xk)) ** 2)``: key
(h -> 4h) column-parallel and value (4h -> h) row-parallel are a pair, and the receptance (h -> h) multiplies the
value's all-reduced ``(b, s, h)`` output elementwise. Every rank computes it whole from the whole input, so the
product is the single device's with no collective of its own; cut, it would need the row's output reduce-scattered
and the product gathered. Named as such, not reported as a linear left outside every pair."""
from __future__ import annotations

import torch
import torch.fx as fx

from autotp.analysis.matmuls import ParamMatmul
from autotp.analysis.op_rules import is_cast, kind_of, op_rule
from autotp.analysis.pairs import Analysis

# what passes a value on unchanged but for its layout: views, dim moves, casts
_THROUGH = ("view", "flatten", "move")


def name_row_gates(a: Analysis) -> None:
    """Move the generic 'outside every column→row pair' entry of each unpaired matmul of ``a.replicated`` whose
    output gates a row's all-reduced output (:func:`gated_row`) to ``a.by_design``, with that reason."""
    paired = {m.node for p in a.pairs for m in (*p.columns, p.row, *p.sides, *p.reduces)}
    rows = {m.node: m for p in a.pairs for m in (p.row, *p.sides) if m.node not in a.leave_at}
    for m in a.matmuls:
        if m.node in paired or m.expert is not None or m.kind == "embedding":
            continue
        entry = next((e for e in a.replicated if e[0] == m.module and e[1].startswith("linear kept whole")), None)
        found = gated_row(m, rows) if entry is not None else None
        if found is None:
            continue
        row, mul, acts = found
        a.replicated.remove(entry)
        through = f" through {', '.join(acts)}" if acts else ""
        a.by_design.append((m.module, (
            f"gate kept whole: its {m.in_features}→{m.out_features} linear{through} multiplies the all-reduced "
            f"output of the row-parallel {row.weight.removesuffix('.weight')} elementwise (at {mul.name}): every "
            f"rank computes it whole and gates the whole sum, with no collective of its own (cut, the row's output "
            f"would be reduce-scattered and the product gathered)")))


def gated_row(m: ParamMatmul, rows: dict[fx.Node, ParamMatmul]) -> tuple[ParamMatmul, fx.Node, list[str]] | None:
    """(the row, the product, the activations on the way) when ``m``'s output, through single-input pointwise
    ops and casts of it alone (``sigmoid``), is read by one elementwise product whose other operand is a row's
    output through views and casts alone; None otherwise."""
    n, acts = m.node, []
    while True:
        users = [u for u in n.users if kind_of(u.target) not in ("no_output", "sym_size")]
        if len(users) != 1 or users[0].op != "call_function":
            return None
        u = users[0]
        inputs = [x for x in u.all_input_nodes if isinstance(x.meta.get("val"), torch.Tensor)]
        rule = op_rule(u.target)
        if rule is not None and rule.scales and len(inputs) == 2 and inputs.count(n) == 1:  # a product
            row = _row_of(next(x for x in inputs if x is not n), rows)
            return (row, u, acts) if row is not None and _same_shape(u, n) else None
        if len(inputs) != 1 or rule is None or not (rule.kind == "pointwise" or is_cast(u.target)):
            return None
        if not is_cast(u.target):
            acts.append(getattr(u.target, "__name__", str(u.target)).split(".")[0])
        n = u


def _row_of(n: fx.Node, rows: dict[fx.Node, ParamMatmul]) -> ParamMatmul | None:
    """The row whose output ``n`` is, through views, dim moves and casts of it alone."""
    while n not in rows:
        inputs = [x for x in n.all_input_nodes if isinstance(x.meta.get("val"), torch.Tensor)]
        if n.op != "call_function" or len(inputs) != 1 or not (kind_of(n.target) in _THROUGH or is_cast(n.target)):
            return None
        n = inputs[0]
    return rows[n]


def _same_shape(product: fx.Node, gate: fx.Node) -> bool:
    """Is the product as large as the gate (an elementwise gate, not one reduced by broadcasting)?"""
    a, b = product.meta.get("val"), gate.meta.get("val")
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tuple(a.shape) == tuple(b.shape)
