"""Pass: insert Megatron's conjugate operators around every column→row pair.

Before::

    ln = aten.layer_norm(x, ...)
    fc = aten.linear(ln, c_fc_weight, c_fc_bias)         # column
    act = aten.gelu(fc)
    out = aten.linear(act, c_proj_weight, c_proj_bias)    # row
    y = aten.add(x, out)

After::

    ln = aten.layer_norm(x, ...)
    ln_tp = autotp_enter(ln)                              # f: identity fwd, all-reduce bwd
    fc = aten.linear(ln_tp, c_fc_weight, c_fc_bias)
    act = aten.gelu(fc)
    out = aten.linear(act, c_proj_weight, c_proj_bias)
    out_tp = autotp_leave(out)                            # g: all-reduce fwd, identity bwd
    y = aten.add(x, out_tp)

Columns sharing one input share one ``f`` (q, k and v: one all-reduce backward, not three).
"""
from __future__ import annotations

import torch.fx as fx

from autotp.collectives import EnterTP, LeaveTP
from autotp.plan import Plan

ENTER = "autotp_enter"
LEAVE = "autotp_leave"


def insert_collectives(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    if not plan.pairs:
        return gm
    if not hasattr(gm, ENTER):
        gm.add_submodule(ENTER, EnterTP())
        gm.add_submodule(LEAVE, LeaveTP())
    nodes = {n.name: n for n in gm.graph.nodes}
    for pair in plan.pairs:
        columns = [nodes[c] for c in pair.columns]
        for x_name in pair.enter:
            x = nodes[x_name]
            users = [c for c in columns if x in c.all_input_nodes]
            with gm.graph.inserting_before(min(users, key=_position(gm))):
                f = gm.graph.call_module(ENTER, (x,))
            f.meta = {**x.meta, "autotp_collective": ("enter", pair.module)}
            for c in users:
                c.replace_input_with(x, f)
        row = nodes[pair.row]
        with gm.graph.inserting_after(row):
            g = gm.graph.call_module(LEAVE, (row,))
        g.meta = {**row.meta, "autotp_collective": ("leave", pair.module)}
        row.replace_all_uses_with(g, delete_user_cb=lambda u: u is not g)
    return gm


def _position(gm: fx.GraphModule):
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda n: index[n]
