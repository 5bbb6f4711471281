"""Pass: whole experts per rank (``plan.experts``): every read of an expert parameter reads this rank's block.

Before (a loop over the experts of ``w1 [E, I, h]``, ``w2 [E, h, I]``)::

    select = aten.select.int(w1, 0, 2)                  # expert 2
    h = aten.silu(aten.matmul(x, aten.t(select)))       # (T, I)
    y = aten.linear(h, aten.select.int(w2, 0, 2))       # (T, h)
    out = aten.add(out, aten.mul(we, y))

After (``w1``, ``w2`` hold E/t experts)::

    x_2 = autotp_expert_rows_2(x)                       # x, or no rows where expert 2 is another rank's
    select = autotp_expert_select_2(w1)                 # w1[2 - r·E/t], or zeros
    h = aten.silu(aten.matmul(x_2, aten.t(select)))
    y = aten.linear(h, autotp_expert_select_2(w2))
    y_2 = autotp_expert_out_2(y, x)                     # y, or (T, h) zeros
    out = aten.add(out, aten.mul(we, y_2))              # the layer's all-reduce sums the ranks' experts

Per-slot reads ``aten.index.Tensor(w, [ids])`` become ``autotp_expert_index(w, ids)`` (zeros for other ranks'
experts); a grouped GEMM ``grouped_mm(x, w, offs)`` becomes ``autotp_expert_grouped_k(x, w, offs)`` (this rank's
experts' rows, zeros elsewhere).
"""
from __future__ import annotations

import torch.fx as fx

from autotp.plan.plan import Plan
from autotp.operators.expert_ops import ExpertGrouped, ExpertIndex, ExpertOut, ExpertRows, ExpertSelect

INDEX = "autotp_expert_index"


def _module(gm: fx.GraphModule, name: str, make) -> str:
    if not hasattr(gm, name):
        gm.add_submodule(name, make())
    return name


def _replace(node: fx.Node, target: str, args: tuple, kwargs: dict | None = None) -> None:
    """``node`` becomes a call of module ``target`` under its own name (what reads it is unchanged)."""
    node.op, node.target, node.args, node.kwargs = "call_module", target, args, kwargs or {}


def _entered(x: fx.Node, names: set[str]) -> bool:
    """``x`` is one of ``names``, or the f (identity forward) that a pair put on it."""
    return x.name in names or (x.op == "call_module" and bool(x.args) and isinstance(x.args[0], fx.Node)
                               and x.args[0].name in names and "autotp_collective" in x.meta)


def expert_parallel(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    if not plan.experts:
        return gm
    nodes = {n.name: n for n in gm.graph.nodes}
    for layer in plan.experts:
        for slot in layer.slots:
            _slot(gm, slot, layer.count, nodes)
        for name, e in layer.selects:
            node = nodes[name]
            _replace(node, _module(gm, f"autotp_expert_select_{e}", lambda e=e: ExpertSelect(e)), (node.args[0],))
        for name in layer.indexes:
            node = nodes[name]
            _replace(node, _module(gm, INDEX, ExpertIndex), (node.args[0], node.args[1][0]))
        for name in layer.grouped:
            node = nodes[name]
            target = f"autotp_expert_grouped_{name}"
            gm.add_submodule(target, ExpertGrouped(node.target))
            kwargs = dict(node.kwargs)
            offs = node.args[2] if len(node.args) > 2 else kwargs.pop("offs")
            _replace(node, target, (node.args[0], node.args[1], offs, *node.args[3:]), kwargs)
    return gm


def _slot(gm: fx.GraphModule, slot, count: int, nodes: dict[str, fx.Node]) -> None:
    rows_target = _module(gm, f"autotp_expert_rows_{slot.expert}", lambda: ExpertRows(slot.expert, count))
    members = [nodes[n] for n in slot.nodes]
    inside = set(members)
    masked: dict[fx.Node, fx.Node] = {}
    for n in members:
        for x in list(n.all_input_nodes):
            if x in inside or not _entered(x, set(slot.rows)):
                continue
            if x not in masked:
                with gm.graph.inserting_after(x):
                    masked[x] = gm.graph.call_module(rows_target, (x,))
                masked[x].meta = dict(x.meta)
            n.replace_input_with(x, masked[x])
    out = nodes[slot.out]
    ref = next(iter(masked))
    out_target = _module(gm, f"autotp_expert_out_{slot.expert}", lambda: ExpertOut(slot.expert, count))
    with gm.graph.inserting_after(out):
        back = gm.graph.call_module(out_target, (out, ref))
    back.meta = dict(out.meta)
    out.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
