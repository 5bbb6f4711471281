"""Pass: a replicated operand that spans a sharded dim is cut to this rank's slice where it meets the
sharded value (Replicate -> Shard: no communication).

Before::

    bias = mul(slopes_3d, distance)              # (nh, s, s), replicated: per-head ALiBi bias
    scores = add(att, bias)                      # att: (b, nh/t, s, s) on each rank

After::

    bias_local = autotp_local_slice_0(bias)      # (nh/t, s, s): this rank's heads
    scores = add(att, bias_local)

The planner allows it only for values that need no gradient (built from buffers, constants and inputs).
The slice module is bound to the rank at run time, so the pass never reads it.
"""
from __future__ import annotations

import torch.fx as fx

from autotp.operators.gathered import LocalSliceOp
from autotp.plan.plan import Plan


def slice_replicated(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    nodes = {n.name: n for n in gm.graph.nodes}
    for i, s in enumerate(plan.local_slices):
        consumer, operand = nodes[s.consumer], nodes[s.operand]
        target = f"autotp_local_slice_{i}"
        gm.add_submodule(target, LocalSliceOp(s.dim, s.segments, s.outer))
        with gm.graph.inserting_before(consumer):
            cut = gm.graph.call_module(target, (operand,))
        consumer.replace_input_with(operand, cut)
    return gm
