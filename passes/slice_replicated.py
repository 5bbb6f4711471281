"""Pass: a replicated operand that spans a sharded dim is cut to this rank's slice where it meets the
sharded value (Replicate -> Shard: no communication).

Before::

    bias = mul(slopes_3d, distance)              # (nh, s, s), replicated: per-head ALiBi bias
    scores = add(att, bias)                      # att: (b, nh/t, s, s) on each rank

After::

    bias_local = autotp_local_slice_0(bias)      # (nh/t, s, s): this rank's heads
    scores = add(att, bias_local)

A value that needs a gradient (computed from parameters) is sliced after the ``f`` that insert_collectives put
on it for the consumer: each rank's gradient is its own slice's, zero elsewhere, and f's all-reduce sums the
pieces into the whole value's gradient::

    x_tp = autotp_enter(x)                       # (b, s, d_pl), whole: f
    x_local = autotp_local_slice_1(x_tp)         # (b, s, d_pl/t)
    y = mul(gate, x_local)

The slice module is bound to the rank at run time, so the pass never reads it.
"""
from __future__ import annotations

import torch.fx as fx

from autotp.operators.gathered import LocalSliceOp
from autotp.passes.insert_collectives import ENTER
from autotp.plan.plan import Plan


def slice_replicated(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    nodes = {n.name: n for n in gm.graph.nodes}
    for i, s in enumerate(plan.local_slices):
        consumer, operand = nodes[s.consumer], _read(nodes[s.consumer], nodes[s.operand])
        target = f"autotp_local_slice_{i}"
        gm.add_submodule(target, LocalSliceOp(s.dim, s.segments, s.outer))
        with gm.graph.inserting_before(consumer):
            cut = gm.graph.call_module(target, (operand,))
        consumer.replace_input_with(operand, cut)
    return gm


def _read(consumer: fx.Node, operand: fx.Node) -> fx.Node:
    """What ``consumer`` reads of ``operand``: the operand itself, or the f it enters the region through."""
    if operand in consumer.all_input_nodes:
        return operand
    return next((a for a in consumer.all_input_nodes if a.op == "call_module" and a.target == ENTER
                 and a.args[0] is operand), operand)
