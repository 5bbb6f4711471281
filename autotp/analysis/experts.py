"""Expert parallelism: where a mixture-of-experts layer reads its experts' weights, so whole experts can live on
different ranks.

With expert tensor parallelism (the default) every rank holds 1/t of every expert. With expert parallelism
rank r holds experts ``[r·n, (r+1)·n)``, ``n = E/t``: a block of dim 0 of every expert weight. Tokens are the
same on every rank of a tensor-parallel group, so each rank computes, whole, only what the routing sends to
its own experts and nothing is dispatched; every other expert's contribution is 0 there, and the sum the
layer already completes with one all-reduce (see :mod:`autotp.analysis.partial`) adds the ranks' experts.

The three ways models read an expert's weights, each one entry here and one runtime operator:

- ``select``: ``W[e]`` in a loop over the experts. The expert's computation (its *slot*: the nodes between
  its weights and its down-projection) runs on no rows where the expert lives elsewhere, and gives zeros;
- ``index``: ``W[ids]`` per token or slot (batched matmul, einsum): another rank's experts read as zeros,
  so their slots' down-projections give exact zeros;
- ``grouped``: a grouped GEMM over tokens sorted by expert: the rows of this rank's experts are multiplied,
  the others are zeros.

A layer whose experts cannot be placed so (an expert weight read whole, a per-expert bias added after the
down-projection, experts that do not split evenly) keeps expert tensor parallelism, with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.fx as fx

from autotp.analysis.matmuls import ParamMatmul, module_path
from autotp.analysis.ops import SAME_SHAPE
from autotp.analysis.pairs import Analysis, PairFacts, common_module

aten = torch.ops.aten


@dataclass
class ExpertSlot:
    """One expert of a per-expert loop: ``nodes`` compute its output ``out`` from its weights and ``rows``."""

    expert: int
    nodes: list[fx.Node]
    rows: list[fx.Node]
    out: fx.Node


@dataclass
class ExpertLayerFacts:
    module: str
    count: int  # E
    pairs: list[PairFacts]
    params: list[str]  # every parameter indexed by expert (weights, biases): cut on dim 0
    selects: list[tuple[fx.Node, int]] = field(default_factory=list)
    indexes: list[fx.Node] = field(default_factory=list)
    grouped: list[fx.Node] = field(default_factory=list)
    slots: list[ExpertSlot] = field(default_factory=list)
    top_k: int | None = None  # experts per token, read from the routing's top-k (None: not found)
    width: int = 0  # the experts' output features (h)


@dataclass
class ExpertFacts:
    layers: list[ExpertLayerFacts] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)  # (module, reason): layers left expert-TP


def _expert_weights(gm: fx.GraphModule, p: PairFacts) -> set[str]:
    return {m.weight for m in (*p.columns, p.row, *p.sides) if gm.get_parameter(m.weight).dim() == 3}


def _layers(gm: fx.GraphModule, a: Analysis) -> list[list[PairFacts]]:
    """The pairs of each MoE layer: pairs that share an expert weight (its experts) or the all-reduce of their
    combined sum (a shared expert beside them)."""
    import networkx as nx  # here, not at import, as in pairs.py

    g = nx.Graph()
    for i, p in enumerate(a.pairs):
        weights = _expert_weights(gm, p)
        if weights:
            g.add_node(i)
            g.add_edges_from((i, w) for w in weights)
            if p.row.node in a.leave_at:
                g.add_edge(i, ("leave", a.leave_at[p.row.node]))
    out = []
    for comp in nx.connected_components(g):
        pairs = sorted(i for i in comp if isinstance(i, int))
        out.append([a.pairs[i] for i in pairs])
    return sorted(out, key=lambda ps: a.pairs.index(ps[0]))


class Read(NamedTuple):
    """How a matmul reads its 3-D expert weight: ``kind`` "select" (``node`` is ``W[expert]``), "index"
    (``node`` is ``W[ids]``) or "grouped" (``node`` is the grouped GEMM itself)."""

    kind: str
    node: fx.Node
    expert: int | None = None


def _read(m: ParamMatmul) -> Read | None:
    if m.expert is not None:
        return Read("select", m.chain[0], m.expert)
    if m.kind == "grouped_mm":
        return Read("grouped", m.node)
    if m.chain and m.chain[0].target is aten.index.Tensor:
        return Read("index", m.chain[0])
    return None


def _casts(node: fx.Node) -> list[fx.Node]:
    """``node`` and its casts (autocast's copies of a parameter)."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        out.append(n)
        todo.extend(u for u in n.users if u.target in SAME_SHAPE)
    return out


def _per_expert_read(node: fx.Node) -> str | None:
    """``select(P, 0, e)`` or ``index(P, [ids])``: the kind of a read of one expert's row of a parameter."""
    if node.target is aten.select.int and node.args[1] in (0, -node.meta["val"].dim() - 1) \
            and isinstance(node.args[2], int):
        return "select"
    if node.target is aten.index.Tensor and len(node.args[1]) == 1 and isinstance(node.args[1][0], fx.Node):
        return "index"
    return None


def analyze_experts(gm: fx.GraphModule, a: Analysis) -> ExpertFacts:
    facts = ExpertFacts()
    getattrs = {n.target: n for n in gm.graph.nodes if n.op == "get_attr"}
    every = set().union(*(_expert_weights(gm, p) for p in a.pairs))  # every layer's expert weights
    for pairs in _layers(gm, a):
        module = common_module([p.name for p in pairs])
        layer, why = _layer(gm, pairs, module, getattrs, every)
        if layer is None:
            facts.kept.append((module, why))
            continue
        layer.top_k = _top_k(a.leave_at.get(pairs[0].row.node, pairs[0].row.node))
        layer.width = int(pairs[0].row.node.meta["val"].shape[-1])
        facts.layers.append(layer)
    modular: dict[fx.Node, list[PairFacts]] = {}  # experts as modules: pairs summed into one all-reduce
    for p in a.pairs:
        if not _expert_weights(gm, p) and p.row.node in a.leave_at:
            modular.setdefault(a.leave_at[p.row.node], []).append(p)
    for pairs in modular.values():
        if len(pairs) > 1 and not any(_expert_weights(gm, q) for q in a.pairs if a.leave_at.get(q.row.node)
                                      is a.leave_at[pairs[0].row.node]):
            facts.kept.append((common_module([p.name for p in pairs]), (
                f"its {len(pairs)} experts are separate modules, each cut 1/tp by columns and rows; whole experts "
                "per rank need each projection's experts stored as one 3-D parameter [E, out, in]")))
    return facts


def _top_k(combined: fx.Node) -> int | None:
    """k of the nearest ``topk`` the layer's combined output is computed from (the routing)."""
    seen, todo = {combined}, [combined]
    while todo:
        nxt = []
        for n in todo:
            if n.target is aten.topk.default:
                return int(n.args[1])
            nxt += [x for x in n.all_input_nodes if x not in seen]
            seen.update(n.all_input_nodes)
        todo = nxt
    return None


def _layer(gm: fx.GraphModule, pairs: list[PairFacts], module: str, getattrs: dict, every: set[str]) -> tuple[ExpertLayerFacts | None, str]:
    weights = sorted(set().union(*(_expert_weights(gm, p) for p in pairs)))
    counts = {w: gm.get_parameter(w).shape[0] for w in weights}
    if len(set(counts.values())) != 1:
        return None, f"expert weights disagree on the number of experts: {counts}"
    count = next(iter(counts.values()))
    beside = [m for p in pairs for m in (*p.columns, p.row, *p.sides) if m.weight not in counts]
    if beside:
        # JetMoE's attention experts: their queries meet the keys of one projection every expert's heads read,
        # cut by heads; a rank's whole experts would give whole query heads against its own kv heads
        return None, (f"its experts share a column→row pair with {beside[0].weight}, not an expert's weight, which "
                      "is cut by columns or rows")
    layer = ExpertLayerFacts(module, count, pairs, list(weights))
    matmuls = [m for p in pairs for m in (*p.columns, p.row, *p.sides) if m.weight in counts]
    reads: set[fx.Node] = set()
    for m in matmuls:
        r = _read(m)
        if r is None:
            return None, f"{m.weight} is read whole by {m.node.name} (experts need W[e], W[ids] or a grouped GEMM)"
        reads.add(r.node)
        if r.kind == "select":
            layer.selects.append((r.node, r.expert))
        elif r.kind == "index":
            layer.indexes.append(r.node)
        else:
            layer.grouped.append(r.node)
    chains = {n for m in matmuls for n in (*m.chain, m.node)}
    for w in weights:  # nothing else reads an expert weight
        for n in _casts(getattrs[w]):
            stray = [u for u in n.users if u not in chains and u.target not in SAME_SHAPE
                     and u.target is not aten._assert_tensor_metadata.default]
            if stray:
                return None, f"{w} is also read by {stray[0].name} ({stray[0].target})"
    targets = {m.node for m in matmuls}
    for name, param in gm.named_parameters(remove_duplicate=False):  # per-expert biases, read like the weights
        if name in every or param.dim() == 0 or param.shape[0] != count or name not in getattrs:
            continue
        uses = [u for n in _casts(getattrs[name]) for u in n.users if u.target not in SAME_SHAPE]
        if not uses or any(_per_expert_read(u) is None for u in uses):
            continue
        if not all(module_path(u).startswith(module) for u in uses):
            continue  # another layer's
        late = [u for u in uses if not _forward([u], lambda n: n in targets)]
        if late:
            return None, (f"{name} is read per expert by {late[0].name} after the experts' down-projection "
                          f"(each expert's bias would be added on one rank only)")
        layer.params.append(name)
        for u in uses:
            if _per_expert_read(u) == "select":
                layer.selects.append((u, u.args[2] % count))
            else:
                layer.indexes.append(u)
    layer.selects = list(dict.fromkeys(layer.selects))  # one read may feed several matmuls
    layer.indexes = list(dict.fromkeys(layer.indexes))
    layer.grouped = list(dict.fromkeys(layer.grouped))
    layer.slots = [s for s in (_slot(layer, e, p) for p in pairs for e in _experts_of(p)) if s is not None]
    return layer, ""


def _experts_of(p: PairFacts) -> list[int]:
    return [p.row.expert] if p.row.expert is not None else []


_SLOT_NODES = 200  # an expert's FFN is a few dozen ops; more means its weights flow past its down-projection


def _slot(layer: ExpertLayerFacts, e: int, pair: PairFacts) -> ExpertSlot | None:
    """Expert ``e``'s computation, when it can run on no rows: every node between its weights and its
    down-projection keeps the rows of its inputs as dim 0 and reads no shapes, and nothing else reads them.
    Otherwise (None) the expert computes on all rows with zero weights where it lives elsewhere: exact, slower."""
    out = pair.row.node
    weights = [n for n, x in layer.selects if x == e]
    nodes, todo = set(weights), list(weights)
    while todo:  # what the weights flow into, up to the down-projection
        n = todo.pop()
        if n is out:
            continue
        for u in n.users:
            if u not in nodes:
                nodes.add(u)
                todo.append(u)
            if len(nodes) > _SLOT_NODES:
                return None
    rows = []
    for n in nodes:
        if n is not out and any(u not in nodes for u in n.users):
            return None
        for x in n.all_input_nodes:
            if x not in nodes and x.op != "get_attr" and x not in rows:
                rows.append(x)
        if any(isinstance(a, (list, tuple)) and any(isinstance(b, fx.Node) for b in a) for a in n.args):
            return None  # a shape computed from the rows' count
    if not rows:
        return None
    size = str(out.meta["val"].shape[0])
    from_rows = _forward(rows, lambda n: False, nodes) - set(rows)
    if any(str(x.meta["val"].shape[0]) != size for x in rows) or \
            any(n.meta["val"].dim() == 0 or str(n.meta["val"].shape[0]) != size for n in from_rows):
        return None
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    return ExpertSlot(e, sorted(nodes - set(weights), key=order.__getitem__), rows, out)


def _forward(starts: list[fx.Node], stop, within: set[fx.Node] | None = None) -> set[fx.Node] | bool:
    """What ``starts`` flow into (inside ``within``, when given), or, with a ``stop`` test, whether they reach a
    node that passes it."""
    seen, todo = set(), list(starts)
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen or (within is not None and u not in within):
                continue
            if stop(u):
                return True
            seen.add(u)
            todo.append(u)
    return seen if within is not None else False
