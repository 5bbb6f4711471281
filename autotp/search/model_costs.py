"""What a model costs, as the layout search needs it, read once from its captured graph and its plans.

The search (:mod:`autotp.search.auto`) prices hundreds of layouts; it cannot capture the model for each. It
reads a :class:`ModelCosts` instead: per sample and per forward, the FLOPs of the blocks, of the code
before them (embeddings) and after them (final norm, LM head, loss), and the ops each dispatches; and, for
each tensor-parallel size the plan was made for, the parameters one rank holds in the blocks and at either
end, and the collectives a sample's forward and backward run in the blocks and at either end. Every number comes from the graph's
shapes (:mod:`autotp.analysis.flops`) and from the plan (:mod:`autotp.reports.sharding`); nothing from names.

FLOPs and collective sizes are linear in the batch: they are taken at the captured batch and divided by it.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx

from autotp.analysis.flops import node_flops, shape_of
from autotp.plan.pieces import piece_keys
from autotp.reports.pipeline import block_facts
from autotp.plan.plan import Plan
from autotp.reports.sharding import Report, itemsize

FIRST, BLOCKS, LAST = "first", "blocks", "last"


@dataclass(frozen=True)
class Comm:
    """Collectives of one sample's step in one part of the model, on one tensor-parallel rank."""

    kind: str  # "all_reduce" | "reduce_scatter" | "all_gather"
    direction: str  # "forward" | "backward"
    count: int  # per sample's step (the blocks: all of them together)
    elements: int  # together, per sample


@dataclass(frozen=True)
class TpCosts:
    tp: int
    params: Mapping[str, int]  # part -> parameters one tp rank holds (elements; vocab padding included)
    comm: Mapping[str, tuple[Comm, ...]]  # part -> its collectives
    flops_split: float  # the share of the matmul FLOPs that tp splits (1.0: every matmul sharded)


@dataclass(frozen=True)
class ModelCosts:
    layers: int  # repeated blocks
    seq: int
    hidden: int
    heads: int | None
    vocab: int | None
    flops: Mapping[str, float]  # part -> forward FLOPs per sample
    ops: Mapping[str, int]  # part -> ops its forward dispatches (each a kernel launch on a GPU)
    params: int  # every distinct parameter, counted once
    param_bytes: int  # bytes per parameter element (the model's dtype)
    fused_attention: bool  # scaled_dot_product_attention: no s×s scores kept
    dropout: bool
    tps: Mapping[int, TpCosts]
    # context parallelism: why it cannot run on this model (None: it can, every attention as a ring), and what
    # a ring gathers per layer: K's and V's elements per token together, and their heads
    cp_refused: str | None = None
    kv_width: int | None = None  # None: K and V as wide as the hidden size
    kv_heads: int | None = None

    @property
    def block_flops(self) -> float:
        """Forward FLOPs of one block for one sample."""
        return self.flops[BLOCKS] / self.layers

    def tp(self, t: int) -> TpCosts:
        return self.tps[t]


def _parts(gm: fx.GraphModule, blocks: list[str]) -> dict[fx.Node, str]:
    keys = piece_keys(gm, blocks)
    last = 2 * len(blocks)
    return {n: FIRST if k == 0 else LAST if k == last else BLOCKS for n, k in keys.items()}


def _param_parts(gm: fx.GraphModule, parts: dict[fx.Node, str]) -> dict[str, set[str]]:
    """The parts that read each parameter (a tied embedding and head: both ends)."""
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    out: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in params:
            out.setdefault(node.target, set()).update(parts[u] for u in node.users if u in parts)
    return out


def _hidden_and_vocab(gm: fx.GraphModule, parts: dict[fx.Node, str]) -> tuple[int, int | None]:
    """h: the last dim of what the first part hands the blocks (the embeddings' output) and of what the
    blocks hand on (the residual stream: a model of blocks alone has no first part, only rotary tables);
    V: the widest output dim of a matmul after the blocks (the LM head)."""
    hidden, vocab = 0, None
    for node, part in parts.items():
        shape = shape_of(node)
        hands = (FIRST, BLOCKS) if part == FIRST else (LAST, None) if part == BLOCKS else ()
        if shape and hands and any(parts.get(u) in hands and (part, parts.get(u)) != (FIRST, FIRST)
                                   for u in node.users):
            hidden = max(hidden, shape[-1])
        if part == LAST and node_flops(node) and shape:
            vocab = max(vocab or 0, shape[-1])
    return hidden, vocab


def tp_costs(plan: Plan, report: Report, gm: fx.GraphModule, parts: dict[fx.Node, str],
             owners: dict[str, set[str]]) -> TpCosts:
    """One tensor-parallel size's parameters and collectives per part, per sample."""
    params = {FIRST: 0, BLOCKS: 0, LAST: 0}
    for row in report.params:
        elements = row.local_bytes // max(1, itemsize(row.dtype, 4))
        where = set().union(*(owners.get(a, set()) for a in row.aliases)) or {BLOCKS}
        for part in where:  # a tied weight lives on both ends (two pipeline stages hold it)
            params[part] += elements
    by_node = {n.name: parts.get(n) for n in gm.graph.nodes}
    counts: dict[tuple[str, str, str], list[int]] = {}
    for c in report.collectives:
        part = by_node.get(c.node) or BLOCKS
        acc = counts.setdefault((part, c.kind, c.direction), [0, 0])
        acc[0] += 1
        acc[1] += (c.elements or 0)
    b = max(1, report.batch)
    comm = {p: tuple(Comm(k, d, n, e // b) for (q, k, d), (n, e) in sorted(counts.items()) if q == p)
            for p in (FIRST, BLOCKS, LAST)}
    split = _split_share(plan, gm) if plan.tp > 1 else 1.0
    return TpCosts(plan.tp, params, comm, split)


def _split_share(plan: Plan, gm: fx.GraphModule) -> float:
    """The share of the matmul FLOPs tp splits: a matmul reading a sharded weight runs on its 1/t, and so
    does one reading no weight (attention, on the rank's heads); one reading a replicated weight (a router, a
    projection left whole) runs in full on every rank."""
    sharded = {name for name, _ in plan.params}
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    total = whole = 0
    for node in gm.graph.nodes:
        f = node_flops(node)
        if not f:
            continue
        total += f
        reads = {a.target for a in node.all_input_nodes if a.op == "get_attr" and a.target in params}
        if reads and not reads & sharded:
            whole += f
    return 1 - whole / total if total else 1.0


def context_costs(gm: fx.GraphModule) -> tuple[str | None, int | None, int | None]:
    """(why context parallelism cannot run, K's and V's width per token, their heads) from the context plan
    the ranks would make (:mod:`autotp.plan.context_planner`): the ring's operands' (b, heads, s, d) shapes."""
    from autotp.errors import AutotpError
    from autotp.parallel.planning import context_of

    try:
        plan = context_of(gm, 2)
    except AutotpError as exc:  # the first op that stops it, with its line (the header says no more than that)
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return (lines[1] if len(lines) > 1 else lines[0]).rstrip(":"), None, None
    if plan.keyed:  # the search prices rings: (s/cp, s) scores and whole K and V kept are not in its model
        call = plan.keyed[0]
        return (f"{call.out}: attention whose scores no ring computes runs with its keys gathered, which the "
                "layout search does not price"), None, None
    nodes = {n.name: n for n in gm.graph.nodes}
    if not plan.attention:
        return "no attention over the sequence to run as a ring", None, None
    ring = plan.attention[0]
    operands = [nodes[x] for x in ring.inputs] if ring.inputs else list(nodes[ring.node].args[:3])
    k, v = (shape_of(x) for x in operands[1:3])
    if not (k and v and len(k) == 4 and len(v) == 4):
        return None, None, None
    return None, k[1] * k[3] + v[1] * v[3], k[1]


def model_costs(gm: fx.GraphModule, plans: Iterable[tuple[Plan, Report]], batch: int) -> ModelCosts:
    """The costs of ``gm`` (captured at ``batch`` samples) from its plans at several tensor-parallel sizes."""
    plans = list(plans)
    first_plan = plans[0][0]
    blocks = [u.module for u in first_plan.units if u.kind == "block"]
    if not blocks:
        raise ValueError("the layout search needs repeated blocks (the transformer layers) to cut into stages "
                         "and to price per layer; this model's graph has none")
    parts = _parts(gm, blocks)
    flops = {FIRST: 0.0, BLOCKS: 0.0, LAST: 0.0}
    ops = {FIRST: 0, BLOCKS: 0, LAST: 0}
    for node, part in parts.items():
        flops[part] += node_flops(node) / batch
        ops[part] += node.op == "call_function"

    hidden, vocab = _hidden_and_vocab(gm, parts)
    in_blocks = {n for n, p in parts.items() if p == BLOCKS}
    heads, dropout, fused = block_facts(gm, in_blocks)
    owners = _param_parts(gm, parts)
    seen: dict[int, torch.Tensor] = {}
    for _, p in gm.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), p)
    total = sum(p.numel() for p in seen.values())
    elem = max((p.element_size() for p in seen.values()), default=4)
    seq = plans[0][1].seq
    tps = {plan.tp: tp_costs(plan, report, gm, parts, owners) for plan, report in plans}
    cp_refused, kv_width, kv_heads = context_costs(gm)
    return ModelCosts(len(blocks), seq, hidden, heads, vocab, flops, ops, total, elem, fused, dropout, tps,
                      cp_refused, kv_width, kv_heads)


def capture_costs(net: torch.nn.Module, args: tuple, kwargs: dict, tps: Iterable[int], batch: int,
                  seq: int) -> ModelCosts:
    """Capture ``net`` once on ``(args, kwargs)`` (``batch`` samples of ``seq`` tokens) and plan it at each
    tensor-parallel size in ``tps``; a size the planner refuses is left out (the search skips it)."""
    from autotp.parallel.planning import How, PlanJob, capture_and_plan
    from autotp.reports.sharding import build_report

    planned = capture_and_plan(net, args, kwargs, PlanJob(1), how=How(device=torch.device("cpu")),
                               tps=set(tps) | {1}, skip_refused=True)
    named = list(net.named_parameters(remove_duplicate=False))
    plans = [(plan, build_report(plan, named, batch, seq)) for _, plan in sorted(planned.plans.items())]
    return model_costs(planned.gm, plans, batch)
