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

With FSDP (``seq.grads_by`` "unit") each unit's parameters get their own sum, placed in the unit: FSDP
reduce-scatters a unit's gradients as soon as that unit's backward ends, before any later sum would run.
With pipeline stages ("stage") each stage's, in the stage: a stage holds only its own parameters.

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
        # one sum for the model; with FSDP one per unit, with pipeline stages one per stage, inside each
        groups = plan.seq_grad_groups(lambda p: str(nodes[p].target))
        for i, pairs in enumerate(groups):
            _sum_grads(gm, nodes, order, pairs, TARGET if len(groups) == 1 else f"{TARGET}_{i}")
    for i, (c, x) in enumerate(seq.enter_grads):
        target = f"autotp_seq_enter_grad_{i}"
        gm.add_submodule(target, EnterTP())
        with gm.graph.inserting_before(nodes[c]):
            f = gm.graph.call_module(target, (nodes[x],))
        f.meta = {**nodes[x].meta, "autotp_collective": ("enter", c)}
        nodes[c].replace_input_with(nodes[x], f)
    return gm


def _sum_grads(gm: fx.GraphModule, nodes: dict[str, fx.Node], order: dict[fx.Node, int],
               pairs: tuple[tuple[str, str], ...], target: str) -> None:
    """One :class:`SumGrads` over the parameters of ``pairs`` (consumer, parameter), before the first consumer
    and in its module (a unit's piece holds its own sum)."""
    params = list(dict.fromkeys(nodes[p] for _, p in pairs))
    gm.add_submodule(target, SumGrads())
    first = min((nodes[c] for c, _ in pairs), key=order.__getitem__)
    where = {k: first.meta[k] for k in ("nn_module_stack",) if k in first.meta}
    with gm.graph.inserting_before(first):
        group = gm.graph.call_module(target, tuple(params))
        group.meta = {**where, "autotp_collective": ("seq_grads", target)}
        outs = {}
        for i, p in enumerate(params):
            outs[p] = gm.graph.call_function(operator.getitem, (group, i))
            outs[p].meta = {**p.meta, **where}
    for c, p in pairs:
        nodes[c].replace_input_with(nodes[p], outs[nodes[p]])
