"""Pass: the edges where sequence slices and whole sequences meet, and the sizes that become local.

Before (tp = 2; ``add`` and the ops after it hold s/t positions with sequence parallelism)::

    pos = aten.embedding(wpe_weight, arange)              # (s, h), replicated
    add = aten.add(tok, pos)                              # tok: (b, s/t, h)
    v = aten.view(ln, [-1, sym_size_s, 64])               # ln: (b, s/t, h)
    last = aten.index(ln_f, [None, idx])                  # needs the whole sequence
    ...

After::

    pos_local = autotp_seq_slice_0(pos)                   # (s/t, h): this rank's positions; all-gather bwd
    add = aten.add(tok, pos_local)
    s_local = aten.sym_size(ln, 1)
    v = aten.view(ln, [-1, s_local, 64])                  # the local length, read from the input
    ln_f_all = autotp_seq_gather_1(ln_f)                  # all-gather fwd; this rank's slice of the grad bwd
    last = aten.index(ln_f_all, [None, idx])              # replicated from here on

Runs before the pairs' collectives are inserted: every edge named by the plan is an edge of the captured
graph. The modules bind their group at run time; the pass never reads it.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autotp.plan.plan import Plan
from autotp.operators.seq_ops import GatherSeq, SliceSeq

aten = torch.ops.aten


def _module(gm: fx.GraphModule, kind: str, cls: type, dim: int) -> str:
    target = f"autotp_seq_{kind}_{dim}"
    if not hasattr(gm, target):
        gm.add_submodule(target, cls(dim))
    return target


def sequence_split(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    seq = plan.sequence
    if seq is None:
        return gm
    nodes = {n.name: n for n in gm.graph.nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for g in seq.gathers:
        value = nodes[g.value]
        with gm.graph.inserting_after(value):
            whole = gm.graph.call_module(_module(gm, "gather", GatherSeq, g.dim), (value,))
        whole.meta = {**value.meta, "autotp_collective": ("seq_gather", g.value)}
        for c in g.consumers:
            nodes[c].replace_input_with(value, whole)
    cut: dict[tuple[str, int], fx.Node] = {}
    for s in seq.slices:
        value, consumer = nodes[s.value], nodes[s.consumer]
        if (s.value, s.dim) not in cut:
            first = min((nodes[x.consumer] for x in seq.slices if x.value == s.value and x.dim == s.dim),
                        key=order.__getitem__)
            with gm.graph.inserting_before(first):
                cut[(s.value, s.dim)] = gm.graph.call_module(_module(gm, "slice", SliceSeq, s.dim), (value,))
            cut[(s.value, s.dim)].meta = {"autotp_collective": ("seq_slice", s.value)}
        consumer.replace_input_with(value, cut[(s.value, s.dim)])
    for name, arg, index, dim in seq.sizes:
        node = nodes[name]
        sizes = list(node.args[arg])
        if dim < 0:
            sizes[index] = -1  # expand: keep the local length
        else:
            with gm.graph.inserting_before(node):
                sizes[index] = gm.graph.call_function(aten.sym_size.int, (node.args[0], dim))
        node.update_arg(arg, sizes)
    return gm
