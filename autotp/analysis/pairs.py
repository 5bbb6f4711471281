"""Read-only analysis of a captured graph: which matmuls pair up column→row, and how each is cut.

The graph is viewed as a networkx DiGraph of fx nodes. For every parameter matmul R (in graph order) the
*feeders* of its activation input are the parameter matmuls that reach it without passing through another
parameter matmul. When all of them are still unassigned they are R's column candidates: the sharding is
propagated from them to R (:mod:`autotp.analysis.propagate`). A region that cannot be sharded exactly is left
replicated and reported with the reason; a head count that cannot be split raises ``ShardingError``.

Facts are written to ``node.meta["autotp"]``; the planner turns them into a :class:`~autotp.plan.plan.Plan`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from autotp.analysis.matmuls import ParamMatmul, find_param_embeddings, find_param_matmuls, where
from autotp.analysis.channels import ChannelForm, channel_form, check_columns_inside, summed_inputs
from autotp.analysis.low_rank import low_rank_branches
from autotp.analysis.op_rules import kind_of
from autotp.analysis.ops import Unshardable
from autotp.analysis.partial import deferred

if TYPE_CHECKING:
    import networkx as nx
from autotp.analysis.pair_cuts import column_specs, cut_pair
from autotp.analysis.pair_region import SharedValues
from autotp.analysis.propagate import PairRegion, propagate
from autotp.analysis.shapes import Fingerprinter
from autotp.shard_spec import Sharding, strided

aten = torch.ops.aten


@dataclass
class PairFacts:
    name: str  # the module that holds the pair, e.g. ``transformer.h.0.attn``
    columns: list[ParamMatmul]
    row: ParamMatmul
    column_specs: dict[str, Sharding]  # column node name -> output sharding
    region: PairRegion
    # a channel-parallel mixer's reducing projections (row-parallel inside the region, autotp.analysis.channels)
    reduces: list[ParamMatmul] = field(default_factory=list)
    summed: frozenset[fx.Node] = frozenset()  # column inputs whose gradient the reductions' all-reduce sums
    # other row-parallel matmuls of the same columns (:func:`_side_rows`), their inputs cut as ``region.sides``
    sides: list[ParamMatmul] = field(default_factory=list)


@dataclass
class Analysis:
    tp: int
    matmuls: list[ParamMatmul]
    pairs: list[PairFacts] = field(default_factory=list)
    replicated: list[tuple[str, str]] = field(default_factory=list)  # (module, reason): what could not be cut
    # (module, reason): matmuls whole by design, not gaps (a router or a gate: every rank needs all its outputs)
    by_design: list[tuple[str, str]] = field(default_factory=list)
    # row -> the node after which its all-reduce runs, shared with other rows (experts summed by the router)
    leave_at: dict[fx.Node, fx.Node] = field(default_factory=dict)
    # (module, reason) of a failed pair -> its row matmul (a row later made an LM head says nothing is whole)
    failed_rows: dict[tuple[str, str], fx.Node] = field(default_factory=dict)
    # that node -> (reader, value): learned factors of its partial sums (the router's weights), entering f
    partial_enter: dict[fx.Node, list[tuple[fx.Node, fx.Node]]] = field(default_factory=dict)


def dataflow_graph(gm: fx.GraphModule) -> nx.DiGraph:
    import networkx as nx  # imported here: reading a Plan reaches this file and needs no graph

    g = nx.DiGraph()
    for node in gm.graph.nodes:
        g.add_node(node)
        for inp in node.all_input_nodes:
            g.add_edge(inp, node)
    for write, reader in _written_then_read(gm):
        g.add_edge(write, reader)
    return g


def _written_then_read(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(write, reader) for each in-place write into a tensor (or a view of it) and each later read of that tensor
    or its views: the written value flows on to what reads the tensor after it, though no graph edge says so
    (RWKV's WKV loop writes each step into ``output[:, t]`` of ``output = zeros_like(key)``, and the output
    projection reads ``output`` after the loop: the values, through those writes, are its input)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for node in gm.graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or not op._schema.is_mutable \
                or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        base = node.args[0]
        while _is_view(base) and isinstance(base.args[0], fx.Node):
            base = base.args[0]
        views, todo = set(), [base]
        while todo:  # the tensor and every view of it, wherever made
            n = todo.pop()
            views.add(n)
            todo.extend(u for u in n.users if _is_view(u) and u.args[0] is n and u not in views)
        out += [(node, r) for v in views for r in v.users if order[r] > order[node]]
    return out


def _is_view(node: fx.Node) -> bool:
    """Does ``node`` return a view of its first argument (its schema says the result aliases it, unwritten)?"""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or op._schema.is_mutable:
        return False
    returns = op._schema.returns
    return bool(returns) and returns[0].alias_info is not None


def feeders(g: nx.DiGraph, matmul_nodes: set[fx.Node]) -> dict[fx.Node, frozenset[fx.Node]]:
    """For each node, the parameter matmuls that reach it with no other parameter matmul in between.

    Shape reads (``sym_size``) carry no data and are not followed, nor are integer and boolean values (a
    router's choice of experts indexes their weights and tokens; it is no input of theirs to cut).
    """
    import networkx as nx

    out: dict[fx.Node, frozenset[fx.Node]] = {}
    empty: frozenset[fx.Node] = frozenset()
    for node in nx.topological_sort(g):
        val = node.meta.get("val")
        if node.op != "call_function" or node.target is aten.sym_size.int \
                or (isinstance(val, torch.Tensor) and not (val.dtype.is_floating_point or val.dtype.is_complex)):
            out[node] = empty
            continue
        acc: set[fx.Node] = set()
        for inp in g.predecessors(node):
            if inp in matmul_nodes:
                acc.add(inp)
            else:
                acc |= out[inp]
        out[node] = frozenset(acc) if acc else empty
    return out


def common_module(paths: list[str]) -> str:
    parts = os.path.commonprefix([p.split(".") for p in paths if p])
    return ".".join(parts)


def analyze(gm: fx.GraphModule, tp: int) -> Analysis:
    """Find the column→row pairs of ``gm`` for tensor-parallel size ``tp``.

    A weight the forward uses more than once (a block applied in a loop, a block listed twice, weights tied
    between blocks) is cut when every use is cut alike: each one a column, or each one a row, of a pair, on the
    same dim in the same segments; its one shard then serves every use. Otherwise the pairs are found again
    with that weight left whole, and every pair using it with it."""
    matmuls = find_param_matmuls(gm)
    embeddings = {e.node: e for e in find_param_embeddings(gm)}
    weight_uses: dict[tuple[str, int | None], int] = {}  # one expert W[e] of a 3-D W is a weight of its own
    for m in [*matmuls, *embeddings.values()]:
        weight_uses[m.key] = weight_uses.get(m.key, 0) + 1
    banned: set[tuple[str, int | None]] = set()
    unshared: set[fx.Node] = set()  # embedding columns whose values another region may not read cut
    while True:
        # each attempt writes its own facts: none left by an earlier attempt, or by an analysis of this graph at
        # another tp (``autotp plan --auto`` plans one capture at every tp), may be read as this one's
        for node in gm.graph.nodes:
            node.meta.pop("autotp", None)
        result = _analyze(gm, tp, matmuls, embeddings, weight_uses, banned, frozenset(unshared))
        unlike = _cut_unlike(result, weight_uses) - banned
        stray = _stray_shared(result)
        if not unlike and not stray:
            return result
        banned |= unlike
        unshared |= stray


def _stray_shared(result: Analysis) -> set[fx.Node]:
    """The embedding columns whose values a region left cut for later regions where a reader is in none, or in
    one that reads them as whole (slices them, or lets them enter through f): found again, each is cut only where
    all its readers are in its own region."""
    inside = {n for p in result.pairs for n in (*p.region.specs, *p.region.stats)}
    whole = {x.operand for p in result.pairs for x in (*p.region.slices, *p.region.entering)}
    return {c.node for p in result.pairs if p.region.shared for c in p.columns if c.kind == "embedding"
            if any(n in whole or any(u not in inside and kind_of(u.target) not in ("no_output", "sym_size")
                                     for u in n.users) for n in p.region.shared)}


def _cut_unlike(result: Analysis, weight_uses: dict[tuple[str, int | None], int]) -> set[tuple[str, int | None]]:
    """The weights used more than once whose uses are not all cut alike by ``result``'s pairs."""
    cuts: dict[tuple[str, int | None], list[tuple]] = {}
    for p in result.pairs:
        for c in p.columns:
            cuts.setdefault(c.key, []).append(("column", c.out_dim, p.column_specs[c.node.name].segments))
        cuts.setdefault(p.row.key, []).append(("row", p.row.in_dim, p.region.row_input.segments))
        for m in p.sides:
            cuts.setdefault(m.key, []).append(("row", m.in_dim, p.region.sides[m.node].segments))
    # a per-head parameter the regions cut (a layer applied again in a loop reads it once per application): every
    # reader of it is in a pair's region, and every region cuts it alike
    params: dict[fx.Node, list[tuple]] = {}
    covered: dict[fx.Node, set[fx.Node]] = {}
    for p in result.pairs:
        for x in p.region.params:
            if x.node.op == "get_attr":
                params.setdefault(x.node, []).append((x.dim, x.sharding.segments))
                covered.setdefault(x.node, set()).update(u for u in x.node.users
                                                         if u in p.region.specs or u in p.region.stats)
    return {key for key, n in weight_uses.items()
            if n > 1 and key in cuts and (len(cuts[key]) != n or len(set(cuts[key])) != 1)} | \
        {(x.target, None) for x, c in params.items() if len(set(c)) != 1 or covered[x] != set(x.users)}


def _analyze(gm: fx.GraphModule, tp: int, matmuls: list[ParamMatmul], embeddings: dict[fx.Node, ParamMatmul],
             weight_uses: dict[tuple[str, int | None], int], banned: set[tuple[str, int | None]],
             unshared: frozenset[fx.Node] = frozenset()) -> Analysis:
    g = dataflow_graph(gm)
    feed = feeders(g, {m.node for m in matmuls} | set(embeddings))
    shared = head_shared(matmuls, feed)
    if shared:  # read through, as any matmul of a replicated operand: the feeders are found again without them
        matmuls = [m for m in matmuls if m.node not in shared]
        feed = feeders(g, {m.node for m in matmuls} | set(embeddings))
    result = Analysis(tp, matmuls)
    by_node = {m.node: m for m in matmuls}
    fp = Fingerprinter(gm)
    assigned: set[fx.Node] = set()
    failed: set[fx.Node] = set()
    attempts: list[tuple[fx.Node, str, str]] = []  # (row, module, reason) of the pairs that failed
    # attention first: its output projection's pair is the one to keep where a low-rank projection (DeepSeek's
    # q_a -> q_b) could otherwise pair with the up-projection that attention reads
    order = _order(gm)  # once: a graph walk per pair would make a deep model's analysis quadratic
    attention = _after_attention(gm, by_node.keys() | embeddings.keys())
    inside: set[fx.Node] | None = None  # per-head matmuls a channel-parallel region computes through
    read_whole: set[fx.Node] = set()  # matmuls feeding a paired column's input: their output stays whole
    # a low-rank branch's second matmul last: the row of the projection it is added to takes it as a column first
    late = low_rank_branches(matmuls, feed)
    # values of an embedding column that later regions read cut (CPM-Ant's position bias, every layer's)
    seeds: dict[fx.Node, Sharding] = {}
    sharing: set[fx.Node] = set()  # the embeddings that left them
    shareable = frozenset(embeddings) - unshared
    for row in sorted(matmuls, key=lambda m: (not attention[m.x], m.node in late)):
        # an embedding an earlier pair cut is no column here: its values are read as that pair left them
        cols = (feed[row.x] | ({row.x} if row.x in by_node else frozenset())) - sharing
        # a matmul that feeds another candidate's input is no column of this pair (a column's input is whole):
        # DeepSeek's kv down-projection feeds the kv up-projection, and its rotary key part reaches attention
        inner = set().union(*(feed[by_node[d].x] for d in cols if d in by_node))  # once per row: a row reading
        cols = frozenset(c for c in cols if c not in inner)  # the residual stream has every earlier block's rows
        # nor is a matmul whose output a column already paired reads whole (DeepSeek-V3.2's q latent, read by
        # q_b_proj of attention's pair and by the sparse-attention indexer's wq_b): cut, it would reach that
        # column sharded, so such an attempt can only fail, and would report the block as left replicated
        cols = cols - read_whole
        # an embedding of the ids joins a pair beside its column matmuls (a value embedding added to v: cut
        # by its feature columns like v), never starts one (the token embedding before the first block)
        if not cols - set(embeddings) or row.node in assigned or cols & assigned:
            continue
        columns = [by_node.get(c) or embeddings[c] for c in sorted(cols, key=order)]
        name = common_module([c.module for c in columns if c.kind != "embedding"] + [row.module]) or row.module \
            or "<root>"
        shared = [m.weight for m in [*columns, row] if m.key in banned]
        if shared:  # an attempt that failed: a row later made an LM head (a tied decoder) says nothing is whole
            attempts.append((row.node, name, f"weight {shared[0]} is used by more than one matmul, and its uses "
                                             "cannot all be cut alike"))
            failed |= set(cols) | {row.node}
            continue
        sides, shared = [], SharedValues(seeds, shareable)
        try:
            try:
                specs, region = cut_pair(columns, row, fp, tp, name, shared=shared)
            except Unshardable as first:
                for kept in _fewer_columns(columns, first, g):
                    # the pair is the module that holds what it cuts: a layer's gate and projection, not the
                    # model that also holds the per-layer projection read whole
                    narrow = common_module([c.module for c in kept if c.kind != "embedding"] + [row.module]) \
                        or row.module or "<root>"
                    try:
                        specs, region = cut_pair(kept, row, fp, tp, narrow, shared=shared)
                        columns, cols, name = kept, frozenset(c.node for c in kept), narrow
                        break
                    except Unshardable:
                        continue
                else:
                    sides = _side_rows(first, cols, row, by_node, feed, assigned | failed)
                    if not sides:
                        sides, more = _joined_rows(first, cols, row, by_node, feed, assigned | failed, g)
                        if not sides:
                            raise first from None
                        joined = sorted(cols | more, key=order)
                        specs, region = cut_pair([by_node[c] for c in joined], row, fp, tp, name, sides, shared)
                        columns, cols = [by_node[c] for c in joined], frozenset(joined)
                    else:
                        specs, region = cut_pair(columns, row, fp, tp, name, sides, shared)
            _refuse_banned(region, banned)
        except Unshardable as e:
            if inside is None:  # once: the matmuls a mixer's region computes through, and the feeders without them
                inside = _per_head(gm, by_node)
                feed_c = feeders(g, (set(by_node) - inside) | set(embeddings)) if inside else feed
            found = feed_c[row.x] | ({row.x} if row.x in by_node else frozenset())
            mixer = None if found & assigned or row.node in inside else \
                channel_form(found, feed_c, {n: m for n, m in by_node.items() if n not in inside}, weight_uses,
                             order, bool(inside & feed[row.x]))
            if mixer is not None:
                try:
                    pair = _channel_pair(mixer, row, fp, tp)
                    _refuse_banned(pair.region, banned)
                    result.pairs.append(pair)
                    assigned |= found | {row.node} | {m.node for m in mixer.reduces} | _within(inside, result.pairs[-1])
                    continue
                except Unshardable as why:
                    e = why
            # a block left whole is reported once: a later attempt that pairs its output projection with
            # the next block's input fails only because of it
            if not cols & failed:
                attempts.append((row.node, name, f"{e.reason} (at {where(e.node)})"))
            failed |= set(cols) | {row.node}
            continue
        for n, s in region.specs.items():
            n.meta["autotp"] = s
        result.pairs.append(PairFacts(name, columns, row, {c.name: strided(s, fp.shape(c)[s.dim])
                                                           for c, s in specs.items()}, region, sides=sides))
        assigned |= set(cols) | {row.node} | {m.node for m in sides}
        if region.shared:
            seeds.update(region.shared)
            sharing.update(c.node for c in columns if c.kind == "embedding")
        read_whole.update(*(feed[c.x] for c in columns if c.kind != "embedding"))
    _whole_experts(result, matmuls, assigned)
    order = _order(gm)
    result.pairs.sort(key=lambda p: order(p.row.node))  # graph order, whichever was paired first
    # a failed attempt whose row matmul was then paired another way (a gate of the block input tried as the
    # column of q) says nothing about what is left whole
    result.replicated += [(name, why) for row, name, why in attempts if row not in assigned]
    result.failed_rows = {(name, why): row for row, name, why in attempts}
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    d = deferred([m.node for p in result.pairs for m in (p.row, *p.sides) if m.bias is None], params)
    result.leave_at, result.partial_enter = d.leave_at, d.enter
    return result


def _fewer_columns(columns: list[ParamMatmul], first: Unshardable, g: nx.DiGraph) -> list[list[ParamMatmul]]:
    """The columns to try again where cutting all of them failed at ``first``, each with a column read whole:
    without the embeddings (a table every head reads alike: RoFormer's sin | cos by position), then without the
    columns the failing op reads (Inkling's router, whose logits its top-k reads whole and whose shared-expert
    weights scale the shared experts' hidden features before their down projection). Propagation checks that
    what is read whole meets the cut values exactly (broadcast over them, its gradient summed by f)."""
    import networkx as nx

    out = []
    kept = [c for c in columns if c.kind != "embedding"]
    if kept and len(kept) < len(columns):
        out.append(kept)
    clear = [c for c in columns if first.node in g and not nx.has_path(g, c.node, first.node)]
    if clear and len(clear) < len(columns) and clear not in out:
        out.append(clear)
    return out


def _refuse_banned(region: PairRegion, banned: set[tuple[str, int | None]]) -> None:
    """Unshardable where ``region`` cuts a parameter that another reader does not read cut alike (found by the
    last attempt's :func:`_cut_unlike`)."""
    for x in region.params:
        if (x.node.target, None) in banned:
            raise Unshardable(x.node, f"{x.node.target} spans the sharded dim and is also read where it is not cut "
                                      "alike")


def _side_rows(e: Unshardable, cols: frozenset[fx.Node], row: ParamMatmul, by_node: dict[fx.Node, ParamMatmul],
               feed: dict[fx.Node, frozenset[fx.Node]], taken: set[fx.Node]) -> list[ParamMatmul]:
    """Where a sharded value of the pair escapes into another parameter matmul fed by the pair's columns alone
    (PaLM's and Falcon's parallel block: the feed-forward's output projection reads the ``ff`` segment of the
    one fused ``q | k | v | ff`` projection whose ``q | k | v`` attention's output projection reads): every such
    matmul, to be row-parallel beside ``row``. It cannot feed ``row`` (the columns are all ``row``'s feeders);
    a matmul whose weight is 3-D (an expert's) is one only as another expert of ``row``'s weight: tokens split
    by the experts' counts and joined again (JetMoE's ``ParallelExperts``: ``x.split(counts)``, one ``W[e]`` per
    piece, ``cat`` over the rows) give every expert's up-projection output to every down-projection's input, so
    the experts' down-projections are the rows of one pair. Empty where the escape is not into one of them."""
    found = [m for n, m in by_node.items() if n is not row.node and n not in taken and n not in cols
             and (m.expert is None or (row.expert is not None and m.weight == row.weight))
             and m.kind != "embedding" and m.x.meta["val"].dim() >= 2
             and (feed[m.x] | ({m.x} if m.x in by_node else frozenset())) <= cols and feed[m.x]]
    return found if any(e.node is m.node for m in found) else []


def _joined_rows(e: Unshardable, cols: frozenset[fx.Node], row: ParamMatmul, by_node: dict[fx.Node, ParamMatmul],
                 feed: dict[fx.Node, frozenset[fx.Node]], taken: set[fx.Node], g: nx.DiGraph
                 ) -> tuple[list[ParamMatmul], frozenset[fx.Node]]:
    """Where the pair's columns are also read beside columns of another row's (XLNet's two streams: k and v of
    the content stream are read by the query stream's attention too, whose query is the same weight applied to
    the other stream, and its output projection is the same weight again): those rows, row-parallel beside
    ``row``, and their columns that the pair lacks, closed over every row that reads any of the columns. The
    failure must lie on the way to an added row (a replicated query meeting the cut keys, a cut key escaping
    into the other stream's attention), else the first reason stands. Empty where no such row is found."""
    import networkx as nx

    have, rows = set(cols), []
    grew = True
    while grew:
        grew = False
        for n, m in by_node.items():
            if n is row.node or n in taken or n in have or m in rows or m.expert is not None \
                    or m.kind == "embedding" or m.x.meta["val"].dim() < 2:
                continue
            f = feed[m.x] | ({m.x} if m.x in by_node else frozenset())
            if f & have and not f & taken and all(c in by_node for c in f):
                rows.append(m)
                have |= f
                grew = True
    more = frozenset(have - cols)
    if not more or e.node not in g or not any(nx.has_path(g, e.node, m.node) for m in rows):
        return [], frozenset()
    return rows, more


def head_shared(matmuls: list[ParamMatmul], feed: dict[fx.Node, frozenset[fx.Node]]) -> set[fx.Node]:
    """Matmuls by one 2-D parameter shared by every head: the input is a column's output viewed into heads,
    ``(.., n, .., d)`` with ``n·d`` the column's features (or a segment's: q of a fused q | k | v), and only ``d``
    is contracted (Inkling's relative logits, ``r_proj(x).view(b, s, n, d_rel) @ proj [d_rel, extent]``; relative
    logits of the queries, ``q @ rel.t()``). The heads are a batch dim of the matmul, so it is no column and no
    row of a pair: cut with the heads, each rank applies the whole weight to its own heads, and the weight's
    gradient, partial per rank, is summed (it enters through f, as a per-head norm's weight does). The heads are a
    dim of their own, of a static size, neither the first (the batch, static where captured so) nor a sequence
    (symbolic): the input has 4 dims or more."""
    by_node = {m.node: m for m in matmuls}
    out = set()
    for m in matmuls:
        val = m.x.meta.get("val")
        if m.expert is not None or m.kind == "embedding" or not isinstance(val, torch.Tensor) or val.dim() < 4:
            continue
        xd = m.x_dim % val.dim()
        widths = {by_node[c].out_features for c in feed[m.x] if c in by_node}
        if any(isinstance(n, int) and n > 1 and any(w % (n * m.in_features) == 0 for w in widths)
               for d, n in enumerate(val.shape) if d not in (0, xd)):
            out.add(m.node)
    return out


def _per_head(gm: fx.GraphModule, by_node: dict[fx.Node, ParamMatmul]) -> set[fx.Node]:
    """Matmuls by a 3-D parameter read whole, one matrix per head of a batch dim of the input (RecurrentGemma's
    block-diagonal gates, ``einsum('... h i, h i j -> ... h j', x, w)``): inside a channel-parallel region
    they are cut with the heads, like any per-head parameter, not paired themselves."""
    return {n for n, m in by_node.items() if m.expert is None and gm.get_parameter(m.weight).dim() == 3}


def _within(inside: set[fx.Node], pair: PairFacts) -> set[fx.Node]:
    """The per-head matmuls ``pair``'s region computes through (sharded there)."""
    return {n for n in inside if n in pair.region.specs}


def _channel_pair(form: ChannelForm, row: ParamMatmul, fp: Fingerprinter, tp: int) -> PairFacts:
    """The region of a channel-parallel mixer (:mod:`autotp.analysis.channels`): its columns cut per segment,
    its reductions row-parallel inside it; raises Unshardable where the cut does not stay local."""
    name = common_module([m.module for m in [*form.columns, *form.reduces, row]]) or row.module
    # cut by channels: a column's features are never one head, whatever batched matmul of the scan reads them
    specs = column_specs(form.columns, fp, tp, one_head=False)
    region = propagate(specs, row.node, row.x, fp, tp, name, row.x_dim,
                       reduces={m.node: (m.x, m.x_dim) for m in form.reduces})
    check_columns_inside(form, region)
    for n, s in region.specs.items():
        n.meta["autotp"] = s
    return PairFacts(name, form.columns, row, {c.name: s for c, s in specs.items()}, region, form.reduces,
                     frozenset(summed_inputs(form, region)))


def _after_attention(gm: fx.GraphModule, matmuls: set[fx.Node]) -> dict[fx.Node, bool]:
    """For every node: does it read attention's output (scaled_dot_product_attention, or a product of two
    activations) with no parameter matmul in between? One pass in graph order, so that the rows of a deep
    model, which all read the residual stream back to the first block, cost one walk in all."""
    out: dict[fx.Node, bool] = {}
    for n in gm.graph.nodes:
        if n in matmuls or n.op != "call_function":
            out[n] = False
        elif n.target is aten.scaled_dot_product_attention.default or (
                n.target in (aten.matmul.default, aten.bmm.default, aten.baddbmm.default)
                and not any(a.op == "get_attr" for a in n.all_input_nodes)):
            out[n] = True
        else:
            out[n] = any(out[a] for a in n.all_input_nodes)
    return out


def _whole_experts(result: Analysis, matmuls: list[ParamMatmul], assigned: set[fx.Node]) -> None:
    """A 3-D parameter read one expert at a time (``W[e]``) is cut once for all experts: every expert's matmul
    must be in a pair that cuts it the same way, else the pairs of all its experts are undone (left whole)."""
    while True:
        cuts: dict[str, set] = {}
        for p in result.pairs:
            for m, segs, role in [*((c, p.column_specs[c.node.name].segments, "column") for c in p.columns),
                                  (p.row, p.region.row_input.segments, "row")]:
                if m.expert is not None:
                    cuts.setdefault(m.weight, set()).add((role, m.out_dim if role == "column" else m.in_dim, segs))
        bad = {}
        for m in matmuls:
            if m.expert is None:
                continue
            if m.node not in assigned:
                bad.setdefault(m.weight, f"expert {m.expert} of {m.weight} (at {m.node.name}) is in no column→row "
                                         "pair, and the experts share one parameter")
            elif len(cuts.get(m.weight, ())) > 1:
                bad.setdefault(m.weight, f"the experts of {m.weight} would be cut in different ways")
        undo = [p for p in result.pairs if any(m.weight in bad for m in [*p.columns, p.row])]
        if not undo:
            return
        for p in undo:
            result.pairs.remove(p)
            for n in p.region.specs:
                n.meta.pop("autotp", None)
            assigned -= {m.node for m in [*p.columns, p.row]}
            why = next(bad[m.weight] for m in [*p.columns, p.row] if m.weight in bad)
            result.replicated.append((p.name, why))


def _order(gm: fx.GraphModule):
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda n: index[n]
