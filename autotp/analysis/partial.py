"""Where a row-parallel output's all-reduce can wait: the partial sums of several rows combined linearly.

Each rank's row-parallel matmul gives a partial sum of the full output. Ops linear in it keep it partial
(DTensor's ``Partial`` placement): a product with a replicated value, a sum of partial values, a view. The
experts of a mixture-of-experts layer are rows whose outputs are weighted by the router and summed::

    moe = 0 + w0 * down_0(..) + w1 * down_1(..) + ...     # (b, s, h), partial on every rank
    x = x + moe                                           # the residual is replicated: reduce before it

so one all-reduce after the sum replaces one per expert. A row's all-reduce moves to the single node where
its partial region ends; rows with a bias (added once, after the reduction) keep theirs. A learned factor
of a partial value (the router's weights) then gets a partial gradient on each rank: it enters through f
(all-reduce backward), once where the factors come from (b·s·E elements for all experts, against the
(E - 1)·b·s·h saved forward).
"""
from __future__ import annotations

from typing import NamedTuple

import sympy
import torch
import torch.fx as fx

from autotp.analysis.op_rules import is_cast, kind_of, op_rule
from autotp.analysis.ops import NO_OUTPUT, is_guard, reaches

aten = torch.ops.aten

def _unary_linear(t: object) -> bool:
    """Is an op's output partial when its one tensor operand is? Views, moves and row gathers of a partial
    sum (the op table's kinds), its negation and its sum over other dims."""
    return kind_of(t) in ("view", "flatten", "move", "index") or t in (aten.neg.default, aten.sum.dim_IntList)


def _linear_in(u: fx.Node, partial: set[fx.Node]) -> bool:
    """Is ``u`` linear in its partial operands, so that its output is partial too?"""
    tensors = [a for a in u.args if isinstance(a, fx.Node)]
    mine = [a for a in tensors if a in partial]
    if _unary_linear(u.target):  # (a sum over other dims, a gather of rows by replicated indices: linear too)
        return u.args[0] in partial and len(mine) == 1
    if is_cast(u.target) and u.args[0] in partial and len(mine) == 1:
        # a cast to the dtype the value has (as captured; kept for autocast): Σ a_r stays Σ a_r
        return _dtype(u.args[0]) is not None and _dtype(u.args[0]) == _dtype(u)
    if kind_of(u.target) == "cat":  # every piece partial (each expert's rows of its tokens, joined)
        return all(isinstance(a, fx.Node) and a in partial for a in u.args[0])
    if u.target is aten.index_add.default:
        # rows added into zeros at replicated indices (each token's k slots summed back, (b·s·k, h) -> (b·s, h)):
        # Σ_r of each rank's rows added is the sum of the rows
        return u.args[3] in partial and len(mine) == 1 and _zero(u.args[0]) and u.kwargs.get("alpha", 1) == 1
    if u.target is aten.einsum.default:  # a contraction with replicated operands: (Σ a_r)·w = Σ a_r·w
        return sum(a in partial for a in u.args[1]) == 1
    if u.target is aten.mul.Tensor or u.target is aten.div.Tensor:
        # one partial factor (the numerator), the rest replicated: (a1 + .. + at)·w = a1·w + .. + at·w; not one
        # that broadcasts it to more elements, whose all-reduce would cost more (HY-V4's hyper-connections write a
        # layer's (b, s, h) output into 4 residual streams, post (b, s, 4, 1) * out (b, s, 1, h))
        return len(mine) == 1 and (u.target is aten.mul.Tensor or u.args[0] in partial) and not u.kwargs \
            and not _smaller(mine[0], u)
    if u.target in (aten.add.Tensor, aten.sub.Tensor) or \
            (u.target is aten.add_.Tensor and len(u.args[0].users) == 1):
        # partial + partial; python's sum() starts from 0 and a loop from zeros, which add nothing. In place
        # (``shared.add_(routed)``, Llama 4's MoE) when nothing else reads the value written into
        others = [a for a in u.args[:2] if a not in partial]
        return all(_zero(a) for a in others) and u.kwargs.get("alpha", 1) == 1
    return False


def _dtype(n: fx.Node) -> torch.dtype | None:
    val = n.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}


def _zero(a: object) -> bool:
    """``0``, or a tensor of zeros made for the sum (``x.new_zeros(x.shape)``, ``torch.zeros_like(x)``)."""
    if isinstance(a, fx.Node):
        return a.target in _ZEROS or (a.target in (aten.fill_.Scalar, aten.full.default, aten.full_like.default,
                                                    aten.new_full.default) and a.args[-1] == 0)
    return not isinstance(a, (list, tuple)) and a == 0


class Deferred(NamedTuple):
    leave_at: dict[fx.Node, fx.Node]  # row -> the node after which its (shared) all-reduce runs
    # that node -> (reader, value): the learned factors of its partial sums, entering through f at their reader
    enter: dict[fx.Node, list[tuple[fx.Node, fx.Node]]]


def _picks(t: object) -> bool:
    """Does a factor pass through ``t`` from where it is computed to the product (``dense[..., e, None]``):
    a select, slice, view or expand, or a size-1 dim added or dropped?"""
    rule = op_rule(t)
    return rule is not None and (rule.kind in ("select", "slice", "view", "expand")
                                 or (rule.kind == "move" and rule.form in ("insert", "drop", "drop_ones")))


def _factor_root(r: fx.Node, learned) -> tuple[fx.Node | None, fx.Node]:
    """(reader, root): ``r`` followed back, through ops read by nothing else and linear in their one learned
    operand (picks, casts, sums, products with masks: ``(w * (sel == e)).sum(-1)``), to the value it is
    taken from (the routing weights of all experts); reader None when ``r`` is that value."""
    reader, node = None, r
    while node.op == "call_function" and len(node.users) == 1:
        src = _linear_source(node, learned)
        if src is None:
            break
        reader, node = node, src
    return reader, node


def _linear_source(node: fx.Node, learned) -> fx.Node | None:
    """The one learned operand ``node`` is linear in, or None."""
    t, args = node.target, node.args
    if _picks(t) or is_cast(t) or t is aten.sum.dim_IntList:
        return args[0] if isinstance(args[0], fx.Node) else None
    tensors = [a for a in args if isinstance(a, fx.Node)]
    if t in (aten.mul.Tensor, aten.div.Tensor):
        mine = [a for a in tensors if learned(a)]
        return mine[0] if len(mine) == 1 and (t is aten.mul.Tensor or mine[0] is args[0]) else None
    if t is aten.where.self and isinstance(args[1], fx.Node) and not learned(args[0]) \
            and (_zero(args[2]) or not learned(args[2])):
        return args[1] if learned(args[1]) else None
    return None


def deferred(rows: list[fx.Node], params: set[str]) -> Deferred:
    """:func:`deferred_leave`, and the learned factors the deferred rows' partial values are multiplied by."""
    leave_at = deferred_leave(rows)
    enter: dict[fx.Node, list[tuple[fx.Node, fx.Node]]] = {}

    def learned(x: object) -> bool:  # a floating value computed from parameters (a mask of the choice is not)
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        return isinstance(val, torch.Tensor) and val.dtype.is_floating_point \
            and reaches(x, lambda n: n.op == "get_attr" and n.target in params)

    for exit_ in dict.fromkeys(leave_at.values()):
        region = _region([r for r, e in leave_at.items() if e is exit_])
        found: dict[tuple[fx.Node, fx.Node], None] = {}
        for n in sorted(region, key=_order(region)):
            if n in leave_at or n.target not in (aten.mul.Tensor, aten.div.Tensor, aten.einsum.default):
                continue
            for r in n.all_input_nodes:
                if r not in region and learned(r):
                    reader, root = _factor_root(r, learned)
                    found[(reader, root) if reader is not None else (n, r)] = None
        enter[exit_] = list(found)
    return Deferred(leave_at, enter)


def _order(nodes):
    nodes = list(nodes)
    index = {n: i for i, n in enumerate(nodes[0].graph.nodes)} if nodes else {}
    return index.__getitem__


def _region(rows: list[fx.Node]) -> set[fx.Node]:
    """The values partial on every rank: the rows' outputs and what ops linear in them compute. A partial value
    that something else also reads is reduced there, so what is computed from it after is whole, not partial
    (Inkling 2's experts' combined output is read by a short convolution and added to its output: one all-reduce
    of b·s·h where the value branches, not one of the b·s·k·h rows before the combine)."""
    partial: set[fx.Node] = set(rows)
    grown = True
    while grown:
        grown = False
        for n in list(partial):
            for u in n.users:
                if u not in partial and u.op == "call_function" and _linear_in(u, partial):
                    partial.add(u)
                    grown = True
    for n in sorted(partial, key=_order(partial)):  # graph order: an earlier branch point cuts what follows it
        if n in partial and any(u not in partial and u.target not in NO_OUTPUT and not is_guard(u) for u in n.users):
            partial -= _after(n, partial)
    return partial


def _after(n: fx.Node, partial: set[fx.Node]) -> set[fx.Node]:
    """The nodes of ``partial`` computed from ``n`` (``n`` not included)."""
    out, todo = set(), [u for u in n.users if u in partial]
    while todo:
        u = todo.pop()
        if u not in out:
            out.add(u)
            todo.extend(v for v in u.users if v in partial)
    return out


def deferred_leave(rows: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """For rows (row-parallel matmuls without bias) whose outputs flow, through ops linear in them, into one
    node read by anything else: ``{row: that node}``. Rows that end apart, or whose region has more than one
    way out, are left out (their all-reduce stays after them)."""
    if not rows:
        return {}
    frontier = sorted(rows, key=_order(rows))
    partial = _region(rows)
    exits = {n for n in partial
             if any(u not in partial and u.target not in NO_OUTPUT and not is_guard(u) for u in n.users)}
    out: dict[fx.Node, fx.Node] = {}
    for row in frontier:
        # the exits this row's partial value reaches
        seen, todo, reached = set(), [row], set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in exits:
                reached.add(n)
            todo.extend(u for u in n.users if u in partial)
        if len(reached) == 1 and reached != {row}:
            out[row] = reached.pop()
    # an exit that only one row reaches gains nothing unless it is smaller (the k slots of each token summed)
    counts: dict[fx.Node, int] = {}
    for e in out.values():
        counts[e] = counts.get(e, 0) + 1
    return {r: e for r, e in out.items() if counts[e] > 1 or _smaller(e, r)}


def _smaller(a: fx.Node, b: fx.Node) -> bool:
    """Does ``a`` hold fewer elements than ``b`` at every size (a constant ratio above 1)?"""
    def expr(n: fx.Node):
        numel = n.meta["val"].numel()
        return numel.node.expr if isinstance(numel, torch.SymInt) else sympy.Integer(numel)

    ratio = sympy.simplify(expr(b) / expr(a))
    return bool(ratio.is_number and ratio > 1)
