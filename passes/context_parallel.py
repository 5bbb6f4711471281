"""Pass: run the forward on this rank's chunk of the sequence (context parallelism).

Before::

    x = placeholder                                    # (b, s) token ids
    pos = aten.arange.start(0, sym_size(x, 1))         # (s,)
    ...
    y = aten.scaled_dot_product_attention(q, k, v, is_causal=True)
    ...
    loss = aten.cross_entropy_loss(logits_2d, targets_1d)
    return (logits, loss)

After::

    x = placeholder
    x_cp = autotp_cp_shard_0(x)                        # (b, s/cp): chunks r and 2·cp−1−r
    pos = autotp_cp_positions_0(aten.arange.start(0, sym_size(x_cp, 1)))   # their global positions
    ...
    y = autotp_cp_attention_0(q, k, v)                 # ring attention over the cp group
    ...
    loss = autotp_cp_loss_0(logits_2d, targets_1d)     # Σ loss / Σ counted tokens over the group
    return (autotp_cp_gather_0(logits), loss)          # (b, s, V) in sequence order

It reads the :class:`~autotp.plan.context.ContextPlan` only (the causal flag and scale of each attention, the
loss's ignore_index); the operators are bound to the cp group by the runtime.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autotp.operators.context_ops import GatherSequence, LocalPositions, RingSDPA, ShardSequence, TokenMeanLoss
from autotp.plan.context import ContextPlan


def _after(gm: fx.GraphModule, node: fx.Node, name: str, module: torch.nn.Module) -> fx.Node:
    """``name(node)`` inserted after ``node``, read by every user ``node`` had (but the export's check of
    the inputs, which reads the whole ones)."""
    gm.add_submodule(name, module)
    with gm.graph.inserting_after(node):
        new = gm.graph.call_module(name, (node,))
    node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new and not (
        u.op == "call_module" and str(u.target).startswith("_guards")))
    return new


def _replace(gm: fx.GraphModule, node: fx.Node, name: str, module: torch.nn.Module, args: tuple) -> None:
    gm.add_submodule(name, module)
    with gm.graph.inserting_before(node):
        new = gm.graph.call_module(name, args)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def context_parallel(gm: fx.GraphModule, plan: ContextPlan) -> fx.GraphModule:
    nodes = {n.name: n for n in gm.graph.nodes}
    for i, (name, dim) in enumerate(plan.inputs):
        _after(gm, nodes[name], f"autotp_cp_shard_{i}", ShardSequence(dim))
    for i, name in enumerate(plan.positions):
        _after(gm, nodes[name], f"autotp_cp_positions_{i}", LocalPositions())
    for i, call in enumerate(plan.attention):
        n = nodes[call.node]
        _replace(gm, n, f"autotp_cp_attention_{i}", RingSDPA(call.is_causal, call.scale), tuple(n.args[:3]))
    for i, loss in enumerate(plan.losses):
        n = nodes[loss.node]
        _replace(gm, n, f"autotp_cp_loss_{i}", TokenMeanLoss(loss.ignore_index, loss.label_smoothing),
                 (n.args[0], n.args[1]))
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    outs = list(out.args[0])
    for i, (index, dim) in enumerate(plan.outputs):
        gm.add_submodule(f"autotp_cp_gather_{i}", GatherSequence(dim))
        with gm.graph.inserting_before(out):
            outs[index] = gm.graph.call_module(f"autotp_cp_gather_{i}", (outs[index],))
    out.args = (type(out.args[0])(outs),)
    return gm
