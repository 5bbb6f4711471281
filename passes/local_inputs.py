"""Pass: graph inputs taken as this rank's shard (a KV cache's past keys and values, fed back from the last
call) are declared with their local size, so the exported module's input check accepts the shards.

Before::

    past_k: f32[b, 4, p, 16]                   # as captured: all kv heads
    k = cat([past_k, k_new], 2)                # k_new: (b, 4/t, s, 16) on each rank

After::

    past_k: f32[b, 4/t, p, 16]                 # the runtime passes its local shard
    k = cat([past_k, k_new], 2)                # (b, 4/t, p+s, 16)

The runtime hands the graph the shard (:func:`autotp.parallel.parallelize._local_input`); this pass only changes the
declared shape, from the plan's segments, and never reads the rank. The exported module's guard function
would compare the shard's head count with the captured one, so this graph drops it; the input check that
remains (ranks, dtypes, the declared sizes and the ranges of the dynamic ones) still runs on every call.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autotp.plan.plan import Plan


def local_inputs(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    nodes = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for s in plan.sharded_inputs:
        node = nodes[s.node]
        val = node.meta["val"]
        shape = list(val.shape)
        shape[s.dim] = sum(g.local() for g in s.segments)
        with val.fake_mode:
            node.meta["val"] = torch.empty(shape, dtype=val.dtype, device=val.device)
    if plan.sharded_inputs:
        for node in [n for n in gm.graph.nodes if n.op == "call_module" and str(n.target).startswith("_guards")]:
            gm.graph.erase_node(node)
    return gm
