"""Pass: sharded values the graph returns (a KV cache's keys and values) go back full-shape, gathered
only when read.

Before::

    k = transpose(view(linear(x, w_k), [b, s, 2, 16]), 1, 2)   # (b, nh/t, s, hd) on each rank
    return (logits, loss, k)

After::

    k_out = autotp_gather_output_k(k)                          # (b, nh, s, hd) gathered on first read
    return (logits, loss, k_out)

A training step that ignores the returned cache moves nothing; the gather is bound to the group by the
runtime (:class:`~autotp.operators.gathered.GatherOutput`), so this pass stays rank-free.
"""
from __future__ import annotations

import torch.fx as fx

from autotp.operators.gathered import GatherOutput
from autotp.plan.plan import Plan
from autotp.shard_spec import shard_tensor, unshard_tensor


def gather_outputs(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    if not plan.gathered:
        return gm
    nodes = {n.name: n for n in gm.graph.nodes}
    output = gm.graph.output_node()
    for g in plan.gathered:
        node, segs, dim = nodes[g.node], g.segments, g.dim
        target = f"autotp_gather_output_{g.node}"
        gm.add_submodule(target, GatherOutput(
            dim, sum(s.size for s in segs),
            lambda shards, tp, dim=dim, segs=segs: unshard_tensor(shards, dim, segs, tp),
            lambda grad, rank, dim=dim, segs=segs: shard_tensor(grad, dim, segs, plan.tp, rank)))
        # beside the value it wraps: a block's cache stays among the block's nodes (capture copies blocks)
        at = gm.graph.inserting_before(output) if node.op == "placeholder" else gm.graph.inserting_after(node)
        with at:
            wrapped = gm.graph.call_module(target, (node,))
        wrapped.meta = dict(node.meta)
        output.replace_input_with(node, wrapped)
    return gm
