"""Pass: a parameter held whole on every rank is cut to this rank's slice where the graph reads it.

Under FSDP a parameter whose blocks several tensor-parallel ranks hold (kv heads fewer than tp) stays whole
(a DTensor ``Replicate`` over tp: norms and checkpoints count it once); the graph computes with the same
slice as a sharded one would. ``f`` in front of the slice sums the ranks' gradients of the whole: each is
the slice's gradient scattered into zeros, and together they are the full one.

Before::

    w = get_attr[k_proj.weight]                          # (n_kv·d, h) held here whole
    k = aten.linear(x, w)                                # planned as (b, s, local kv·d)

After::

    w = get_attr[k_proj.weight]
    w_f = autotp_graph_cut_f_0(w)                        # identity; all-reduce of dL/dw backward
    w_local = autotp_graph_cut_0(w_f)                    # (local kv·d, h): this rank's heads
    k = aten.linear(x, w_local)

A cut not ``in_graph`` (pipeline stages) gets the slice only: the pipeline sums the copies' gradients once
per step, after the last micro-batch, instead of ``f`` once per micro-batch.

The slice module is bound to the rank at run time, so the pass never reads it. Runs after the pairs'
collectives: a column group reads the weight node it is given, and then reads the slice.
"""
from __future__ import annotations

import torch.fx as fx

from autotp.operators.collectives import EnterTP
from autotp.operators.gathered import LocalSliceOp
from autotp.plan.plan import Plan


def graph_cuts(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    nodes = {n.name: n for n in gm.graph.nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for i, cut in enumerate(plan.graph_cuts):
        param = nodes[cut.node]
        users = list(param.users)
        if not users:
            continue
        first = min(users, key=order.__getitem__)
        # in the first reader's module: an FSDP unit's piece holds its own parameters' cuts
        where = {k: first.meta[k] for k in ("nn_module_stack",) if k in first.meta}
        gm.add_submodule(f"autotp_graph_cut_{i}", LocalSliceOp(cut.dim, cut.segments))
        with gm.graph.inserting_before(first):
            f = param
            if cut.in_graph:
                gm.add_submodule(f"autotp_graph_cut_f_{i}", EnterTP())
                f = gm.graph.call_module(f"autotp_graph_cut_f_{i}", (param,))
                f.meta = {**param.meta, **where, "autotp_collective": ("enter", cut.name)}
            local = gm.graph.call_module(f"autotp_graph_cut_{i}", (f,))
            local.meta = {**where}
        for user in users:
            user.replace_input_with(param, local)
    return gm
