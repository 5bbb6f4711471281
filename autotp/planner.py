"""Turn the analysis of a captured graph into a :class:`~autotp.plan.Plan`."""
from __future__ import annotations

import torch.fx as fx

from autotp.analysis import Analysis, analyze
from autotp.matmuls import ParamMatmul
from autotp.plan import Collective, PairPlan, ParamShard, Plan
from autotp.shard_spec import Segment


def _shape(node: fx.Node) -> tuple[str, ...]:
    return tuple(str(s) for s in node.meta["val"].shape)


def _shard(role: str, module: str, full: tuple[int, ...], dim: int, segs: tuple[Segment, ...]) -> ParamShard:
    local = list(full)
    local[dim] = sum(s.local() for s in segs)
    return ParamShard(role, module, dim, segs, tuple(full), tuple(local))


def _weight_shape(gm: fx.GraphModule, m: ParamMatmul) -> tuple[int, ...]:
    return tuple(gm.get_parameter(m.weight).shape)


def plan_from_analysis(gm: fx.GraphModule, a: Analysis) -> Plan:
    params: dict[str, ParamShard] = {}
    pairs, rewrites, collectives, random_nodes = [], [], [], []
    for p in a.pairs:
        for c in p.columns:
            segs = p.column_specs[c.node.name].segments
            params[c.weight] = _shard("column", c.module, _weight_shape(gm, c), c.out_dim, segs)
            if c.bias is not None:
                params[c.bias] = _shard("column", c.module, tuple(gm.get_parameter(c.bias).shape), 0, segs)
        row_segs = p.region.row_input.segments
        params[p.row.weight] = _shard("row", p.row.module, _weight_shape(gm, p.row), p.row.in_dim, row_segs)
        enter = tuple(dict.fromkeys(c.x.name for c in p.columns))
        pairs.append(PairPlan(p.name, tuple(c.node.name for c in p.columns), tuple(c.weight for c in p.columns),
                              enter, p.row.node.name, p.row.weight, p.row.bias))
        collectives.append(Collective("all_reduce", "sum", "forward", p.name, p.row.node.name, _shape(p.row.node)))
        for x in dict.fromkeys(c.x for c in p.columns):
            collectives.append(Collective("all_reduce", "sum", "backward", p.name, x.name, _shape(x)))
        rewrites.extend(p.region.rewrites)
        random_nodes.extend(n.name for n in p.region.random_nodes)
    return Plan(
        tp=a.tp,
        params=tuple(params.items()),
        pairs=tuple(pairs),
        rewrites=tuple(rewrites),
        collectives=tuple(collectives),
        random_nodes=tuple(random_nodes),
        replicated=tuple(a.replicated),
    )


def make_plan(gm: fx.GraphModule, tp: int) -> Plan:
    """Analyze ``gm`` and plan its sharding for ``tp`` ranks (tp = 1 gives an empty plan)."""
    if tp == 1:
        return Plan(tp=1)
    return plan_from_analysis(gm, analyze(gm, tp))
