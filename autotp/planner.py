"""Turn the analysis of a captured graph into a :class:`~autotp.plan.Plan`."""
from __future__ import annotations

import torch.fx as fx

from autotp.analysis import Analysis, analyze
from autotp.matmuls import ParamMatmul, module_path
from autotp.plan import (Collective, GatheredOutput, LocalSlice, PairPlan, ParamShard, Plan, ShardedInput, Stat,
                         VocabLoss, VocabPlan)
from autotp.shard_spec import Segment, VocabLayout
from autotp.vocab import VocabFacts, analyze_vocab


def _shape(node: fx.Node) -> tuple[str, ...]:
    return tuple(str(s) for s in node.meta["val"].shape)


def _shard(role: str, module: str, full: tuple[int, ...], dim: int, segs: tuple[Segment, ...]) -> ParamShard:
    local = list(full)
    local[dim] = sum(s.local() for s in segs)
    return ParamShard(role, module, dim, segs, tuple(full), tuple(local))


def _weight_shape(gm: fx.GraphModule, m: ParamMatmul) -> tuple[int, ...]:
    return tuple(gm.get_parameter(m.weight).shape)


def _vocab_shard(module: str, full: tuple[int, ...], dim: int, layout: VocabLayout, tp: int) -> ParamShard:
    local = list(full)
    local[dim] = layout.local
    return ParamShard("vocab", module, dim, (Segment(layout.padded(tp), tp),), tuple(full), tuple(local), layout)


def _vocab_plan(gm: fx.GraphModule, v: VocabFacts, tp: int, params: dict, rewrites: list,
                collectives: list) -> VocabPlan:
    for node, w, layout in v.embeddings:
        params[w] = _vocab_shard(module_path(node) or w, tuple(gm.get_parameter(w).shape), 0, layout, tp)
        collectives.append(Collective("all_reduce", "sum", "forward", params[w].module, node.name, _shape(node)))
    losses, outputs = [], []
    for h in v.heads:
        m = h.matmul
        params[m.weight] = _vocab_shard(m.module, _weight_shape(gm, m), m.out_dim, h.layout, tp)
        if m.bias is not None:
            params[m.bias] = _vocab_shard(m.module, tuple(gm.get_parameter(m.bias).shape), 0, h.layout, tp)
        collectives.append(Collective("all_reduce", "sum", "backward", m.module, m.x.name, _shape(m.x)))
        rewrites.extend(h.rewrites)
        for x in h.losses:
            losses.append(VocabLoss(x.node.name, x.logits.name, x.log_softmax.name if x.log_softmax else None,
                                    x.reduction, x.ignore_index, float(x.label_smoothing), h.layout))
            rows = _shape(x.logits)[:1]
            collectives += [Collective("all_reduce", op, "forward", m.module, x.node.name, rows)
                            for op in ("max", "sum", "sum")]
        outputs += [(n.name, dim, h.layout) for n, dim in h.outputs]
    return VocabPlan(
        embeddings=tuple((n.name, layout) for n, _, layout in v.embeddings),
        heads=tuple((h.matmul.node.name, h.matmul.x.name) for h in v.heads),
        losses=tuple(losses),
        outputs=tuple(outputs),
    )


def plan_from_analysis(gm: fx.GraphModule, a: Analysis, v: VocabFacts | None = None) -> Plan:
    params: dict[str, ParamShard] = {}
    buffers: dict[str, ParamShard] = {}
    pairs, rewrites, collectives, random_nodes, gathered, inputs, slices, stats = [], [], [], [], [], [], [], []
    for p in a.pairs:
        for c in p.columns:
            segs = p.column_specs[c.node.name].segments
            params[c.weight] = _shard("column", c.module, _weight_shape(gm, c), c.out_dim, segs)
            if c.bias is not None:
                params[c.bias] = _shard("column", c.module, tuple(gm.get_parameter(c.bias).shape), 0, segs)
        row_segs = p.region.row_input.segments
        params[p.row.weight] = _shard("row", p.row.module, _weight_shape(gm, p.row), p.row.in_dim, row_segs)
        enter = tuple(dict.fromkeys(c.x.name for c in p.columns))
        also = tuple((c.name, x.name) for c, x in p.region.entering)
        pairs.append(PairPlan(p.name, tuple(c.node.name for c in p.columns), tuple(c.weight for c in p.columns),
                              enter, p.row.node.name, p.row.weight, p.row.bias, also))
        for _, x in p.region.entering:
            collectives.append(Collective("all_reduce", "sum", "backward", p.name, x.name, _shape(x)))
        collectives.append(Collective("all_reduce", "sum", "forward", p.name, p.row.node.name, _shape(p.row.node)))
        for x in dict.fromkeys(c.x for c in p.columns):
            collectives.append(Collective("all_reduce", "sum", "backward", p.name, x.name, _shape(x)))
        rewrites.extend(p.region.rewrites)
        random_nodes.extend(n.name for n in p.region.random_nodes)
        for n in p.region.outputs:
            spec = p.region.specs[n]
            gathered.append(GatheredOutput(n.name, spec.dim, spec.segments))
        slices.extend(LocalSlice(c.name, x.name, d, sh.segments, sh.outer) for c, x, d, sh in p.region.slices)
        for x, d, sh in p.region.params:  # a whole-width norm's weight, a KV cache: sharded with the heads
            shape = tuple(x.meta["val"].shape) if "val" in x.meta else tuple(gm.get_buffer(x.target).shape)
            into = params if x.target in dict(gm.named_parameters(remove_duplicate=False)) else buffers
            into[x.target] = _shard("column", x.target.rpartition(".")[0], tuple(int(d_) for d_ in shape), d, sh.segments)
        for n, (kind, scale) in p.region.stats.items():
            stats.append(Stat(n.name, kind, scale))
            rows = _shape(n)[:len(_shape(n)) - len(n.args[1])] if kind in ("rms_norm", "layer_norm") else _shape(n)
            rows = (*rows, "2") if kind in ("layer_norm", "var", "std") else rows  # x and x² statistics in one
            collectives += [Collective("all_reduce", "sum", way, p.name, n.name, rows) for way in ("forward", "backward")]
        for n in p.region.inputs:
            spec = p.region.specs[n]
            inputs.append(ShardedInput(n.name, spec.dim, spec.segments))
    vocab = _vocab_plan(gm, v, a.tp, params, rewrites, collectives) if v is not None else VocabPlan()
    return Plan(
        tp=a.tp,
        params=tuple(params.items()),
        pairs=tuple(pairs),
        rewrites=tuple(rewrites),
        collectives=tuple(collectives),
        random_nodes=tuple(random_nodes),
        replicated=tuple(dict.fromkeys(a.replicated)),  # each module and reason once
        vocab=vocab,
        gathered=tuple(gathered),
        sharded_inputs=tuple(inputs),
        local_slices=tuple(slices),
        stats=tuple(stats),
        buffers=tuple(buffers.items()),
    )


def make_plan(gm: fx.GraphModule, tp: int, vocab_multiple: int = 1) -> Plan:
    """Analyze ``gm`` and plan its sharding for ``tp`` ranks (tp = 1 gives an empty plan).

    ``vocab_multiple``: round each rank's vocab rows up to this multiple (e.g. 64 on GPUs).
    """
    if tp == 1:
        return Plan(tp=1)
    a = analyze(gm, tp)
    return plan_from_analysis(gm, a, analyze_vocab(gm, a, tp, vocab_multiple))


def fused_segments(gm: fx.GraphModule) -> dict[str, ParamShard]:
    """The parameters of ``gm`` that are fused projections (more than one segment), as analysis at tp 1
    finds them. Nothing is cut at tp 1, but checkpoints name a fused parameter's segments at every tp, so that
    one written at tp 1 reshards like any other; a graph analysis cannot read leaves every parameter whole."""
    try:
        plan = plan_from_analysis(gm, analyze(gm, 1))
    except Exception:  # noqa: BLE001 - only checkpoint key names depend on it
        return {}
    return {name: shard for name, shard in plan.params if len(shard.segments) > 1 or shard.segments[0].inner}
