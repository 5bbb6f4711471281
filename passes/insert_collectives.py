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

Columns sharing one input share one ``f`` (q, k and v: one all-reduce backward, not three), fused with
them into one :class:`~autotp.collectives.ColumnGroup` where their forms are plain (``linear``, ``addmm``,
``mm``/``matmul`` by a parameter or its transpose), so that the input gradient's all-reduce overlaps the
weight gradients::

    cols = autotp_columns_0(ln, q_weight, None, k_weight, None, v_weight, None)   # f + q, k, v
    q, k, v = cols[0], cols[1], cols[2]

A
vocab-parallel LM head is a column too: its input gets ``f``. A replicated value computed from parameters
that meets sharded heads inside the pair (a per-head q/k norm's weight) gets ``f`` as well: each rank's
gradient for it covers its own heads only.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autotp.collectives import ColumnGroup, EnterTP, LeaveTP
from autotp.matmuls import match_param_matmul
from autotp.plan import Plan

aten = torch.ops.aten

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
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    for head, x_name in plan.vocab.heads:
        _enter(gm, nodes[x_name], [nodes[head]], head)
    for pair in plan.pairs:
        columns = [nodes[c] for c in pair.columns]
        for x_name in pair.enter:
            x = nodes[x_name]
            users = [c for c in columns if x in c.all_input_nodes]
            forms = [_form(gm, c, x, params) for c in users]
            if all(forms):
                _fuse(gm, x, users, forms, pair.module)
            else:
                _enter(gm, x, users, pair.module)
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


def _form(gm: fx.GraphModule, c: fx.Node, x: fx.Node, params: set[str]) -> tuple[str, fx.Node, object] | None:
    """(layout, weight node, bias node) of a column matmul reading ``x`` once, as matmuls.py recognises it."""
    pm = match_param_matmul(gm, c, params)
    if pm is None or pm.x is not x or c.kwargs or sum(a is x for a in c.args) != 1:
        return None
    weight = pm.transpose.args[0] if pm.transpose is not None else c.args[2 if pm.kind == "addmm" else 1]
    bias = c.args[0] if pm.kind == "addmm" else c.args[2] if pm.kind == "linear" and len(c.args) > 2 else None
    return ("out_in" if pm.out_dim == 0 else "in_out"), weight, bias


def _fuse(gm: fx.GraphModule, x: fx.Node, columns: list[fx.Node], forms: list, where: str) -> None:
    target = f"autotp_columns_{sum(isinstance(m, ColumnGroup) for m in gm.modules())}"
    gm.add_submodule(target, ColumnGroup(tuple(f[0] for f in forms)))
    first = min(columns, key=_position(gm))
    with gm.graph.inserting_before(first):
        group = gm.graph.call_module(target, (x, *[a for _, w, b in forms for a in (w, b)]))
        group.meta = {**x.meta, "autotp_collective": ("enter", where),
                      "val": tuple(c.meta.get("val") for c in columns)}
        outs = []
        for i, c in enumerate(columns):
            outs.append(gm.graph.call_function(operator.getitem, (group, i)))
            outs[-1].meta = dict(c.meta)
    for c, o, (_, w, _) in zip(columns, outs, forms):
        c.replace_all_uses_with(o)
        weight_view = c.args[1] if c.target in (aten.mm.default, aten.matmul.default) else None
        gm.graph.erase_node(c)
        if weight_view is not None and weight_view is not w and not weight_view.users:
            gm.graph.erase_node(weight_view)


def _position(gm: fx.GraphModule):
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda n: index[n]
