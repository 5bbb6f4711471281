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
from autotp.matmuls import _is_2d_transpose
from autotp.plan import Plan

aten = torch.ops.aten
_TRANSPOSES = {aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default}

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
            users = [c for c in columns if x in c.all_input_nodes]
            forms = [_form(c, x) for c in users]
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


def _is_attr(n: object) -> bool:
    return isinstance(n, fx.Node) and n.op == "get_attr"


def _form(c: fx.Node, x: fx.Node) -> tuple[str, fx.Node, fx.Node | None] | None:
    """(layout, weight, bias) of a column matmul reading ``x``, if it is one ColumnGroup computes as is."""
    args, t = c.args, c.target
    if c.kwargs or sum(a is x for a in args) != 1:
        return None
    if t is aten.linear.default and args[0] is x and _is_attr(args[1]):
        bias = args[2] if len(args) > 2 else None
        return ("out_in", args[1], bias) if bias is None or _is_attr(bias) else None
    if t is aten.addmm.default and len(args) == 3 and args[1] is x and _is_attr(args[2]) and _is_attr(args[0]):
        return "in_out", args[2], args[0]
    if t in (aten.mm.default, aten.matmul.default) and args[0] is x and isinstance(args[1], fx.Node):
        w = args[1]
        if _is_attr(w):
            return "in_out", w, None
        if w.target in _TRANSPOSES and _is_2d_transpose(w) and len(w.users) == 1 and _is_attr(w.args[0]):
            return "out_in", w.args[0], None
    return None


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
