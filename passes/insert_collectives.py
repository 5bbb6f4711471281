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

Columns sharing one input share one ``f`` (q, k and v: one all-reduce backward, not three). A
vocab-parallel LM head is a column too: its input gets ``f``. A replicated value computed from parameters
that meets sharded heads inside the pair (a per-head q/k norm's weight) gets ``f`` as well: each rank's
gradient for it covers its own heads only.
"""
from __future__ import annotations

import torch.fx as fx

from autotp.collectives import EnterTP, LeaveTP
from autotp.plan import Plan

ENTER = "autotp_enter"
LEAVE = "autotp_leave"


def ensure_collective_modules(gm: fx.GraphModule) -> None:
    if not hasattr(gm, ENTER):
        gm.add_submodule(ENTER, EnterTP())
        gm.add_submodule(LEAVE, LeaveTP())


def insert_collectives(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    if not plan.pairs and not plan.vocab.heads:
        return gm
    ensure_collective_modules(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    for head, x_name in plan.vocab.heads:
        _enter(gm, nodes[x_name], [nodes[head]], head)
    for pair in plan.pairs:
        columns = [nodes[c] for c in pair.columns]
        for x_name in pair.enter:
            x = nodes[x_name]
            _enter(gm, x, [c for c in columns if x in c.all_input_nodes], pair.module)
        for consumer, x_name in pair.also_enter:
            _enter(gm, nodes[x_name], [nodes[consumer]], pair.module)
        row = nodes[pair.row]
        with gm.graph.inserting_after(row):
            g = gm.graph.call_module(LEAVE, (row,))
        g.meta = {**row.meta, "autotp_collective": ("leave", pair.module)}
        row.replace_all_uses_with(g, delete_user_cb=lambda u: u is not g)
    return gm


def _enter(gm: fx.GraphModule, x: fx.Node, users: list[fx.Node], where: str) -> None:
    with gm.graph.inserting_before(min(users, key=_position(gm))):
        f = gm.graph.call_module(ENTER, (x,))
    f.meta = {**x.meta, "autotp_collective": ("enter", where)}
    for c in users:
        c.replace_input_with(x, f)


def _position(gm: fx.GraphModule):
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda n: index[n]
