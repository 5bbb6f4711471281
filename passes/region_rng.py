"""Pass: run random ops of sharded regions on the per-rank region stream.

Before::

    att = aten.dropout(softmax, 0.1, True)           # att: (b, nh/t, s, s), local heads

After::

    att = autotp_rng_dropout(softmax, 0.1, True)     # RegionRandom(aten.dropout): draws from RegionRNG
"""
from __future__ import annotations

import torch.fx as fx

from autotp.plan.plan import Plan
from autotp.operators.rng import RegionRandom


def region_rng(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    nodes = {n.name: n for n in gm.graph.nodes}
    for name in plan.random_nodes:
        node = nodes[name]
        target = f"autotp_rng_{name}"
        gm.add_submodule(target, RegionRandom(node.target))
        node.op = "call_module"
        node.target = target
    return gm
