"""Pass: sum the gradients of parameters applied to sequence slices over the tensor-parallel group.

With sequence parallelism a norm's weight, or a row-parallel bias added after the reduce-scatter, sees
only this rank's s/t positions: its gradient on each rank is partial. All of them pass through one
:class:`~autotp.operators.seq_ops.SumGrads` (identity forward; one all-reduce of every such gradient, flattened
together, backward), as Megatron all-reduces its sequence-parallel parameters' gradients in one bucket.
A value computed from parameters (not a parameter itself) gets its own ``f`` instead.

Before::

    ln = aten.layer_norm(x, [64], ln_1_weight, ln_1_bias)         # x: (b, s/t, h)
    out = aten.linear(act, c_proj_weight, c_proj_bias)            # row; its bias joins after the reduce-scatter

After::

    sp = autotp_seq_grads(ln_1_weight, ln_1_bias, c_proj_bias, ...)
    ln = aten.layer_norm(x, [64], sp[0], sp[1])
    out = aten.linear(act, c_proj_weight, sp[2])

Runs before the pairs' collectives are inserted (row_bias_after_reduce then moves ``sp[2]``).
"""
from __future__ import annotations

import operator

import torch.fx as fx

from autotp.operators.collectives import EnterTP
from autotp.plan.plan import Plan
from autotp.operators.seq_ops import SumGrads

TARGET = "autotp_seq_grads"


def sequence_grads(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    seq = plan.sequence
    if seq is None or not (seq.grads or seq.enter_grads):
        return gm
    nodes = {n.name: n for n in gm.graph.nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if seq.grads:
        params = list(dict.fromkeys(nodes[p] for _, p in seq.grads))
        gm.add_submodule(TARGET, SumGrads())
        first = min((nodes[c] for c, _ in seq.grads), key=order.__getitem__)
        with gm.graph.inserting_before(first):
            group = gm.graph.call_module(TARGET, tuple(params))
            group.meta = {"autotp_collective": ("seq_grads", TARGET)}
            outs = {}
            for i, p in enumerate(params):
                outs[p] = gm.graph.call_function(operator.getitem, (group, i))
                outs[p].meta = dict(p.meta)
        for c, p in seq.grads:
            nodes[c].replace_input_with(nodes[p], outs[nodes[p]])
    for i, (c, x) in enumerate(seq.enter_grads):
        target = f"autotp_seq_enter_grad_{i}"
        gm.add_submodule(target, EnterTP())
        with gm.graph.inserting_before(nodes[c]):
            f = gm.graph.call_module(target, (nodes[x],))
        f.meta = {**nodes[x].meta, "autotp_collective": ("enter", c)}
        nodes[c].replace_input_with(nodes[x], f)
    return gm
