"""Pass: complete statistics over a sharded dim with one all-reduce of the ranks' partial values.

A norm over the whole width of a head-parallel projection (OLMo-2's q/k RMSNorm over all heads) reduces
the sharded dim. Each rank reduces its own slice; the b·s statistics are summed over the group (and
scaled: a mean of means, or a sum that counts blocks held by several ranks once).

Before (tp = 2, q of 64 features, 32 on each rank)::

    pow = aten.pow(q, 2)                              # (b, s, 32)
    mean = aten.mean.dim(pow, [-1], True)             # (b, s, 1): this rank's slice only
    rsqrt = aten.rsqrt(aten.add(mean, eps))
    n = aten.rms_norm(k, [64], k_norm_weight)         # a fused norm over the width

After::

    mean = aten.mean.dim(pow, [-1], True)
    mean_all = autotp_stat_0(mean)                    # all-reduce sum × 1/tp, forward and backward
    rsqrt = aten.rsqrt(aten.add(mean_all, eps))
    n = autotp_stat_1(k, k_norm_weight)               # ShardedNorm: local moments, one all-reduce

``var``/``std`` (sums of x and x² in one all-reduce) and p-norms (``F.normalize`` over the width: the sum of
|x|^p) over the sharded dim are replaced by a :class:`~autotp.operators.collectives.ShardedReduction` the same way.

The weights of such norms are sharded with the heads (plan.params). The modules bind the group at run
time; the pass never reads it.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autotp.operators.collectives import ShardedNorm, ShardedReduction, StatAllReduce
from autotp.plan.plan import Plan


def _dtype(node: fx.Node) -> torch.dtype | None:
    """The replaced op's output dtype as captured (under autocast, its policy's)."""
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def sharded_stats(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    nodes = {n.name: n for n in gm.graph.nodes}
    for i, st in enumerate(plan.stats):
        node = nodes[st.node]
        target = f"autotp_stat_{i}"
        if st.kind in ("mean", "sum"):
            gm.add_submodule(target, StatAllReduce(st.scale))
            with gm.graph.inserting_after(node):
                done = gm.graph.call_module(target, (node,))
            node.replace_all_uses_with(done, delete_user_cb=lambda u: u is not done)
        elif st.kind in ("var", "std", "norm"):
            dims = None if st.dims is None else list(st.dims)  # the reduction's, as the plan records them
            gm.add_submodule(target, ShardedReduction(st.kind, dims, st.keepdim, st.param, st.scale, _dtype(node)))
            with gm.graph.inserting_before(node):
                done = gm.graph.call_module(target, (node.args[0],))
            node.replace_all_uses_with(done)
            gm.graph.erase_node(node)
        else:
            x, shape, weight, bias = (list(node.args) + [None] * 4)[:4]
            eps = node.args[4] if st.kind == "layer_norm" and len(node.args) > 4 else 1e-5
            if st.kind == "rms_norm":
                bias, eps = None, node.args[3] if len(node.args) > 3 else node.kwargs.get("eps")
            gm.add_submodule(target, ShardedNorm(st.kind, len(shape), eps, st.scale, _dtype(node)))
            with gm.graph.inserting_before(node):
                done = gm.graph.call_module(target, (x, weight, bias))
            node.replace_all_uses_with(done)
            gm.graph.erase_node(node)
        done.meta = {**node.meta, "autotp_collective": ("stat", st.node)}
    return gm
