"""Pass: run the forward on this rank's chunk of the sequence (context parallelism).

Before::

    x = placeholder                                    # (b, s) token ids
    w = get_attr[wte.weight]
    pos = aten.arange.start(0, sym_size(x, 1))         # (s,)
    ...
    y = aten.scaled_dot_product_attention(q, k, v, is_causal=True)
    a = aten.softmax(aten.masked_fill(aten.matmul(q2, k2ᵀ) * c, ~tril(ones(s, s)), -inf), -1)
    y2 = aten.matmul(a, v2)                            # written out, the mask proven causal
    ...
    loss = aten.cross_entropy_loss(logits_2d, targets_1d)
    return (logits, loss)

After::

    x = placeholder
    x_cp = autotp_cp_shard_0(x)                        # (b, s/cp): chunks r and 2·cp−1−r
    (ops on the inputs alone, a label shift, run on the whole inputs: their results are cut instead;
    the sequence length read off the inputs is s // cp to the ops on chunks)
    ws = autotp_cp_grads(w, ...); w_ = ws[0]           # backward: the gradients summed over the group, one bucket
    pos = autotp_cp_positions_0(aten.arange.start(0, sym_size(x_cp, 1)))   # their global positions
    cos = autotp_cp_rows_0(cos_table, s // cp)         # cos_table[:s] -> the rows of those positions
    ...
    h = autotp_rng_drop(x2, 0.1, True)                 # dropout on the chunk: RegionRandom, the chunk's stream
    y = autotp_cp_attention_0(q, k, v)                 # ring attention over the cp group
    y2 = autotp_cp_attention_1(q2, k2, v2)             # (scale c, causal); the scores and mask are gone
    y3 = flatten(autotp_cp_attention_2(q3, k3, v3), 0, 1)   # a bmm over (b·h, s, d), folded back
    kt_ = autotp_cp_keys_0_0(kt4); v_ = autotp_cp_keys_0_1(v4)   # scores no ring computes (ALiBi, a
    bias = autotp_cp_rows_0_0(<alibi bias, copied: the whole length>)   # window, tanh capping): every key
    y4 = matmul(softmax(tanh(matmul(q4, kt_) / c) + bias), v_)  # (b, h, s/cp, s) scores, as written
    ...
    total = aten.cross_entropy_loss(logits_2d, targets_1d, None, 2)   # reduction "sum" (or the vocab loss's)
    loss = autotp_cp_loss_0(total, targets_1d)         # Σ loss / Σ counted tokens over the group
    return (autotp_cp_gather_0(logits), loss)          # (b, s, V) in sequence order

It reads the plan's :class:`~autotp.plan.context.ContextPlan` only (the causal flag and scale of each attention,
the loss's ignore_index, the parameter reads); the operators are bound to the cp group by the runtime. It runs
after the tensor-parallel passes.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autotp.operators.context_ops import (ContextGrads, GatherKeys, GatherSequence, LocalPositions, PositionRows,
                                          RingSDPA, ShardSequence, TokenMean)
from autotp.operators.rng import RegionRandom
from autotp.plan.context import KeyedCall
from autotp.plan.plan import Plan


def _after(gm: fx.GraphModule, node: fx.Node, name: str, module: torch.nn.Module,
           keep: frozenset[str] = frozenset()) -> fx.Node:
    """``name(node)`` inserted after ``node``, read by every user ``node`` had but those in ``keep`` and the
    export's check of the inputs, which read the whole value."""
    gm.add_submodule(name, module)
    with gm.graph.inserting_after(node):
        new = gm.graph.call_module(name, (node,))
    node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new and u.name not in keep and not (
        u.op == "call_module" and str(u.target).startswith("_guards")))
    return new


def _replace(gm: fx.GraphModule, node: fx.Node, name: str, module: torch.nn.Module, args: tuple) -> None:
    gm.add_submodule(name, module)
    with gm.graph.inserting_before(node):
        new = gm.graph.call_module(name, args)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def context_parallel(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    plan = plan.context
    if plan is None:
        return gm
    nodes = {n.name: n for n in gm.graph.nodes}
    if plan.grads:  # the parameters' reads, untouched by the tp passes; a tied tensor's other reads take its sum
        _sum_grads(gm, [nodes[p] for p in plan.grads], [(nodes[a], nodes[b]) for a, b in plan.tied])
    copies: set[str] = set()
    for i, call in enumerate(plan.keyed):  # before the sizes: the copies read the whole length
        copies |= _keyed(gm, call, i, nodes)
    whole = frozenset(plan.whole) | copies
    sizes = frozenset(plan.sizes)
    for i, (name, dim) in enumerate(plan.chunks):
        _after(gm, nodes[name], f"autotp_cp_shard_{i}", ShardSequence(dim), whole | sizes)
    for name in plan.sizes:  # ops on chunks read s/cp; those on the whole inputs, s
        size = nodes[name]
        with gm.graph.inserting_after(size):
            local = gm.graph.call_function(operator.floordiv, (size, plan.cp))
        size.replace_all_uses_with(local, delete_user_cb=lambda u: u is not local and u.name not in whole)
    for i, name in enumerate(plan.positions):
        _after(gm, nodes[name], f"autotp_cp_positions_{i}", LocalPositions())
    for i, (name, dim) in enumerate(plan.tables):  # table[:s] -> the rows of this rank's positions
        n = nodes[name]
        end = n.args[3]  # slice(x, dim, 0, s) or narrow(x, dim, 0, s)
        _replace(gm, n, f"autotp_cp_rows_{i}", PositionRows(dim), (n.args[0], end))
    for name in plan.random:  # a sharded region's already draw from their (tp, cp) rank's stream
        n = nodes[name]
        if n.op == "call_function":
            gm.add_submodule(f"autotp_rng_{name}", RegionRandom(n.target, stream="cp"))
            n.op, n.target = "call_module", f"autotp_rng_{name}"
    for i, call in enumerate(plan.attention):
        n = nodes[call.node]
        qkv = tuple(nodes[x] for x in call.inputs) if call.inputs else tuple(n.args[:3])
        if call.folded:  # bmm over (b·h, s, d): the ring's (b, h, s, d) output folded back
            gm.add_submodule(f"autotp_cp_attention_{i}", RingSDPA(call.is_causal, call.scale))
            with gm.graph.inserting_before(n):
                ring = gm.graph.call_module(f"autotp_cp_attention_{i}", qkv)
                out = gm.graph.call_function(torch.flatten, (ring, 0, 1))
            out.meta = dict(n.meta)
            n.replace_all_uses_with(out)
            gm.graph.erase_node(n)
            continue
        _replace(gm, n, f"autotp_cp_attention_{i}", RingSDPA(call.is_causal, call.scale), qkv)
    for name in reversed(plan.dropped):  # the written-out scores and the masks, now read by nothing (latest first)
        if not nodes[name].users:
            gm.graph.erase_node(nodes[name])
    for i, loss in enumerate(plan.losses):  # summed over the rank's tokens, then the group's mean
        n = nodes[loss.node]
        if n.op == "call_module":  # vocab-parallel (tp > 1): the vocab loss pass made it its module
            gm.get_submodule(n.target).reduction = 2
        else:  # cross_entropy_loss(logits, targets, weight=None, reduction=1, ...): reduction "sum"
            args = list(n.args) + [None, 1][len(n.args) - 2:]
            args[3] = 2
            n.args, n.kwargs = tuple(args), {k: v for k, v in n.kwargs.items() if k != "reduction"}
        gm.add_submodule(f"autotp_cp_loss_{i}", TokenMean(loss.ignore_index))
        with gm.graph.inserting_after(n):
            mean = gm.graph.call_module(f"autotp_cp_loss_{i}", (n, n.args[1]))
        mean.meta = dict(n.meta)
        n.replace_all_uses_with(mean, delete_user_cb=lambda u: u is not mean)
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    outs = list(out.args[0])
    for i, (index, dim) in enumerate(plan.outputs):
        gm.add_submodule(f"autotp_cp_gather_{i}", GatherSequence(dim))
        with gm.graph.inserting_before(out):
            outs[index] = gm.graph.call_module(f"autotp_cp_gather_{i}", (outs[index],))
    out.args = (type(out.args[0])(outs),)
    return gm


def _keyed(gm: fx.GraphModule, call: KeyedCall, i: int, nodes: dict[str, fx.Node]) -> set[str]:
    """Gather the attention's keys and values; the values its scores read that are made from positions,
    computed by copies at the whole length and cut to this rank's rows. Returns the copies' names."""
    # the scores' ops, or what an earlier pass put between (a tensor-parallel slice of the heads)
    whole = set(call.whole)
    readers = [u for name, _ in call.rows for u in nodes[name].users if u.name not in whole]
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    env: dict[fx.Node, fx.Node] = {}
    if readers:
        with gm.graph.inserting_before(min(readers, key=order.__getitem__)):
            for name in call.whole:
                env[nodes[name]] = gm.graph.node_copy(nodes[name], lambda a: env.get(a, a))
            for j, (name, dim) in enumerate(call.rows):
                rows = env[nodes[name]]
                if dim is not None:  # (.., s, s) -> (.., s/cp, s): this rank's query rows
                    gm.add_submodule(f"autotp_cp_rows_{i}_{j}", ShardSequence(dim))
                    rows = gm.graph.call_module(f"autotp_cp_rows_{i}_{j}", (rows,))
                    rows.meta = dict(nodes[name].meta)
                nodes[name].replace_all_uses_with(rows, delete_user_cb=lambda u: u in readers)
    for j, ((name, dim), span, attention) in enumerate(zip(call.keys, call.spans,
                                                            (nodes[call.scores], nodes[call.out]))):
        reader = nodes[span[0]] if span else attention  # the kv heads' repeat runs on the gathered keys
        gm.add_submodule(f"autotp_cp_keys_{i}_{j}", GatherKeys(dim))
        with gm.graph.inserting_before(reader):
            keys = gm.graph.call_module(f"autotp_cp_keys_{i}_{j}", (nodes[name],))
        keys.meta = dict(nodes[name].meta)
        reader.replace_input_with(nodes[name], keys)
    for name, dim in call.widen:  # expand / reshape of the gathered keys: the whole length, not s/cp
        n = nodes[name]
        sizes = list(n.args[1])
        sizes[dim] = -1
        n.args = (n.args[0], sizes, *n.args[2:])
    return {n.name for n in env.values()}  # the originals only the scores read are in ``plan.dropped``


def _sum_grads(gm: fx.GraphModule, params: list[fx.Node], tied: list[tuple[fx.Node, fx.Node]]) -> None:
    """Every parameter read through one :class:`ContextGrads`, placed after the last of them (and of the tied
    reads); a tied read's users read its tensor's output (each tensor enters once)."""
    gm.add_submodule("autotp_cp_grads", ContextGrads())
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last = max([*params, *(a for a, _ in tied)], key=order.__getitem__)
    with gm.graph.inserting_after(last):
        group = gm.graph.call_module("autotp_cp_grads", tuple(params))
    outs = {}
    with gm.graph.inserting_after(group):
        for i, p in reversed(list(enumerate(params))):
            out = outs[p] = gm.graph.call_function(operator.getitem, (group, i))
            out.meta = dict(p.meta)
            p.replace_all_uses_with(out, delete_user_cb=lambda u: u is not group)
    for read, first in tied:
        read.replace_all_uses_with(outs[first])
