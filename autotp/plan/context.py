"""The context-parallel part of a plan: what :func:`passes.context_parallel.context_parallel` rewrites,
by node name, made from the analysis' :class:`~autotp.analysis.context.ContextFacts`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autotp.analysis.context import ContextFacts
from autotp.analysis.ops import arg_named


class ContextRefused(ValueError):
    """The forward cannot run on a sequence chunk; the message names every op that stops it."""


@dataclass(frozen=True)
class RingCall:
    """An SDPA call run as ring attention, with its own causal flag and scale."""

    node: str
    is_causal: bool
    scale: float | None


@dataclass(frozen=True)
class TokenLoss:
    """A cross-entropy's mean, completed over the group's counted tokens."""

    node: str
    ignore_index: int
    label_smoothing: float


@dataclass(frozen=True)
class ContextPlan:
    cp: int
    inputs: tuple[tuple[str, int], ...]  # placeholders chunked on entry: (name, sequence dim)
    positions: tuple[str, ...]  # aranges over the sequence: the chunk's global positions instead
    attention: tuple[RingCall, ...]
    losses: tuple[TokenLoss, ...]
    outputs: tuple[tuple[int, int], ...]  # outputs carrying the sequence: (output index, sequence dim), gathered


def context_plan(gm: fx.GraphModule, facts: ContextFacts, cp: int) -> ContextPlan:
    """The rewrite of ``gm`` for ``cp`` ranks; raises :class:`ContextRefused` naming each blocker."""
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
    attention = tuple(RingCall(a.node, bool(arg_named(nodes[a.node], "is_causal", False)),
                               arg_named(nodes[a.node], "scale")) for a in facts.attention)
    return ContextPlan(cp, facts.inputs, tuple(p.node for p in facts.positions), attention, tuple(losses),
                       facts.outputs)
