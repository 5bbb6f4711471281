"""The context plan of a captured graph (:class:`~autotp.plan.context.ContextPlan`), from the analysis'
:class:`~autotp.analysis.context.ContextFacts`; a forward that cannot run on a sequence chunk is refused
here, before any rank computes, with every op that stops it."""
from __future__ import annotations

import torch
import torch.fx as fx

from autotp.analysis.context import ContextFacts
from autotp.analysis.ops import arg_named
from autotp.errors import ShardingError
from autotp.plan.context import ContextPlan, KeyedCall, RingCall, TokenLoss


class ContextRefused(ShardingError):
    """The forward cannot run on a sequence chunk; the message names every op that stops it."""


def context_plan(gm: fx.GraphModule, facts: ContextFacts, cp: int, sum_grads: bool = True) -> ContextPlan:
    """The rewrite of ``gm`` for ``cp`` ranks; raises :class:`ContextRefused` naming each blocker.
    ``sum_grads``: the graph sums the parameters' gradients over the group (False: FSDP's reduce-scatter over
    the dp and cp ranks does)."""
    if not facts.runs:
        raise ContextRefused(f"context parallelism (cp {cp}) cannot run this forward on a sequence chunk:\n" +
                             "\n".join(f"  {b.where or 'the model'}: {b.detail}" for b in facts.blockers))
    nodes = {n.name: n for n in gm.graph.nodes}
    losses = []
    for r in facts.reductions:
        n = nodes[r.node]
        if n.target is not torch.ops.aten.cross_entropy_loss.default or arg_named(n, "reduction", 1) != 1 \
                or arg_named(n, "weight") is not None:
            raise ContextRefused(f"context parallelism: {r.where}: only an unweighted cross-entropy's mean is "
                                 "completed over the cp group yet")
        losses.append(TokenLoss(r.node, arg_named(n, "ignore_index", -100), arg_named(n, "label_smoothing", 0.0)))
    attention = tuple(RingCall(a.node, a.causal, a.scale, (a.written.q, a.written.k, a.written.v) if a.written else (),
                               bool(a.written and a.written.folded)) for a in facts.attention if not a.keyed)
    keyed = tuple(KeyedCall(k.scores, k.out, k.keys, k.rows, k.whole, k.region, k.spans, k.widen)
                  for k in (a.keyed for a in facts.attention) if k is not None)
    grads, tied = _grads(gm) if sum_grads else ((), ())
    return ContextPlan(cp, facts.inputs, tuple(p.node for p in facts.positions), attention, tuple(losses),
                       facts.outputs, grads, _length(gm, facts), facts.dropped, facts.chunks, facts.whole,
                       facts.sizes, facts.tables, facts.random, keyed, tied)


def _grads(gm: fx.GraphModule) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The parameter reads whose gradients the graph sums over the group, one per tensor, and the other reads
    of a tensor read under several names (tied weights: nanoGPT's embedding and LM head), each with the read
    whose sum it takes. A tensor handed twice to one autograd Function is what dynamo cannot trace (a graph
    break under compile); summed once, the two uses' gradients are added before the all-reduce."""
    trained = {name: p for name, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    first: dict[int, str] = {}
    grads, tied = [], []
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.target in trained:
            key = id(trained[n.target])
            if key in first:
                tied.append((n.name, first[key]))
            else:
                first[key] = n.name
                grads.append(n.name)
    return tuple(grads), tuple(tied)


def _length(gm: fx.GraphModule, facts: ContextFacts) -> int:
    """The sequence length of the capture's example (its hint), 0 where no input carries it."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, dim in facts.inputs:
        val = nodes[name].meta.get("val")
        if val is not None:
            size = val.shape[dim]
            hint = getattr(getattr(size, "node", None), "hint", size)
            return int(hint) if hint is not None else 0
    return 0


def check_chunks(length: int, cp: int) -> None:
    """Context parallelism cuts the sequence into 2·cp chunks (rank r holds chunks r and 2·cp−1−r, so causal
    attention's work is balanced): a length they do not divide is refused before any rank computes."""
    if length % (2 * cp):
        raise ShardingError(f"sequence length {length} is not divisible by 2·cp = {2 * cp} (cp {cp}): context "
                            f"parallelism gives each rank 2 of {2 * cp} equal chunks of the sequence",
                            hint=f"use a sequence length that is a multiple of {2 * cp} (pad the batch, with "
                                 "targets the loss ignores), or a smaller cp")
