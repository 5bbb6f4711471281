"""Pass: rewrite the integer constants that sharding changes (view/reshape/expand/split sizes).

Before (tp = 2, 4 heads of 16)::

    view = aten.view(getitem, [s0, s1, 4, 16])
    split = aten.split(linear, 64, 2)
    mul = operator.mul(s0, 4)                        # b * n_heads, computed at run time
    reshape = aten.reshape(transpose, [mul, s1, 16])

After::

    view = aten.view(getitem, [s0, s1, 2, 16])
    split = aten.split(linear, 32, 2)
    mul_local = operator.mul(s0, 2)                  # this view's own copy: other readers keep ``mul``
    reshape = aten.reshape(transpose, [mul_local, s1, 16])

A size computed at run time another way (``floordiv(mul, 2)``: kv heads folded by ``q.shape[0] // n_rep``) is
inferred by the view from the rank's own elements: ``aten.reshape(k, [-1, s1, 16])``.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from autotp.plan.plan import Plan


def rewrite_constants(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    nodes = {n.name: n for n in gm.graph.nodes}
    for r in plan.rewrites:
        node = nodes[r.node]
        if isinstance(r.arg, str):  # a keyword-only argument
            if r.index is not None or node.kwargs.get(r.arg) != r.old:
                raise ValueError(f"{r.node}: expected {r.old} as {r.arg}, found {node.kwargs.get(r.arg)}")
            node.kwargs = {**node.kwargs, r.arg: r.new}
            continue
        args = list(node.args)
        if r.index is None:
            if args[r.arg] != r.old:
                raise ValueError(f"{r.node}: expected {r.old} at arg {r.arg}, found {args[r.arg]}")
            args[r.arg] = r.new
        else:
            seq = list(args[r.arg])
            if r.factor_of is not None:
                seq[r.index] = _scaled_size(gm, node, seq[r.index], r.factor_of, r.old, r.new)
            elif r.inferred is not None:  # a size computed at run time: the view infers this rank's (-1)
                if not (isinstance(seq[r.index], fx.Node) and seq[r.index].name == r.inferred):
                    raise ValueError(f"{r.node}: expected the size {r.inferred} at arg {r.arg}[{r.index}], "
                                     f"found {seq[r.index]}")
                seq[r.index] = r.new
            elif seq[r.index] != r.old:
                raise ValueError(f"{r.node}: expected {r.old} at arg {r.arg}[{r.index}], found {seq[r.index]}")
            else:
                seq[r.index] = r.new
            args[r.arg] = seq
        node.args = tuple(args)
    return gm


def _scaled_size(gm: fx.GraphModule, user: fx.Node, size: object, name: str, old: int, new: int) -> fx.Node:
    if not (isinstance(size, fx.Node) and size.name == name and size.target is operator.mul and old in size.args):
        raise ValueError(f"{user.name}: expected {name} = x * {old}, found {size}")
    x = size.args[1] if size.args[0] == old else size.args[0]
    with gm.graph.inserting_before(user):
        local = gm.graph.call_function(operator.mul, (x, new))
    local.meta = {k: v for k, v in size.meta.items() if k != "val"}
    return local
