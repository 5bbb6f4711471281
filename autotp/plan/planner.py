"""Turn the analysis of a captured graph into a :class:`~autotp.plan.plan.Plan`."""
from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx

from autotp.analysis.coverage import whole_params
from autotp.analysis.experts import ExpertFacts, ExpertLayerFacts
from autotp.analysis.pairs import Analysis, common_module
from autotp.analysis.result import GraphFacts, analyze_graph
from autotp.errors import ShardingError, own_bug
from autotp.analysis.matmuls import ParamMatmul, column_form, module_path
from autotp.analysis.op_rules import kind_of
from autotp.analysis.ops import STAT_KINDS, reaches, reduction_args
from autotp.plan.plan import (SEQ_PARAMS, Collective, ColumnForm, ExpertLayer, ExpertSlot, GatheredOutput, GraphCut,
                              LocalSlice, PairPlan, ParamShard, Plan, Rewrite, SeqEnter, SeqGather, SeqLeave, SeqSlice,
                              SequencePlan, ShardedInput, Stat, Unit, VocabLoss, VocabPlan, WholeParam)
from autotp.analysis.sequence import SeqFacts
from autotp.plan.stages import StageRequest, plan_stages
from autotp.shard_spec import Segment, VocabRows
from autotp.analysis.vocab import VocabFacts

aten = torch.ops.aten


@dataclasses.dataclass
class _Planned:
    """What planning the pairs and the vocab-parallel layers collects for the Plan, in graph order."""

    params: dict[str, ParamShard] = dataclasses.field(default_factory=dict)
    buffers: dict[str, ParamShard] = dataclasses.field(default_factory=dict)
    pairs: list[PairPlan] = dataclasses.field(default_factory=list)
    rewrites: list[Rewrite] = dataclasses.field(default_factory=list)
    collectives: list[Collective] = dataclasses.field(default_factory=list)
    random_nodes: list[str] = dataclasses.field(default_factory=list)
    gathered: list[GatheredOutput] = dataclasses.field(default_factory=list)
    inputs: list[ShardedInput] = dataclasses.field(default_factory=list)
    slices: list[LocalSlice] = dataclasses.field(default_factory=list)
    stats: list[Stat] = dataclasses.field(default_factory=list)
    column_forms: list[ColumnForm] = dataclasses.field(default_factory=list)

    def add_form(self, gm: fx.GraphModule, m: ParamMatmul, names: set[str]) -> None:
        """Record the plain form of column matmul ``m`` (the insert_collectives pass fuses such columns)."""
        form = column_form(gm, m.node, m.x, names)
        if form is not None:
            orientation, weight, bias = form
            self.column_forms.append(ColumnForm(m.node.name, m.x.name, orientation, weight.name,
                                                None if bias is None else bias.name))


def _shape(node: fx.Node) -> tuple[str, ...]:
    return tuple(str(s) for s in node.meta["val"].shape)


def _dtype(node: fx.Node) -> str:
    """The dtype a value has as captured: under ``torch.autocast`` a matmul's output is the low dtype."""
    val = node.meta.get("val")
    return str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else ""


def _value(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    """A parameter node's tensor, or the captured value of what it became (its cast)."""
    return gm.get_parameter(node.target) if node.op == "get_attr" else node.meta["val"]


# ops that take part of a value or change its layout: what is derived from an entering value on its way to a column
_DERIVE = {aten.slice.Tensor, aten.select.int, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
           aten.unsqueeze.default, aten.squeeze.dim, aten.transpose.int, aten.permute.default, aten.to.dtype,
           aten.to.dtype_layout, aten.to.other, aten.type_as.default, aten._to_copy.default,
           aten.contiguous.default, aten.clone.default, aten.alias.default}


# ops that gather rows of a value (tokens dispatched to experts, one row per (token, k) slot): the value they
# are gathered from is smaller, so f goes there
_GATHER = {aten.index.Tensor, aten.repeat_interleave.self_int, aten.expand.default, aten.repeat.default}
# readers of a value's shape and dtype alone (export's checks, ``x.new_ones(..)``, ``zeros_like(x)``)
_SHAPE_ONLY = frozenset({"no_output", "sym_size", "new_like", "like"})


def _scaled(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(rows, factor) for ``rows * factor`` where the factor broadcasts over the rows' features and nothing
    else reads it (Llama 4's tokens repeated per expert times each expert's routing score, ``(E·T, h) *
    (E·T, 1)``): the rows' gradient is ``dY · factor``, the factor's ``Σ dY · rows``, both partial where dY is."""
    if node.target is not aten.mul.Tensor or node.kwargs or len(node.args) != 2 \
            or not all(isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) for a in node.args):
        return None
    out = node.meta["val"]
    for rows, factor in (node.args, node.args[::-1]):
        val = factor.meta["val"]
        if rows.meta["val"].shape == out.shape and val.dim() == out.dim() and val.shape[-1] == 1 != out.shape[-1] \
                and len(factor.users) == 1:
            return rows, factor
    return None


def _piece_of_split(node: fx.Node) -> bool:
    """Is ``node`` one piece of a split whose every reader picks a piece (a ``getitem`` of the split's tuple)?"""
    split = node.args[0] if node.target is operator.getitem and node.args else None
    return isinstance(split, fx.Node) and kind_of(split.target) == "split" and isinstance(split.args[0], fx.Node) \
        and all(u.target is operator.getitem for u in split.users)


def _entering_via(xs: list[fx.Node], columns: set[fx.Node]) \
        -> tuple[dict[fx.Node, tuple[fx.Node, fx.Node]], list[tuple[fx.Node, fx.Node]]]:
    """Column inputs derived from another column input ``root`` of the pair (a gate of ``x[..., :12]`` beside
    q, k and v of ``x``; ``k(x.type_as(x))`` beside ``q(x)``), or gathered from a smaller value ``root`` (the
    tokens of a MoE layer, gathered per expert slot), or several read each through its own chain from one value
    (``q(x.float())``, ``k(x.contiguous())``), through ops whose values reach only the columns:
    ``{derived: (reader of root, root)}``. Entering at ``root`` alone, one all-reduce sums the gradients (each
    rank's covers only its own columns). Gathered rows scaled on the way (:func:`_scaled`, ``(reader, factor)``
    in ``factors``) enter at their root too, the factor through its own f: ``T·h + E·T`` elements where the
    scaled rows would be ``E·T·h``."""
    memo: dict[fx.Node, bool] = {}
    factors: list[tuple[fx.Node, fx.Node]] = []

    def only_columns(n: fx.Node) -> bool:  # every use of n's value is a column matmul, through derive ops
        if n not in memo:
            memo[n] = False  # a cycle cannot happen in a graph; this guards the recursion anyway
            memo[n] = all(u in columns or u.target is aten._assert_tensor_metadata.default or
                          (u.op == "call_function" and u.target in _DERIVE and u.args and u.args[0] is n
                           and only_columns(u)) for u in n.users)
        return memo[n]

    out: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}
    by_root: dict[fx.Node, list[tuple[fx.Node, fx.Node]]] = {}
    for x in xs:
        if not only_columns(x):
            continue
        node, reader, gathered, scaled = x, None, False, []
        while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
            if node.target in _DERIVE | _GATHER:
                gathered |= node.target in _GATHER
                nxt = node.args[0]
            elif _piece_of_split(node):
                # one expert's piece of tokens split by the routing's counts: the pieces together are the split
                # value, read by the split alone (JetMoE's ``x[tokens].split(counts)``, one piece per expert)
                node = node.args[0]
                nxt = node.args[0]
            elif (step := _scaled(node)) is not None and not gathered:
                nxt = step[0]
                scaled.append((node, step[1]))
            else:
                break
            node, reader = nxt, node
            if node in xs and node is not x:
                if scaled:  # entering at another column input: the factor's f is not planned there
                    node, reader = x, None
                    break
                out[x] = (reader, node)
                break
            if len([u for u in node.users if kind_of(u.target) not in _SHAPE_ONLY]) != 1:
                break  # (a reader of its shape alone, ``new_ones(xs, ..)``, takes no gradient)
        if x in out or reader is None:
            continue
        if gathered:
            out[x] = (reader, node)
            factors.extend(scaled)
        elif not scaled:
            by_root.setdefault(node, []).append((x, reader))
    # columns reading one value each through its own chain: they enter where the chains meet
    for root, chains in by_root.items():
        if len(chains) > 1:
            out.update((x, (reader, root)) for x, reader in chains)
    # a root that is itself derived (v(to_1) from type_as from q's input): the chain enters at the first root
    for x, (reader, root) in list(out.items()):
        seen = {x}
        while root in out and root not in seen:
            seen.add(root)
            reader, root = out[root]
        out[x] = (reader, root)
    return out, factors


def _takes_gradient(x: fx.Node, params: set[str]) -> bool:
    """Can a gradient reach ``x``: does it depend on a parameter (named in ``params``) or on a floating input
    (which a caller may give requires_grad)? Sizes read off a tensor carry none (``arange(s)`` of the ids'
    length)."""

    def carries(n: fx.Node) -> bool:
        if n.op == "get_attr":
            return n.target in params
        if n.op == "placeholder":
            val = n.meta.get("val")
            return not isinstance(val, torch.Tensor) or val.dtype.is_floating_point
        return n.op != "call_function"  # a call of a submodule (an island): what it reads is its own

    return reaches(x, carries, lambda n: n.op == "call_function" and kind_of(n.target) == "sym_size")


def _compute_dtype(x: fx.Node, matmuls: list[fx.Node]) -> str:
    """What the gradient entering column matmuls at ``x`` carries: their compute dtype (the input is cast to it
    first, as autocast casts a matmul's inputs), else ``x``'s own."""
    return next((d for d in map(_dtype, matmuls) if d), _dtype(x))


# the vocab-parallel loss computes in float32 (as cross_entropy does under autocast); its target term is summed
# in float64 with label smoothing (see autotp.operators.vocab_ops)
_LOSS_FLOAT = "float32"


def _shard(role: str, module: str, full: tuple[int, ...], dim: int, segs: tuple[Segment, ...]) -> ParamShard:
    local = list(full)
    local[dim] = sum(s.local() for s in segs)
    return ParamShard(role, module, dim, segs, tuple(full), tuple(local))


def _weight_shape(gm: fx.GraphModule, m: ParamMatmul) -> tuple[int, ...]:
    return tuple(gm.get_parameter(m.weight).shape)


def _matmul_shard(gm: fx.GraphModule, role: str, m: ParamMatmul, dim: int, segs: tuple[Segment, ...]) -> ParamShard:
    """The cut of ``m``'s parameter on ``dim`` for ``segs`` of its matrix dim: for a weight flattened to a matrix
    (XLNet's (h, n, d) read as (h, n·d)) the segments count the merged dim's elements, so they are scaled to
    the outermost dim's units (n·d/t elements per rank are n/t heads of d)."""
    if m.fold is not None and m.fold[0] == dim:
        segs = tuple(_unfolded(s, m.fold[1], m) for s in segs)
    return _shard(role, m.module, _weight_shape(gm, m), dim, segs)


def _unfolded(s: Segment, fold: int, m: ParamMatmul) -> Segment:
    if s.size % fold or s.local() % fold:
        raise ShardingError(f"{m.weight}: a block of {s.local()} of its {s.size} flattened features is not whole "
                            f"rows of {fold} (its dim {m.fold[0]})")
    return Segment(s.size // fold, s.parts, tuple(_unfolded(i, fold, m) for i in s.inner))


def _vocab_shard(module: str, full: tuple[int, ...], dim: int, rows: VocabRows, tp: int) -> ParamShard:
    local = list(full)
    local[dim] = rows.local
    return ParamShard("vocab", module, dim, (Segment(rows.padded(tp), tp),), tuple(full), tuple(local), rows)


def _vocab_plan(gm: fx.GraphModule, v: VocabFacts, tp: int, acc: _Planned, names: set[str]) -> VocabPlan:
    """``names``: the graph's parameter names."""
    for node, w, rows in v.embeddings:
        acc.params[w] = _vocab_shard(module_path(node) or w, tuple(gm.get_parameter(w).shape), 0, rows, tp)
        acc.collectives.append(Collective("all_reduce", "sum", "forward", acc.params[w].module, node.name,
                                          _shape(node), _dtype(node)))
    losses, outputs = [], []
    for h in v.heads:
        m = h.matmul
        acc.params[m.weight] = _vocab_shard(m.module, _weight_shape(gm, m), m.out_dim, h.rows, tp)
        if m.bias is not None:
            acc.params[m.bias] = _vocab_shard(m.module, tuple(gm.get_parameter(m.bias).shape), 0, h.rows, tp)
        for x in h.params:  # a per-vocab-entry scale of the logits (V,): cut with the head's rows
            w = x.node.target
            acc.params[w] = _vocab_shard(w.rpartition(".")[0], tuple(gm.get_parameter(w).shape), x.dim, h.rows, tp)
        acc.collectives.append(Collective("all_reduce", "sum", "backward", m.module, m.x.name, _shape(m.x),
                                          _compute_dtype(m.x, [m.node])))
        acc.rewrites.extend(h.rewrites)
        acc.add_form(gm, m, names)
        for x in h.losses:
            losses.append(VocabLoss(x.node.name, x.logits.name, x.log_softmax.name if x.log_softmax else None,
                                    x.reduction, x.ignore_index, float(x.label_smoothing), h.rows))
            tokens = _shape(x.logits)[:1]  # (n,): one value per token each all-reduce
            target = "float64" if x.label_smoothing else _LOSS_FLOAT
            acc.collectives += [Collective("all_reduce", op, "forward", m.module, x.node.name, tokens, dtype)
                                for op, dtype in (("max", _LOSS_FLOAT), ("sum", target), ("sum", _LOSS_FLOAT))]
        outputs += [(n.name, dim, h.rows) for n, dim in h.outputs]
    return VocabPlan(
        embeddings=tuple((n.name, rows) for n, _, rows in v.embeddings),
        heads=tuple((h.matmul.node.name, h.matmul.x.name) for h in v.heads),
        losses=tuple(losses),
        outputs=tuple(outputs),
    )


def _experts_shard(gm: fx.GraphModule, name: str, layer: ExpertLayerFacts, tp: int) -> ParamShard:
    return _shard("experts", layer.module, tuple(gm.get_parameter(name).shape), 0, (Segment(layer.count, tp),))


def _expert_layers(facts: ExpertFacts) -> tuple[ExpertLayer, ...]:
    return tuple(ExpertLayer(
        x.module, x.count, tuple(x.params), tuple((n.name, e) for n, e in x.selects), tuple(n.name for n in x.indexes),
        tuple(n.name for n in x.grouped),
        tuple(ExpertSlot(s.expert, tuple(n.name for n in s.nodes), tuple(n.name for n in s.rows), s.out.name)
              for s in x.slots), x.top_k, x.width) for x in facts.layers)


def _stat(n: fx.Node, kind: str, scale: float) -> Stat:
    """A statistic, with its reduction's arguments where ``n`` is a reduction (not a fused norm)."""
    if n.target not in STAT_KINDS:
        return Stat(n.name, kind, scale)
    r = reduction_args(n)
    return Stat(n.name, kind, scale, None if r.dims is None else tuple(r.dims), r.keepdim, r.param)


def plan_from_analysis(gm: fx.GraphModule, a: Analysis, v: VocabFacts | None = None, fold: bool = True,
                       experts: ExpertFacts | None = None) -> Plan:
    """``fold``: a column input derived from another one enters through its f (see :func:`_entering_via`);
    with sequence parallelism each is gathered itself instead. ``experts``: place whole experts on ranks
    (their pairs' inner dims stay whole: no rewrites, slices or statistics inside them)."""
    whole_experts = {name: layer for layer in (experts.layers if experts else ()) for name in layer.params}
    names = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    acc = _Planned()
    owner: dict[fx.Node, object] = {}  # column input -> the pair whose f it enters through
    left: set[fx.Node] = set()  # shared all-reduces already planned
    for p in a.pairs:
        ep = any(m.weight in whole_experts for m in (*p.columns, p.row))
        for c in p.columns:
            segs = p.column_specs[c.node.name].segments
            acc.params[c.weight] = _matmul_shard(gm, "column", c, c.out_dim, segs)
            if c.bias is not None:
                acc.params[c.bias] = _shard("column", c.module, tuple(gm.get_parameter(c.bias).shape), 0, segs)
            acc.add_form(gm, c, names)
        row_segs = p.region.row_input.segments
        acc.params[p.row.weight] = _matmul_shard(gm, "row", p.row, p.row.in_dim, row_segs)
        for r in p.reduces:  # a mixer's reducing projection: row-parallel, its sum a statistic of the region
            acc.params[r.weight] = _matmul_shard(gm, "row", r, r.in_dim, p.region.reduced[r.node].segments)
        # an embedding's ids need no gradient; a column fed by a reduction has its input's gradient summed by it;
        # an input made from no parameter and no floating input (XLNet's sinusoidal position encoding) has none
        matmuls = [c for c in p.columns
                   if c.kind != "embedding" and c.x not in p.summed and _takes_gradient(c.x, names)]
        xs = list(dict.fromkeys(c.x for c in matmuls))
        via, factors = _entering_via(xs, {c.node for c in matmuls}) if fold else ({}, [])
        xs = [x for x in xs if x not in via]
        # tokens gathered for the experts, once for all the columns that read them (every expert's piece)
        xs += list(dict.fromkeys(root for _, root in via.values() if root not in xs))
        # an input another pair already enters (experts of one MoE layer reading the same tokens) shares its f:
        # one all-reduce of the summed input gradient
        joined = [x for x in xs if x in owner] if fold else []
        leave = a.leave_at.get(p.row.node) if fold else None
        xs = [x for x in xs if x not in joined]
        owner.update((x, p) for x in xs)
        enter = tuple(x.name for x in xs)
        entering = [*p.region.entering, *factors]
        if leave is not None and leave not in left:  # the router's weights of the experts' partial sums
            entering += a.partial_enter.get(leave, [])
        also = tuple((c.name, x.name) for c, x in entering)
        acc.pairs.append(PairPlan(p.name, tuple(c.node.name for c in p.columns), tuple(c.weight for c in p.columns),
                                  enter, p.row.node.name, p.row.weight, p.row.bias, also,
                                  tuple(dict.fromkeys((reader.name, root.name) for reader, root in via.values())),
                                  tuple(x.name for x in joined), leave.name if leave is not None else None))
        if ep and p.row.bias in whole_experts:  # each rank adds its own experts' biases
            acc.pairs[-1] = dataclasses.replace(acc.pairs[-1], row_bias=None)
        for x in dict.fromkeys(x for _, x in entering):  # one f for all readers of x
            acc.collectives.append(Collective("all_reduce", "sum", "backward", p.name, x.name, _shape(x),
                                              _dtype(x)))
        if leave is None:
            acc.collectives.append(Collective("all_reduce", "sum", "forward", p.name, p.row.node.name,
                                              _shape(p.row.node), _dtype(p.row.node)))
        elif leave not in left:  # one all-reduce of the combined partial sums
            left.add(leave)
            module = common_module([q.name for q in a.pairs if a.leave_at.get(q.row.node) is leave])
            acc.collectives.append(Collective("all_reduce", "sum", "forward", module or p.name, leave.name,
                                              _shape(leave), _dtype(leave)))
        for x in xs:
            acc.collectives.append(Collective("all_reduce", "sum", "backward", p.name, x.name, _shape(x),
                                              _compute_dtype(x, [c.node for c in matmuls if c.x is x])))
        for m in p.sides:  # another row of the same columns (a parallel block's feed-forward output): its own g,
            # or the one all-reduce of its partial sum added to the row's (attention's output + feed-forward's)
            acc.params[m.weight] = _matmul_shard(gm, "row", m, m.in_dim, p.region.sides[m.node].segments)
            at = a.leave_at.get(m.node) if fold else None
            acc.pairs.append(PairPlan(p.name, (), (), (), m.node.name, m.weight, m.bias,
                                      leave_at=at.name if at is not None else None))
            if at is None or at not in left:
                node = m.node if at is None else at
                left |= {at} - {None}
                acc.collectives.append(Collective("all_reduce", "sum", "forward", p.name, node.name, _shape(node),
                                                  _dtype(node)))
        if ep:  # an expert's inner dims are whole: nothing inside it changes
            continue
        acc.rewrites.extend(p.region.rewrites)
        acc.random_nodes.extend(n.name for n in p.region.random_nodes)
        for n in p.region.outputs:
            spec = p.region.specs[n]
            acc.gathered.append(GatheredOutput(n.name, spec.dim, spec.segments))
        acc.slices.extend(LocalSlice(c.name, x.name, d, sh.segments, sh.outer) for c, x, d, sh in p.region.slices)
        for x, d, sh in p.region.params:  # a whole-width norm's weight, a KV cache: sharded with the heads
            shape = tuple(x.meta["val"].shape) if "val" in x.meta else tuple(gm.get_buffer(x.target).shape)
            into = acc.params if x.target in names else acc.buffers
            into[x.target] = _shard("column", x.target.rpartition(".")[0], tuple(int(d_) for d_ in shape), d, sh.segments)
        for n, (kind, scale) in p.region.stats.items():
            acc.stats.append(_stat(n, kind, scale))
            rows = _shape(n)[:len(_shape(n)) - len(n.args[1])] if kind in ("rms_norm", "layer_norm") else _shape(n)
            rows = (*rows, "2") if kind in ("layer_norm", "var", "std") else rows  # x and x² statistics in one
            # a fused norm's or reduction's statistics are computed in float32 or wider (ShardedNorm, ShardedReduction)
            wide = str(torch.promote_types(n.meta["val"].dtype, torch.float32)).removeprefix("torch.")
            dtype = _dtype(n) if kind in ("mean", "sum") else wide
            acc.collectives += [Collective("all_reduce", "sum", way, p.name, n.name, rows, dtype)
                                for way in ("forward", "backward")]
        for n in p.region.inputs:
            spec = p.region.specs[n]
            acc.inputs.append(ShardedInput(n.name, spec.dim, spec.segments))
    for name, layer in whole_experts.items():
        acc.params[name] = _experts_shard(gm, name, layer, a.tp)
    vocab = _vocab_plan(gm, v, a.tp, acc, names) if v is not None else VocabPlan()
    return Plan(
        tp=a.tp,
        params=tuple(acc.params.items()),
        pairs=tuple(acc.pairs),
        rewrites=tuple(acc.rewrites),
        collectives=tuple(acc.collectives),
        random_nodes=tuple(acc.random_nodes),
        replicated=tuple(dict.fromkeys(a.replicated)),  # each module and reason once
        vocab=vocab,
        gathered=tuple(acc.gathered),
        sharded_inputs=tuple(acc.inputs),
        local_slices=tuple(acc.slices),
        stats=tuple(acc.stats),
        buffers=tuple(acc.buffers.items()),
        experts=_expert_layers(experts) if experts else (),
        experts_kept=tuple(experts.kept) if experts else (),
        column_forms=tuple(acc.column_forms),
    )


def sequence_plan(gm: fx.GraphModule, a: Analysis, v: VocabFacts, f: SeqFacts, plan: Plan) -> Plan:
    """``plan`` with sequence parallelism (the regions ``f`` found): the pairs' and the embedding's
    all-reduces become reduce-scatters, the inputs of column matmuls and LM heads are all-gathered (see
    :mod:`autotp.analysis.sequence`)."""
    rows = {m.node: m for p in a.pairs for m in (p.row, *p.sides)}
    matmuls = {p.name: [c.node for c in p.columns] for p in a.pairs}
    for h in v.heads:
        matmuls[h.matmul.module] = [h.matmul.node]
    dropped: set[tuple[str, str, str]] = set()  # (direction, module, node) of all-reduces that go
    added: list[Collective] = []
    leaves, enters, grads = [], [], [(c.name, x.name) for c, x in f.grads]
    for module, source, node, dim in f.leaves:
        leaves.append(SeqLeave(module, source.name, node.name, dim))
        dropped.add(("forward", module, source.name))
        added += [Collective("reduce_scatter", "sum", "forward", module, node.name, _shape(node), _dtype(node)),
                  Collective("all_gather", "", "backward", module, node.name, _shape(node), _dtype(node))]
        row = rows.get(source)
        if row is not None and row.bias is not None:  # added after the reduce-scatter, to s/t positions
            bias = source.args[2 if row.kind == "linear" else 0]  # the parameter, or its cast
            grads.append((source.name, bias.name))
    for module, x, node, dim, flatten in f.enters:
        users = [c for c in matmuls[module] if x in c.all_input_nodes]
        regather = all(plan.column_form(c.name, x.name) for c in users)
        enters.append(SeqEnter(module, x.name, node.name, dim, tuple(c.name for c in users), flatten, regather))
        dropped.add(("backward", module, x.name))
        dtype = _compute_dtype(node, users)  # gathered, and its gradient scattered, in the columns' dtype
        added += [Collective("all_gather", "", "forward", module, node.name, _shape(node), dtype),
                  Collective("reduce_scatter", "sum", "backward", module, node.name, _shape(node), dtype)]
        if regather:  # the input is gathered again for the weight gradients (Megatron keeps only s/t of it)
            added.append(Collective("all_gather", "", "backward", module, node.name, _shape(node), dtype))
    gathers = []
    for value, (dim, consumers, why) in f.gathers.items():
        module = module_path(consumers[0]) or module_path(value) or "<root>"
        gathers.append(SeqGather(value.name, dim, tuple(c.name for c in consumers), why))
        added.append(Collective("all_gather", "", "forward", module, value.name, _shape(value), _dtype(value)))
    for consumer, value, dim, grad in f.slices:
        if grad:
            added.append(Collective("all_gather", "", "backward", module_path(value) or module_path(consumer),
                                    value.name, _shape(value), _dtype(value)))
    if grads:
        by_name = {n.name: n for n in gm.graph.nodes}
        vals = [_value(gm, by_name[g]) for g in dict.fromkeys(g for _, g in grads)]
        numel, dtype = sum(v.numel() for v in vals), str(vals[0].dtype).removeprefix("torch.")
        added.append(Collective("all_reduce", "sum", "backward", SEQ_PARAMS, grads[0][1], (str(numel),), dtype))
    for consumer, x in f.enter_grads:
        added.append(Collective("all_reduce", "sum", "backward", module_path(consumer), x.name, _shape(x), _dtype(x)))
    kept = [c for c in plan.collectives if not (c.kind == "all_reduce" and (c.direction, c.module, c.node) in dropped)]
    seq = SequencePlan(
        length=(f.length[0].name, f.length[1]) if f.length is not None else None,
        leaves=tuple(leaves), enters=tuple(enters), gathers=tuple(gathers),
        slices=tuple(SeqSlice(c.name, x.name, d, g) for c, x, d, g in f.slices),
        grads=tuple(grads), enter_grads=tuple((c.name, x.name) for c, x in f.enter_grads),
        sizes=tuple((n.name, arg, i, d) for n, arg, i, d in f.sizes), notes=tuple(f.notes),
    )
    return dataclasses.replace(plan, collectives=tuple(kept + added), sequence=seq,
                               random_nodes=plan.random_nodes + tuple(n.name for n in f.random_nodes))


def check_expert_counts(experts: ExpertFacts, tp: int) -> None:
    """Every rank holds E/tp whole experts: tp must divide each layer's E."""
    for layer in experts.layers:
        if layer.count % tp:
            raise ShardingError(f"expert parallelism: {layer.module} has {layer.count} experts, which tp={tp} "
                                "does not divide (each rank holds E/tp whole experts)",
                                hint=f"choose a tp that divides {layer.count}, or drop expert_parallel "
                                     "(1/tp of every expert)")


def group_seq_grads(gm: fx.GraphModule, plan: Plan, by: str) -> Plan:
    """``plan`` with its sequence-parallel gradient sums one per unit (``by`` "unit", for FSDP: it
    reduce-scatters a unit's gradients as soon as that unit's backward ends) or per pipeline stage ("stage":
    a stage holds only its own parameters), each inside its unit or stage (:meth:`Plan.seq_grad_groups`)."""
    if plan.sequence is None or not plan.sequence.grads:
        return plan
    plan = dataclasses.replace(plan, sequence=dataclasses.replace(plan.sequence, grads_by=by))
    by_name = {n.name: n for n in gm.graph.nodes}
    collectives = [c for c in plan.collectives if c.module != SEQ_PARAMS]
    for pairs in plan.seq_grad_groups(lambda p: str(by_name[p].target)):
        vals = [_value(gm, by_name[g]) for g in dict.fromkeys(g for _, g in pairs)]
        collectives.append(Collective("all_reduce", "sum", "backward", SEQ_PARAMS, pairs[0][1],
                                      (str(sum(v.numel() for v in vals)),), str(vals[0].dtype).removeprefix("torch.")))
    return dataclasses.replace(plan, collectives=tuple(collectives))


def cut_copies_in_graph(gm: fx.GraphModule, plan: Plan) -> Plan:
    """``plan`` with every parameter whose blocks several ranks hold (kv heads fewer than tp) held whole and
    cut to this rank's slice in the graph (:class:`~autotp.plan.plan.GraphCut`), for FSDP: a DTensor over the
    tp ranks is either sharded or replicated, never a block on two ranks of four. Each rank computes with the
    same slice as before; the gradient of the whole is summed over tp by one all-reduce backward."""
    copies = [(name, shard) for name, shard in plan.params if shard.replicated_blocks(plan.tp)]
    if not copies:
        return plan
    by_target = {str(n.target): n for n in gm.graph.nodes if n.op == "get_attr"}
    cuts, collectives, whole = [], list(plan.collectives), list(plan.whole)
    for name, shard in copies:
        node = by_target.get(name)
        if node is None:
            raise ShardingError(f"{name} ({shard.module}) has kv blocks held by several of tp={plan.tp} ranks and is "
                                "not read as a parameter node of the graph, so it cannot be cut there for fsdp",
                                hint="use a tp that divides the number of kv heads, or data parallelism without fsdp")
        # pipelined, the copies' gradients are summed once per step by the pipeline, not per micro-batch
        cuts.append(GraphCut(name, node.name, shard.dim, shard.segments, in_graph=not plan.stages))
        value = _value(gm, node)
        if not plan.stages:
            collectives.append(Collective("all_reduce", "sum", "backward", shard.module, node.name,
                                          (str(value.numel()),), str(value.dtype).removeprefix("torch.")))
        whole.append(WholeParam(name, shard.module, f"its kv heads are held by several of tp={plan.tp} ranks: kept "
                                "whole for fsdp, each rank computing with its own heads' slice"))
    names = {name for name, _ in copies}
    return dataclasses.replace(plan, params=tuple((n, s) for n, s in plan.params if n not in names),
                               graph_cuts=tuple(cuts), collectives=tuple(collectives), whole=tuple(whole))


def make_plan(gm: fx.GraphModule, tp: int, vocab_multiple: int = 1, sequence_parallel: bool = False,
              expert_parallel: bool = False, stages: StageRequest | None = None) -> Plan:
    """Analyze ``gm`` and plan its sharding for ``tp`` ranks (tp = 1 gives an empty plan).

    ``vocab_multiple``: round each rank's vocab rows up to this multiple (e.g. 64 on GPUs).
    ``sequence_parallel``: split the code between the pairs along the sequence (Megatron-SP).
    ``expert_parallel``: E/tp whole experts per rank instead of 1/tp of every expert.
    ``stages``: cut the blocks into this many pipeline stages (:mod:`autotp.plan.stages`).
    """
    plan = _make_plan(gm, tp, vocab_multiple, sequence_parallel, expert_parallel)
    if stages is None:
        return plan
    local = {name: math.prod(shard.local_shape) * _param(gm, name).element_size() for name, shard in plan.params}
    return group_seq_grads(gm, dataclasses.replace(plan, stages=plan_stages(gm, plan.units, stages, local)), "stage")


def _param(gm: fx.GraphModule, name: str):
    path, _, leaf = name.rpartition(".")
    return getattr(gm.get_submodule(path) if path else gm, leaf)


def _make_plan(gm: fx.GraphModule, tp: int, vocab_multiple: int, sequence_parallel: bool,
               expert_parallel: bool) -> Plan:
    facts = analyze_graph(gm, tp, vocab_multiple=vocab_multiple, sequence_parallel=sequence_parallel,
                          expert_parallel=expert_parallel)
    return plan_from_facts(gm, facts)


def plan_from_facts(gm: fx.GraphModule, facts: GraphFacts) -> Plan:
    """The plan of what :func:`~autotp.analysis.result.analyze_graph` found in ``gm``."""
    units = tuple(Unit(u.module, u.params, u.kind, u.modules) for u in facts.units)
    if facts.tp == 1:
        return Plan(tp=1, units=units)
    a, v, experts = facts.pairs, facts.vocab, facts.experts
    if experts is not None:
        check_expert_counts(experts, facts.tp)
    plan = plan_from_analysis(gm, a, v, fold=facts.sequence is None, experts=experts)
    plan = dataclasses.replace(plan, whole=whole_params(facts.whole, {name for name, _ in plan.params}), units=units)
    return sequence_plan(gm, a, v, facts.sequence, plan) if facts.sequence is not None else plan


def _uncut(seg: Segment) -> Segment:
    return Segment(seg.size, 1, tuple(_uncut(i) for i in seg.inner))


def fused_segments(gm: fx.GraphModule) -> dict[str, ParamShard]:
    """The parameters of ``gm`` that are fused projections (more than one segment), with nothing cut.

    Checkpoints name a fused parameter's segments at every tp, so that one written at tp 1 reshards like any
    other. The segments are read from the analysis at the smallest tp that cuts the model (2, else 3): at tp 1
    every segment is one block, so a single kv head (held whole at any tp) and a group of heads (cut at
    tp > 1) look alike there and attention reads them differently. A graph analysis cannot read leaves every
    parameter whole. The pairs are :func:`~autotp.analysis.result.analyze_graph`'s, as every plan's are."""
    for tp in (2, 3, 1):
        try:
            plan = plan_from_analysis(gm, analyze_graph(gm, tp, pairs_only=True).pairs)
        except Exception as exc:  # noqa: BLE001 - only checkpoint key names depend on it
            if own_bug(exc):  # autotp's own bug: shown, never a verdict
                raise
            continue
        # a grouped segment of one inner segment is a strided cut of one projection (grouped-query heads repeated
        # head-minor), not a fusion: its checkpoint key is the parameter's own name at every tp
        fused = {name: shard for name, shard in plan.params
                 if len(shard.segments) > 1 or len(shard.segments[0].inner) > 1}
        if fused or tp == 1:
            return {name: _shard(shard.role, shard.module, shard.full_shape, shard.dim,
                                 tuple(_uncut(seg) for seg in shard.segments)) for name, shard in fused.items()}
    return {}
