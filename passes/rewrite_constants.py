"""Pass: rewrite the integer constants that sharding changes (view/reshape/expand/split sizes).

Before (tp = 2, 4 heads of 16)::

    view = aten.view(getitem, [s0, s1, 4, 16])
    split = aten.split(linear, 64, 2)

After::

    view = aten.view(getitem, [s0, s1, 2, 16])
    split = aten.split(linear, 32, 2)
"""
from __future__ import annotations

import torch.fx as fx

from autotp.plan import Plan


def rewrite_constants(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    nodes = {n.name: n for n in gm.graph.nodes}
    for r in plan.rewrites:
        node = nodes[r.node]
        args = list(node.args)
        if r.index is None:
            if args[r.arg] != r.old:
                raise ValueError(f"{r.node}: expected {r.old} at arg {r.arg}, found {args[r.arg]}")
            args[r.arg] = r.new
        else:
            seq = list(args[r.arg])
            if seq[r.index] != r.old:
                raise ValueError(f"{r.node}: expected {r.old} at arg {r.arg}[{r.index}], found {seq[r.index]}")
            seq[r.index] = r.new
            args[r.arg] = seq
        node.args = tuple(args)
    return gm
