"""Pass: insert Megatron's conjugate operators around every column→row pair.

Before::

    ln = aten.layer_norm(x, ...)
    fc = aten.linear(ln, c_fc_weight, c_fc_bias)         # column
    act = aten.gelu(fc)
    out = aten.linear(act, c_proj_weight, c_proj_bias)    # row
    y = aten.add(x, out)

After::

    ln = aten.layer_norm(x, ...)
    ln_tp = autotp_enter(ln)                              # f: identity fwd, all-reduce bwd
    fc = aten.linear(ln_tp, c_fc_weight, c_fc_bias)
    act = aten.gelu(fc)
    out = aten.linear(act, c_proj_weight, c_proj_bias)
    out_tp = autotp_leave(out)                            # g: all-reduce fwd, identity bwd
    y = aten.add(x, out_tp)

Columns sharing one input share one ``f`` (q, k and v: one all-reduce backward, not three; so do the
experts of one MoE layer, ``pair.enter_with``), fused with
them into one :class:`~autotp.operators.collectives.ColumnGroup` where their forms are plain (``linear``, ``addmm``,
``mm``/``matmul`` by a parameter or its transpose; ``plan.column_forms`` names each one's weight and bias), so
that the input gradient's all-reduce overlaps the weight gradients::

    cols = autotp_columns_0(ln, q_weight, None, k_weight, None, v_weight, None)   # f + q, k, v
    q, k, v = cols[0], cols[1], cols[2]

A vocab-parallel LM head is a column too: its input gets ``f``, fused with it the same way. A replicated
value computed from parameters that meets sharded heads inside the pair (a per-head q/k norm's weight) gets
``f`` as well: each rank's gradient for it covers its own heads only.

With sequence parallelism (``plan.sequence``) ``g`` is a reduce-scatter along the sequence, after the row or
after the view that restores a flat row output's sequence dim, and ``f`` an all-gather of the sequence
slice, fused with the columns (each keeps the name of the matmul it replaces, so an LM head's logits keep
theirs)::

    cols = autotp_seq_columns_0(ln, q_weight, None, k_weight, None, v_weight, None)   # ln: (b, s/t, h)
    q, k, v = cols[0], cols[1], cols[2]                                               # (b, s, h/t) each
    ...
    out_sp = autotp_seq_leave_1(out)                                                  # (b, s/t, h)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn

from autotp.operators.collectives import ColumnGroup, EnterTP, LeaveTP
from autotp.plan.plan import Plan, SeqEnter
from autotp.operators.seq_ops import AllGatherSeq, ReduceScatterSeq, SeqColumnGroup

aten = torch.ops.aten

ENTER = "autotp_enter"
LEAVE = "autotp_leave"


def ensure_collective_modules(gm: fx.GraphModule) -> None:
    if not hasattr(gm, ENTER):
        gm.add_submodule(ENTER, EnterTP())
        gm.add_submodule(LEAVE, LeaveTP())


def insert_collectives(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    if not plan.pairs and not plan.vocab.heads:
        return gm
    ensure_collective_modules(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    seq = plan.sequence
    for head, x_name in plan.vocab.heads:
        e = seq.enter(x_name, head) if seq is not None else None
        if e is not None:
            _seq_enter(gm, plan, e, [nodes[head]], nodes)
            continue
        form = _form(plan, nodes, nodes[head], nodes[x_name])
        if form:
            _fuse(gm, "autotp_columns", ColumnGroup((form[0],)), nodes[x_name], [nodes[head]], [form], head)
        else:
            _enter(gm, nodes[x_name], [nodes[head]], head)
    # columns of later pairs that read an input through an earlier pair's f (experts reading the same tokens)
    joined: dict[str, list[fx.Node]] = {}
    for pair in plan.pairs:
        for x_name in pair.enter_with:
            x = nodes[x_name]
            joined.setdefault(x_name, []).extend(nodes[c] for c in pair.columns if x in nodes[c].all_input_nodes)
            joined[x_name].extend(nodes[r] for r, root in pair.enter_via if root == x_name)
    shared: set[str | None] = set()  # leave_at nodes that have their g
    # experts that run on no rows where they are another rank's (expert parallelism) read their input apart
    apart = {n for layer in plan.experts for slot in layer.slots for n in slot.nodes}
    for pair in plan.pairs:
        columns = [nodes[c] for c in pair.columns]
        for x_name in pair.enter:
            x = nodes[x_name]
            users = [c for c in columns if x in c.all_input_nodes] + joined.get(x_name, [])
            via = [nodes[r] for r, root in pair.enter_via if root == x_name]
            e = seq.enter(x_name, users[0].name) if seq is not None else None
            if e is not None:
                _seq_enter(gm, plan, e, users, nodes)
                continue
            forms = [_form(plan, nodes, c, x) for c in users]
            if via:  # what is derived from x for other columns reads x through the same f
                _enter(gm, x, users + via, pair.module)
            elif all(forms) and not any(c.name in apart for c in users):
                _fuse(gm, "autotp_columns", ColumnGroup(tuple(f[0] for f in forms)), x, users, forms, pair.module)
            else:
                _enter(gm, x, users, pair.module)
        readers: dict[str, list[fx.Node]] = {}
        for consumer, x_name in pair.also_enter:  # one f for all readers of a value
            readers.setdefault(x_name, []).append(nodes[consumer])
        for x_name, consumers in readers.items():
            _enter(gm, nodes[x_name], consumers, pair.module)
        leave = seq.leave(pair.row) if seq is not None else None
        if leave is not None:
            seq_leave(gm, nodes[leave.node], leave.dim, pair.module)
            continue
        row = nodes[pair.leave_at or pair.row]
        if pair.leave_at is not None and pair.leave_at in shared:
            continue  # another expert's pair inserted the one all-reduce of the combined sum
        shared.add(pair.leave_at)
        with gm.graph.inserting_after(row):
            g = gm.graph.call_module(LEAVE, (row,))
        g.meta = {**row.meta, "autotp_collective": ("leave", pair.module)}
        row.replace_all_uses_with(g, delete_user_cb=lambda u: u is not g)
    return gm


def seq_leave(gm: fx.GraphModule, node: fx.Node, dim: int, where: str) -> fx.Node:
    """g with sequence parallelism: a reduce-scatter along ``dim`` after ``node``."""
    target = f"autotp_seq_leave_{dim}"
    if not hasattr(gm, target):
        gm.add_submodule(target, ReduceScatterSeq(dim))
    with gm.graph.inserting_after(node):
        g = gm.graph.call_module(target, (node,))
    g.meta = {**node.meta, "autotp_collective": ("leave", where)}
    node.replace_all_uses_with(g, delete_user_cb=lambda u: u is not g)
    return g


def _seq_enter(gm: fx.GraphModule, plan: Plan, e: SeqEnter, users: list[fx.Node], nodes: dict) -> None:
    """f with sequence parallelism: the all-gather of ``e.node`` along the sequence, fused with the matmuls
    when they are plain (``e.regather``), else an :class:`AllGatherSeq` in front of them (or of the view
    that flattens their input)."""
    x, source = nodes[e.x], nodes[e.node]
    if e.regather:
        forms = [_form(plan, nodes, c, x) for c in users]
        group = SeqColumnGroup(tuple(f[0] for f in forms), e.dim, e.flatten)
        _fuse(gm, "autotp_seq_columns", group, source, users, forms, e.module)  # source: (b, s/t, h), gathered inside
        if e.flatten and not x.users:
            gm.graph.erase_node(x)
        return
    target = f"autotp_seq_enter_{e.dim}"
    if not hasattr(gm, target):
        gm.add_submodule(target, AllGatherSeq(e.dim))
    readers = [x] if e.flatten else users
    with gm.graph.inserting_before(min(readers, key=_position(gm))):
        f = gm.graph.call_module(target, (source,))
    f.meta = {**source.meta, "autotp_collective": ("enter", e.module)}
    for c in readers:
        c.replace_input_with(source, f)


def _enter(gm: fx.GraphModule, x: fx.Node, users: list[fx.Node], where: str) -> None:
    with gm.graph.inserting_before(min(users, key=_position(gm))):
        f = gm.graph.call_module(ENTER, (x,))
    f.meta = {**x.meta, "autotp_collective": ("enter", where)}
    for c in users:
        c.replace_input_with(x, f)


_Form = tuple[str, fx.Node, fx.Node | None]  # (orientation, weight node, bias node) of a plain column matmul


def _form(plan: Plan, nodes: dict, c: fx.Node, x: fx.Node) -> _Form | None:
    """Column matmul ``c`` reading ``x`` in its plain form, as the plan records it; None: a group cannot
    fuse it."""
    f = plan.column_form(c.name, x.name)
    return None if f is None else (f.orientation, nodes[f.weight], None if f.bias is None else nodes[f.bias])


def _fuse(gm: fx.GraphModule, prefix: str, module: nn.Module, x: fx.Node, columns: list[fx.Node],
          forms: list[_Form], where: str) -> None:
    """Replace ``columns`` by one call of ``module`` (a column group, added as ``{prefix}_{i}``) on ``x`` and
    their weights and biases; each column becomes the group's i-th output under its own name (the plan
    names an LM head's logits)."""
    # groups are added at the top level: counting them there, not over every module of a deep model
    target = f"{prefix}_{sum(isinstance(m, type(module)) for m in gm.children())}"
    gm.add_submodule(target, module)
    operands = [a for _, w, b in forms for a in (w, b)]
    with gm.graph.inserting_before(min(columns, key=_position(gm))):
        group = gm.graph.call_module(target, (x, *operands))
    _hoist(group, operands)
    group.meta = {**x.meta, "autotp_collective": ("enter", where),
                  "val": tuple(c.meta.get("val") for c in columns)}
    for i, (c, (_, w, _)) in enumerate(zip(columns, forms)):
        weight_view = c.args[1] if c.target in (aten.mm.default, aten.matmul.default) else None
        c.op, c.target, c.args, c.kwargs = "call_function", operator.getitem, (group, i), {}
        if weight_view is not None and weight_view is not w and not weight_view.users:
            gm.graph.erase_node(weight_view)


def _hoist(group: fx.Node, operands: list) -> None:
    """Move what the group reads and the graph computes later (a weight's cast before a later column matmul)
    in front of it, inputs first."""
    _hoist_into(group, operands, {n: i for i, n in enumerate(group.graph.nodes)})


def _hoist_into(group: fx.Node, operands: list, index: dict) -> None:
    for x in operands:
        if isinstance(x, fx.Node) and x.op == "call_function" and index[x] > index[group]:
            _hoist_into(group, list(x.all_input_nodes), index)
            group.prepend(x)
            index[x] = index[group] - 0.5  # now in front of the group (and after what was hoisted before it)


def _position(gm: fx.GraphModule):
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda n: index[n]
