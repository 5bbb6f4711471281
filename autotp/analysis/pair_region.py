"""What tensor-parallel propagation finds in one pair region, the span of a column→row pair
(:class:`PairRegion`), and its facts.

Each fact is a NamedTuple: read by name, or unpacked in field order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch.fx as fx

from autotp.plan.plan import Rewrite
from autotp.shard_spec import Sharding


class OperandSlice(NamedTuple):
    """A replicated operand cut to this rank's slice where a sharded value meets it (ALiBi slopes
    ``(n_heads,)``, a mask ``(b, n_heads, s, s)`` with a head dim): no gradient needed, no communication."""

    consumer: fx.Node  # the op where the operand meets the sharded value
    operand: fx.Node  # the replicated value, whole on every rank
    dim: int  # the operand's dim that lines up with the sharded dim
    sharding: Sharding  # how that dim is cut (its segments; ``outer``: heads folded under the batch)


class Entering(NamedTuple):
    """A replicated operand computed from parameters, used with sharded values (a per-head norm's weight
    ``(head_dim,)``): its gradient comes back partial on each rank, so it enters through Megatron's f."""

    consumer: fx.Node
    operand: fx.Node


class StatFact(NamedTuple):
    """A statistic over the sharded dim (a norm over the whole projection width): each rank reduces its own
    slice, one all-reduce of the ``(b, s)`` statistics completes them."""

    kind: str  # "mean", "sum", "var", "std", "norm" (a reduction), "rms_norm", "layer_norm" (a norm)
    scale: float  # what the sum of the ranks' partial values is multiplied by (1/tp for a mean)


class ParamCut(NamedTuple):
    """A parameter that spans the sharded dim (a whole-width norm's weight ``(n_heads·hd,)``), or a buffer
    sharded values are written into (a KV cache ``(b, n_kv, s_max, hd)``): sharded with the heads."""

    node: fx.Node  # its get_attr
    dim: int  # its dim that is cut
    sharding: Sharding


class SharedValues(NamedTuple):
    """One embedding of the ids whose values several pairs' regions read (CPM-Ant's position bias
    ``embedding(buckets, table).permute(0, 3, 1, 2)``, ``(b, heads, s, s)``, added to the scores of every layer):
    a column of the first pair that reads it, cut by heads, each later region reading the values it left cut.
    ``seeds``: the values earlier regions cut that this one may read; ``embeddings``: the embedding columns whose
    values this region may leave cut for later regions (every reader is checked to be in one once all the pairs
    are found)."""

    seeds: dict[fx.Node, Sharding]
    embeddings: frozenset[fx.Node]


@dataclass
class PairRegion:
    specs: dict[fx.Node, Sharding | tuple[Sharding | None, ...]] = field(default_factory=dict)
    rewrites: list[Rewrite] = field(default_factory=list)
    random_nodes: list[fx.Node] = field(default_factory=list)
    row_input: Sharding | None = None
    outputs: list[fx.Node] = field(default_factory=list)  # sharded values the graph returns (a KV cache)
    inputs: list[fx.Node] = field(default_factory=list)  # graph inputs taken as local shards (a KV cache)
    slices: list[OperandSlice] = field(default_factory=list)
    entering: list[Entering] = field(default_factory=list)
    stats: dict[fx.Node, StatFact] = field(default_factory=dict)  # reduction or norm node -> its statistic
    params: list[ParamCut] = field(default_factory=list)
    # reducing projections inside the region (row-parallel, completed by a sum statistic) -> their input's cut
    reduced: dict[fx.Node, Sharding] = field(default_factory=dict)
    # other row-parallel matmuls of the same columns (a parallel block's feed-forward output beside attention's)
    # -> their input's cut; each output is a partial sum, completed by g like the row's
    sides: dict[fx.Node, Sharding] = field(default_factory=dict)
    # values computed from the region's embedding columns alone that later regions read too -> their cut
    shared: dict[fx.Node, Sharding] = field(default_factory=dict)


def from_alone(n: fx.Node, roots: frozenset[fx.Node], specs: dict[fx.Node, object]) -> bool:
    """Is ``n``, cut in a region with ``specs``, computed from the cut values of ``roots`` alone (the others whole)?"""
    todo, seen = [n], set()
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        if x in roots:
            continue
        cut = [a for a in x.all_input_nodes if a in specs]
        if not cut:
            return False
        todo += cut
    return True
