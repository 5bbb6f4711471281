"""Pass: add a row-parallel bias once, after the all-reduce, instead of on every rank's partial sum.

Before::

    out = aten.linear(act, w, b)          # or aten.addmm(b, act, w)
    out_tp = autotp_leave(out)

After::

    out = aten.linear(act, w)             # or aten.mm(act, w)
    out_tp = autotp_leave(out)
    out_b = aten.add(out_tp, b)

With sequence parallelism the reduce-scatter may follow a view of the row's output (GPT-2's flat
``[b·s, h] -> [b, s, h]``); the bias is added after it, to this rank's s/t positions.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autotp.plan.plan import Plan

aten = torch.ops.aten


def row_bias_after_reduce(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    nodes = {n.name: n for n in gm.graph.nodes}
    for pair in plan.pairs:
        if pair.row_bias is None:
            continue
        row = nodes[pair.row]
        if row.target is aten.linear.default:
            bias = row.args[2]
            row.args = (row.args[0], row.args[1])
        elif row.target is aten.addmm.default:
            bias = row.args[0]
            row.target = aten.mm.default
            row.args = (row.args[1], row.args[2])
        else:
            raise ValueError(f"{row.name}: cannot detach a bias from {row.target}")
        leave = row
        while "autotp_collective" not in leave.meta:  # g, or a reduce-scatter after a view of the row
            (leave,) = leave.users
        with gm.graph.inserting_after(leave):
            add = gm.graph.call_function(aten.add.Tensor, (leave, bias))
        add.meta = dict(leave.meta)
        leave.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
    return gm
