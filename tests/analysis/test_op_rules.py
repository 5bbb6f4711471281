"""The table of op rules: one case per entry, each run through the visitor that owns its kind on a one-op
graph built by hand (meta values from running the op on small real tensors), and checks that no visitor
keeps an op list of its own."""
from __future__ import annotations

import dataclasses
import itertools
import operator
import pathlib
import re

import pytest
import torch
import torch.fx as fx

from autotp.analysis.op_rules import OP_RULES, POINTWISE, TORCH, OpRule, op_rule
from autotp.analysis.ops import Unshardable, moved_dim, permutation, reduction_args
from autotp.analysis.propagate import Propagator
from autotp.analysis.sequence import _Sequence
from autotp.analysis.shapes import Fingerprinter
from autotp.analysis.vocab import _VocabPropagator
from autotp.shard_spec import Segment, Sharding

aten = torch.ops.aten
TP = 2
ANALYSIS = pathlib.Path(__file__).resolve().parents[2] / "autotp" / "analysis"


def _s(dim: int, *sizes: int) -> Sharding:
    """Sharded on ``dim`` in segments of these sizes, each cut in TP blocks."""
    return Sharding(dim, tuple(Segment(n, TP) for n in sizes))


def _graph(op, *args, **kwargs) -> tuple[fx.Node, list[fx.Node]]:
    """A graph of one call of ``op``: every tensor argument (also in a list) is a placeholder whose
    ``meta["val"]`` is the tensor, and the call's is what running the op gives."""
    g, names = fx.Graph(), itertools.count()
    inputs: list[fx.Node] = []

    def node_of(v):
        if isinstance(v, torch.Tensor):
            inputs.append(g.placeholder(f"x{next(names)}"))
            inputs[-1].meta["val"] = v
            return inputs[-1]
        return type(v)(node_of(a) for a in v) if isinstance(v, (list, tuple)) else v

    node = g.call_function(op, node_of(args), {k: node_of(v) for k, v in kwargs.items()})
    node.meta["val"] = op(*args, **kwargs)
    g.output(node)
    return node, inputs


def _propagate(op, shardings: dict[int, Sharding], *args, **kwargs) -> tuple[Propagator, fx.Node]:
    """Visit one call of ``op`` whose tensor inputs number ``i`` are sharded by ``shardings[i]``."""
    node, inputs = _graph(op, *args, **kwargs)
    p = Propagator(Fingerprinter(), TP, "test")
    p.region.specs.update({inputs[i]: s for i, s in shardings.items()})
    p.visit(node)
    return p, node


def _out(op, shardings, *args, **kwargs):
    p, node = _propagate(op, shardings, *args, **kwargs)
    return p.region.specs.get(node)


def _refuses(op, why: str, shardings, *args, **kwargs) -> None:
    with pytest.raises(Unshardable, match=why):
        _propagate(op, shardings, *args, **kwargs)


def _x(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


def _arg_name(op, i: int) -> str:
    return op._schema.arguments[i].name


# -- one check per kind ------------------------------------------------------------------------------
def _same_shape(op, rule: OpRule, *extra, **kw) -> None:
    x = _x(2, 3, 8)
    assert op(x, *extra, **kw).shape == x.shape
    assert _out(op, {0: _s(2, 8)}, x, *extra, **kw) == _s(2, 8)
    if rule.cast:  # values kept, up to rounding
        assert torch.allclose(op(x, *extra, **kw).float(), x)


def _dropout(op, rule: OpRule) -> None:
    assert _arg_name(op, rule.random_p) == "p"
    p, node = _propagate(op, {0: _s(2, 8)}, _x(2, 3, 8), 0.5, True)
    assert p.region.random_nodes == [node] and p.region.specs[node] == _s(2, 8)
    p, node = _propagate(op, {0: _s(2, 8)}, _x(2, 3, 8), 0.0, True)
    assert p.region.random_nodes == []


def _type_as(op, rule: OpRule) -> None:
    _same_shape(op, rule, _x(1, dtype=torch.float64))
    w, x = _x(3, 8), _x(2, 8)
    assert rule.dtype_arg == 1 and _arg_name(op, 1) == "other"
    p, node = _propagate(op, {1: _s(1, 8)}, w, x)  # W.type_as(x): reads only x's dtype
    assert node not in p.region.specs


def _softmax(op, rule: OpRule, *extra) -> None:
    x = _x(2, 3, 8)
    assert torch.allclose(op(x, 1, *extra).exp().sum(1) if rule.log else op(x, 1, *extra).sum(1), torch.ones(2, 8))
    assert _out(op, {0: _s(2, 8)}, x, 1, *extra) == _s(2, 8)
    _refuses(op, "softmax over the sharded dim", {0: _s(2, 8)}, x, 2, *extra)


def _view(op, rule: OpRule) -> None:
    p, node = _propagate(op, {0: _s(2, 8)}, _x(2, 3, 8), [2, 3, 4, 2])  # 4 heads of 2
    assert p.region.specs[node] == _s(2, 4)
    assert [(r.arg, r.index, r.old, r.new) for r in p.region.rewrites] == [(1, 2, 4, 2)]


def _flatten(op, rule: OpRule) -> None:
    assert _out(op, {0: _s(2, 8)}, _x(2, 3, 8), 0, 1) == _s(1, 8)


def _expand(op, rule: OpRule) -> None:
    p, node = _propagate(op, {0: _s(2, 8)}, _x(2, 1, 8), [2, 3, 8])
    assert p.region.specs[node] == _s(2, 8)
    assert [(r.arg, r.index, r.old, r.new) for r in p.region.rewrites] == [(1, 2, 8, 4)]  # the local size


def _expand_as(op, rule: OpRule) -> None:
    p, node = _propagate(op, {1: _s(2, 8)}, _x(1, 1, 8), _x(2, 3, 8))  # a replicated value broadcast
    assert p.region.specs[node] == _s(2, 8)
    (cut,) = p.region.slices  # ... spans the sharded dim: each rank reads its slice
    assert (cut.consumer, cut.dim, cut.sharding) == (node, 2, _s(2, 8))


def _repeat(op, rule: OpRule) -> None:
    assert _out(op, {0: _s(2, 8)}, _x(2, 3, 8), [2, 1, 1]) == _s(2, 8)
    # tiled along the sharded dim (kv heads repeated head-minor): [2 whole copies, this rank's heads]
    assert _out(op, {0: _s(2, 8)}, _x(2, 3, 8), [1, 1, 2]) == Sharding(2, (Segment(8, TP),), outer=True)
    _refuses(op, "repeat of the sharded dim", {0: Sharding(2, (Segment(8, TP),), inner=(1, 2))}, _x(2, 3, 8),
             [1, 1, 2])


def _tile(op, rule: OpRule) -> None:
    # ``torch.tile(k, (1, 1, 2))``: repeat's counts; kv heads tiled head-minor, [2 whole copies, this rank's heads]
    assert _out(op, {0: _s(2, 8)}, _x(2, 3, 8), [1, 1, 2]) == Sharding(2, (Segment(8, TP),), outer=True)
    assert _out(op, {0: _s(2, 8)}, _x(2, 3, 8), [2, 1, 1]) == _s(2, 8)
    # counts for the last dims only (ones prepended by torch): refused, named
    _refuses(op, "fewer counts than its input's dims", {0: _s(2, 8)}, _x(2, 3, 8), [1, 2])


def _repeat_interleave(op, rule: OpRule) -> None:
    assert _out(op, {0: _s(1, 4)}, _x(2, 4, 3), 2, 0) == _s(1, 4)
    assert _out(op, {0: _s(1, 4)}, _x(2, 4, 3), 2, 1) == _s(1, 8)  # each rank repeats its own kv heads


def _move(op, rule: OpRule, shape: tuple[int, ...], *extra) -> None:
    x = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    node, _ = _graph(op, x, *extra)
    out, fp = op(x, *extra), Fingerprinter()
    d = max(range(len(shape)), key=lambda i: shape[i])  # the largest dim: never squeezed
    if rule.form in ("insert", "drop", "drop_ones"):  # a size-1 dim added or dropped: the others keep their order
        assert out.shape[moved_dim(node, d, list(shape))] == shape[d] and out.numel() == x.numel()
    else:  # a pure reorder: the permutation reproduces it on values
        assert torch.equal(x.permute(permutation(node)), out)
    got = _out(op, {0: Sharding(d, (Segment(shape[d], 1),))}, x, *extra)
    assert got == Sharding(moved_dim(node, d, fp.shape(x)), (Segment(shape[d], 1),))


def _complex_view(op, rule: OpRule) -> None:
    if rule.form == "complex":  # pairs of the last dim become one value
        x = _x(2, 4, 2)
        assert _out(op, {0: _s(1, 4)}, x) == _s(1, 4)
        _refuses(op, "complex view of the sharded dim", {0: _s(2, 2)}, x)
    else:
        assert _out(op, {0: _s(1, 4)}, _x(2, 4, dtype=torch.complex64)) == _s(1, 4)


def _slice(op, rule: OpRule) -> None:
    p, node = _propagate(op, {0: _s(2, 4, 4)}, _x(2, 3, 8), 2, 4, 8)  # the second of two fused segments
    assert p.region.specs[node] == _s(2, 4)
    assert [(r.arg, r.old, r.new) for r in p.region.rewrites] == [(2, 4, 2)]  # its local start
    _refuses(op, "a partial slice of the sharded dim", {0: _s(2, 8)}, _x(2, 3, 8), 2, 1, 5)


def _narrow(op, rule: OpRule) -> None:
    assert [a.name for a in op._schema.arguments] == ["self", "dim", "start", "length"]
    # the tensor-parallel visitor has no handler of its own: torch's rule keeps other dims local
    assert _out(op, {0: _s(1, 8)}, _x(3, 8), 0, 0, 2) == _s(1, 8)
    _refuses(op, "needs x0 whole, not sharded on dim 1", {0: _s(1, 8)}, _x(3, 8), 1, 0, 2)
    node, (x,) = _graph(op, _x(3, 8), 0, 0, 2)  # a head's logits: the vocab visitor narrows other dims
    v = _VocabPropagator(Fingerprinter(), TP, "head")
    v.region.specs[x] = _s(1, 8)
    v.visit(node)
    assert v.region.specs[node] == _s(1, 8)


def _select(op, rule: OpRule) -> None:
    assert _out(op, {0: _s(2, 8)}, _x(2, 3, 8), 1, 0) == _s(1, 8)
    _refuses(op, "select on the sharded dim", {0: _s(2, 8)}, _x(2, 3, 8), 2, 0)


def _index(op, rule: OpRule) -> None:
    # rows gathered by replicated indices of the leading dims: the sharded dim follows the indices' dims
    assert _out(op, {0: _s(1, 8)}, _x(3, 8), [torch.tensor([0, 2, 2])]) == _s(1, 8)
    assert _out(op, {0: _s(2, 8)}, _x(3, 4, 8), [torch.tensor([[0, 2], [1, 1]])]) == _s(3, 8)
    assert _out(op, {0: _s(2, 8)}, _x(3, 4, 8), [torch.tensor([0, 2]), torch.tensor([1, 3])]) == _s(1, 8)
    # a boolean mask reads its dims as one: torch's rule's to answer, as is an index of the sharded dim itself
    _refuses(op, "torch's sharding rule for aten.index.Tensor failed", {0: _s(2, 8)}, _x(3, 4, 8),
             [torch.rand(3, 4) < 0.5])
    _refuses(op, "torch's sharding rule for aten.index.Tensor failed", {0: _s(0, 8)}, _x(8, 3), [torch.tensor([0, 2])])


_SPLIT_ARGS = {"size": (4, 2), "sizes": ([4, 4], 2), "chunks": (2, 2)}


def _split(op, rule: OpRule) -> None:
    if rule.form == "unbind":
        x = _x(4, 3, 2)
        assert _out(op, {0: _s(0, 4)}, x, 1) == (_s(0, 4),) * 3
        _refuses(op, "unbind of the sharded dim", {0: _s(0, 4)}, x, 0)
        return
    x, how = _x(2, 3, 8), op._schema.arguments[1]  # what the form says the pieces are given by
    assert (how.name == "chunks") == (rule.form == "chunks")
    assert isinstance(how.type, torch.ListType) == (rule.form == "sizes")
    p, node = _propagate(op, {0: _s(2, 4, 4)}, x, *_SPLIT_ARGS[rule.form])  # q | k, each rank its half of both
    assert p.region.specs[node] == (_s(2, 4), _s(2, 4))
    assert {(r.arg, r.new) for r in p.region.rewrites} == (set() if rule.form == "chunks" else {(1, 2)})


def _triangle(op, rule: OpRule) -> None:
    assert _out(op, {0: _s(1, 4)}, _x(2, 4, 3, 3)) == _s(1, 4)  # heads sharded: each rank's own triangles
    _refuses(op, "of the sharded dim", {0: _s(2, 4)}, _x(2, 3, 4, 4))


def _unfold(op, rule: OpRule) -> None:
    """``x.unfold(d, k, step)``: channels sharded on dim 1 keep their cut in the windows of the sequence (dim 2,
    also named -1), ``(b, C, n) -> (b, C, windows, k)``; windows of the sharded dim would span ranks."""
    assert _out(op, {0: _s(1, 8)}, _x(2, 8, 7), -1, 4, 1) == _s(1, 8)
    assert _out(op, {0: _s(1, 8)}, _x(2, 8, 7), 2, 3, 2) == _s(1, 8)
    _refuses(op, "of the sharded dim", {0: _s(1, 8)}, _x(2, 8, 7), 1, 4, 1)


def _product(op, rule: OpRule) -> None:
    """``x * v``: ``v`` learned and whole on every rank (a parameter plus an input, ``(2, 3, 8)``) multiplies the
    cut ``x``: it enters through f and each rank reads its slice (Gemma's per-layer input scaling the gate).
    Added instead it is the residual stream, and stays refused."""
    assert rule.kind == "pointwise" and rule.scales and torch.Tag.pointwise in op.tags
    for combine in (op, aten.add.Tensor):
        root = torch.nn.Module()
        root.w = torch.nn.Parameter(_x(2, 3, 8))
        g = fx.Graph()
        x, z = g.placeholder("x"), g.placeholder("z")
        x.meta["val"], z.meta["val"] = _x(2, 3, 8), _x(2, 3, 8)
        w = g.get_attr("w")
        w.meta["val"] = root.w.detach()
        v = g.call_function(aten.add.Tensor, (w, z))
        v.meta["val"] = w.meta["val"] + z.meta["val"]
        y = g.call_function(combine, (x, v))
        y.meta["val"] = combine(x.meta["val"], v.meta["val"])
        g.output(y)
        fx.GraphModule(root, g)  # owns the graph: w is read as the module's parameter
        p = Propagator(Fingerprinter(), TP, "test")
        p.region.specs[x] = _s(2, 8)
        if combine is aten.add.Tensor:
            with pytest.raises(Unshardable, match="depends on a parameter"):
                p.visit(y)
            continue
        p.visit(y)
        assert p.region.specs[y] == _s(2, 8)
        assert [(e.consumer, e.operand) for e in p.region.entering] == [(y, v)], p.region.entering
        assert [(c.operand, c.dim) for c in p.region.slices] == [(v, 2)], p.region.slices


def _where_scalar(op, rule: OpRule) -> None:
    """``torch.where(mask, scores, -inf)``: torch decomposes each scalar overload into ``where.self`` (tagged
    pointwise), so the scores keep their heads and the mask (s, s) broadcasts over them."""
    from torch._decomp import decomposition_table
    from torch.fx.experimental.proxy_tensor import make_fx

    mask, x = torch.rand(3, 8) < 0.5, _x(2, 3, 8)
    args = {aten.where.ScalarOther: (mask, x, -1.0), aten.where.ScalarSelf: (mask, -1.0, x),
            aten.where.Scalar: (mask, 1.0, -1.0)}[op]
    gm = make_fx(lambda *a: op(*a), decomposition_table={op: decomposition_table[op]})(*args)
    assert aten.where.self in [n.target for n in gm.graph.nodes]
    assert torch.Tag.pointwise in aten.where.self.tags and rule is POINTWISE
    if op is not aten.where.Scalar:  # the scalar-only overload has no tensor to shard
        assert _out(op, {1: _s(2, 8)}, *args) == _s(2, 8)
    if op is aten.where.ScalarOther:  # a mask cut on another dim than the scores is no pointwise pairing
        _refuses(op, "sharded differently", {0: _s(1, 4), 1: _s(2, 8)}, torch.rand(2, 4, 8) < 0.5, _x(2, 4, 8), 0.0)


def _conv(op, rule: OpRule) -> None:
    """A depthwise convolution of channels sharded on dim 1: the filters cut with them, groups made local."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.get_attr("w")
    x.meta["val"], w.meta["val"] = _x(2, 8, 5), _x(8, 1, 3)
    padding = [2] if op is aten.conv1d.default else "same"
    conv = g.call_function(op, (x, w, None, [1], padding, [1], 8))
    conv.meta["val"] = op(x.meta["val"], w.meta["val"], None, [1], padding, [1], 8)
    gm = fx.GraphModule({"w": torch.nn.Parameter(w.meta["val"])}, g)
    p = Propagator(Fingerprinter(), TP, "test")
    p.region.specs[gm.graph.find_nodes(op="placeholder")[0]] = _s(1, 8)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    p.visit(node)
    assert p.region.specs[node] == _s(1, 8)
    assert [(c.node.target, c.dim) for c in p.region.params] == [("w", 0)]
    assert [(r.arg, r.old, r.new) for r in p.region.rewrites] == [(6, 8, 4)]  # groups: this rank's channels
    g2 = fx.Graph()  # not depthwise: every output channel reads every input channel
    x2, w2 = g2.placeholder("x"), g2.get_attr("w")
    x2.meta["val"], w2.meta["val"] = _x(2, 8, 5), _x(8, 8, 3)
    c2 = g2.call_function(op, (x2, w2, None, [1], padding, [1], 1))
    c2.meta["val"] = op(x2.meta["val"], w2.meta["val"], None, [1], padding, [1], 1)
    gm2 = fx.GraphModule({"w": torch.nn.Parameter(w2.meta["val"])}, g2)
    p2 = Propagator(Fingerprinter(), TP, "test")
    p2.region.specs[gm2.graph.find_nodes(op="placeholder")[0]] = _s(1, 8)
    with pytest.raises(Unshardable, match="only a depthwise convolution stays local"):
        p2.visit(next(n for n in gm2.graph.nodes if n.op == "call_function"))


def _cat(op, rule: OpRule) -> None:
    assert _out(op, {0: _s(2, 8), 1: _s(2, 8)}, [_x(2, 3, 8), _x(2, 3, 8)], 0) == _s(2, 8)
    # distinct values cut alike joined along their cut dim (q, k and v projections joined for one convolution):
    # this rank's block of each, in order: the segments of a fused projection
    assert _out(op, {0: _s(2, 8), 1: _s(2, 8)}, [_x(2, 3, 8), _x(2, 3, 8)], 2) == _s(2, 8, 8)
    # one value repeated (``torch.cat([k] * 2, dim=2)``): [2 whole copies, this rank's part of each]
    g, x = fx.Graph(), _x(2, 3, 8)
    k = g.placeholder("k")
    k.meta["val"] = x
    node = g.call_function(op, ([k, k], 2))
    node.meta["val"] = op([x, x], 2)
    p = Propagator(Fingerprinter(), TP, "test")
    p.region.specs[k] = _s(2, 8)
    p.visit(node)
    assert p.region.specs[node] == Sharding(2, (Segment(8, TP),), outer=True)
    _refuses(op, "cat along the sharded dim", {0: _s(2, 8)}, [_x(2, 3, 8), _x(2, 3, 8)], 2)


def _stack(op, rule: OpRule) -> None:
    assert _out(op, {0: _s(2, 8), 1: _s(2, 8)}, [_x(2, 3, 8), _x(2, 3, 8)], 0) == _s(3, 8)


_REDUCTION_ARGS = {  # reduce dim 1 of (2, 3, 8); [2]: the sharded dim instead
    aten.mean.dim: lambda d: ([d],), aten.sum.dim_IntList: lambda d: ([d],), aten.amax.default: lambda d: ([d],),
    aten.amin.default: lambda d: ([d],), aten.var.dim: lambda d: ([d], True, False),
    aten.std.dim: lambda d: ([d], True, False), aten.linalg_vector_norm.default: lambda d: (2, [d]),
    aten.norm.ScalarOpt_dim: lambda d: (2, [d]),
}


def _reduction(op, rule: OpRule) -> None:
    args, kw = _REDUCTION_ARGS.get(op, lambda d: ([d],))(1), {"correction": 1} if "correction" in str(op) else {}
    x = _x(2, 3, 8)
    assert rule.param is None or rule.param in [a.name for a in op._schema.arguments]
    node, _ = _graph(op, x, *args, **kw)
    r = reduction_args(node)
    assert (r.dims, r.keepdim) == ([1], False) and list(op(x, *args, **kw).shape) == [2, 8]
    assert _out(op, {0: _s(2, 8)}, x, *args, **kw) == _s(1, 8)
    over = _REDUCTION_ARGS.get(op, lambda d: ([d],))(2)
    if rule.stat is None:
        _refuses(op, "reduces the sharded dim", {0: _s(2, 8)}, x, *over, **kw)
        return
    p, node = _propagate(op, {0: _s(2, 8)}, x, *over, **kw)  # each rank's partial statistic, all-reduced
    assert node not in p.region.specs and p.region.stats[node].kind == rule.stat
    assert rule.stat == op.__name__.split(".")[0].removeprefix("linalg_vector_")


def _max_min(op, rule: OpRule) -> None:
    assert _out(op, {0: _s(2, 8)}, _x(2, 3, 8), 1) == (_s(1, 8), _s(1, 8))
    _refuses(op, "over the sharded dim", {0: _s(2, 8)}, _x(2, 3, 8), 2)


def _norm(op, rule: OpRule) -> None:
    assert rule.stat == op.__name__.split(".")[0]
    affine = [a.name for a in op._schema.arguments if a.name in ("weight", "bias")]
    assert [_arg_name(op, i) for i in rule.weights] == affine
    x = _x(2, 4, 8)
    assert _out(op, {0: _s(1, 4)}, x, [8]) == _s(1, 4)  # per head: the sharding passes
    p, node = _propagate(op, {0: _s(2, 8)}, x, [8])  # over the whole width: statistics completed by an all-reduce
    assert p.region.stats[node] == (rule.stat, 1 / TP)
    assert [(r.arg, r.index, r.old, r.new) for r in p.region.rewrites] == [(1, 0, 8, 4)]


def _matmul(op, rule: OpRule) -> None:
    lead = (2, 4) if op is aten.matmul.default else (4,)
    a, b = _x(*lead, 3, 5), _x(*lead, 5, 3)
    s = _s(len(lead) - 1, 4)
    assert _out(op, {0: s, 1: s}, a, b) == s
    _refuses(op, "contracted outside the row-parallel matmul", {0: _s(len(lead) + 1, 5)}, a, b)
    # a replicated right side reads each rank's rows of the left (a scan's readout ``h @ C``): the rows stay cut
    assert _out(op, {0: _s(len(lead), 3)}, a, b) == _s(len(lead), 3)
    assert _out(op, {1: _s(len(lead) + 1, 3)}, a, b) == _s(len(lead) + 1, 3)  # and the columns of the right


def _einsum(op, rule: OpRule) -> None:
    """Any number of operands, read per letter: a kept letter stays cut, a replicated operand with it is read as
    its slice (a parameter: cut), one without it broadcast; a contracted letter is refused."""
    d, bn, x, a = _x(2, 4, 8), _x(2, 4, 4), _x(2, 4, 8), _x(8, 4)
    assert _out(op, {0: _s(2, 8), 2: _s(2, 8)}, "bld,bln,bld->bldn", [d, bn, x]) == _s(2, 8)
    p, node = _propagate(op, {0: _s(2, 8)}, "bld,dn->bldn", [d, a])
    assert p.region.specs[node] == _s(2, 8) and [(c.operand.name, c.dim) for c in p.region.slices] == [("x1", 0)]
    assert _out(op, {0: _s(2, 8)}, "...d,dn->...dn", [d, a]) == _s(2, 8)  # an ellipsis, and no arrow
    assert _out(op, {0: _s(2, 8)}, "bld,bln", [d, bn]) == _s(0, 8)  # implicit output: the letters used once, d n
    _refuses(op, "contracts the sharded letter", {0: _s(2, 8)}, "bld,bld->bl", [d, x])
    _refuses(op, "sharded on different letters", {0: _s(2, 8), 1: _s(1, 4)}, "bld,bld->bld", [d, x])


def _baddbmm(op, rule: OpRule) -> None:
    s = _s(0, 4)
    assert _out(op, {0: s, 1: s, 2: s}, _x(4, 3, 3), _x(4, 3, 5), _x(4, 5, 3)) == s


def _sdpa(op, rule: OpRule) -> None:
    assert _arg_name(op, rule.random_p) == "dropout_p"
    q, k, v = _x(2, 4, 3, 8), _x(2, 4, 3, 8), _x(2, 4, 3, 8)
    p, node = _propagate(op, {0: _s(1, 4), 1: _s(1, 4), 2: _s(1, 4)}, q, k, v, dropout_p=0.0)
    assert p.region.specs[node] == _s(1, 4) and p.region.random_nodes == []
    _refuses(op, "attention not sharded by heads", {0: _s(2, 3), 1: _s(2, 3), 2: _s(2, 3)}, q, k, v)


def _index_put(op, rule: OpRule) -> None:
    cache, pos, k = _x(2, 4, 6, 8), torch.tensor([1, 3]), _x(2, 4, 2, 8)
    assert _out(op, {0: _s(1, 4), 2: _s(1, 4)}, cache, [None, None, pos], k) == _s(1, 4)
    _refuses(op, "indexes the sharded dim", {0: _s(1, 4), 2: _s(1, 4)}, cache, [None, pos], _x(2, 2, 6, 8))


def _index_copy(op, rule: OpRule) -> None:
    cache, pos, k = _x(2, 4, 6, 8), torch.tensor([1, 3]), _x(2, 4, 2, 8)
    assert _out(op, {0: _s(1, 4), 2: _s(1, 4)}, cache, 2, pos, k) == _s(1, 4)
    _refuses(op, "indexes the sharded dim", {0: _s(1, 4), 2: _s(1, 4)}, cache, 1, torch.tensor([0, 1]), _x(2, 2, 6, 8))


def _copy(op, rule: OpRule) -> None:
    assert _out(op, {0: _s(1, 4), 1: _s(1, 4)}, _x(2, 4, 3), _x(2, 4, 3)) == _s(1, 4)
    _refuses(op, "copied into a replicated tensor", {1: _s(1, 4)}, _x(2, 4, 3), _x(2, 4, 3))


def _new_like(op, rule: OpRule) -> None:
    extra = (1.0,) if op is aten.new_full.default else ()  # new_full's fill value, after the sizes
    p, node = _propagate(op, {0: _s(1, 4)}, _x(2, 4, 3), [2, 4, 3], *extra)
    assert p.region.specs[node] == _s(1, 4)
    assert [(r.arg, r.index, r.old, r.new) for r in p.region.rewrites] == [(1, 1, 4, 2)]  # this rank's heads


def _like(op, rule: OpRule) -> None:  # reads no values of its input
    extra = (1.0,) if op is aten.full_like.default else ()
    x = _x(2, 4, 3)
    a, b = op(x, *extra), op(x * 2, *extra)
    assert a.shape == b.shape and (op is aten.empty_like.default or torch.equal(a, b))
    assert _out(op, {0: _s(1, 4)}, x, *extra) == _s(1, 4)  # torch's rule: shaped like this rank's shard


def _factory(op, rule: OpRule) -> None:
    """A constant-filled operand spanning the sharded dim is made local-sized (its size list rewritten)."""
    extra = (1.0,) if op is aten.full.default else ()
    g = fx.Graph()
    y = g.placeholder("y")
    y.meta["val"] = _x(2, 4, 3)
    z = g.call_function(op, ([2, 4, 3], *extra))
    z.meta["val"] = op([2, 4, 3], *extra)
    add = g.call_function(aten.add.Tensor, (y, z))
    add.meta["val"] = y.meta["val"] + z.meta["val"]
    p = Propagator(Fingerprinter(), TP, "test")
    p.region.specs[y] = _s(1, 4)
    p.visit(add)
    assert p.region.specs[add] == _s(1, 4)
    assert [(r.node, r.arg, r.index, r.old, r.new) for r in p.region.rewrites] == [(z.name, 0, 1, 4, 2)]


def _losses(op, rule: OpRule) -> None:
    """The vocab visitor's losses over logits sharded on the class dim."""
    g, target = fx.Graph(), torch.tensor([1, 5, 7])
    logits = g.placeholder("logits")
    logits.meta["val"] = _x(3, 8)
    t = g.placeholder("target")
    t.meta["val"] = target
    x = logits
    if rule.kind == "nll_loss":
        x = g.call_function(aten.log_softmax.int, (logits, 1))
        x.meta["val"] = logits.meta["val"].log_softmax(1)
    loss = g.call_function(op, (x, t))
    loss.meta["val"] = op(x.meta["val"], target)
    v = _VocabPropagator(Fingerprinter(), TP, "head")
    v.region.specs[logits] = _s(1, 8)
    for n in [x, loss] if x is not logits else [loss]:
        v.visit(n)
    assert [(f.node, f.logits) for f in v.losses] == [(loss, logits)]
    # tensor-parallel regions end at a row matmul; torch's rule needs the class dim whole
    _refuses(op, "needs x0 whole|no sharding strategy", {0: _s(1, 8)}, _x(3, 8), target)


def _getitem(op, rule: OpRule) -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = _x(2, 3, 8)
    split = g.call_function(aten.split.Tensor, (x, 4, 2))
    split.meta["val"] = aten.split.Tensor(x.meta["val"], 4, 2)
    second = g.call_function(op, (split, 1))
    p = Propagator(Fingerprinter(), TP, "test")
    p.region.specs[x] = _s(2, 4, 4)
    p.visit(split)
    p.visit(second)
    assert p.region.specs[second] == _s(2, 4)


def _sym_size(op, rule: OpRule) -> None:
    x = _x(2, 3, 8)
    assert op(x, 1) == 3
    p, node = _propagate(op, {0: _s(2, 8)}, x, 1)
    assert node not in p.region.specs
    _refuses(op, "the size of the sharded dim is read at run time", {0: _s(2, 8)}, x, 2)


def _no_output(op, rule: OpRule) -> None:
    x = _x(2, 3, 8)
    assert op(x, dtype=torch.float32) is None
    p, node = _propagate(op, {0: _s(2, 8)}, x, dtype=torch.float32)
    assert node not in p.region.specs


_MOVE_ARGS = {
    aten.transpose.int: ((2, 3, 4), 0, 2), aten.swapaxes.default: ((2, 3, 4), -1, 1),
    aten.swapdims.default: ((2, 3, 4), 0, 1), aten.t.default: ((3, 4),), aten.numpy_T.default: ((2, 3, 4),),
    aten.mT.default: ((2, 3, 4),), aten.mH.default: ((2, 3, 4),), aten.adjoint.default: ((2, 3, 4),),
    aten.permute.default: ((2, 3, 4), [1, 2, 0]), aten.movedim.int: ((2, 3, 4), 0, 2),
    aten.movedim.intlist: ((2, 3, 4), [0, 1], [2, 0]), aten.unsqueeze.default: ((2, 3, 4), 1),
    aten.squeeze.dim: ((2, 1, 4), 1), aten.squeeze.dims: ((1, 3, 1, 4), [0, 2]), aten.squeeze.default: ((2, 1, 4),),
}
CHECKS = {
    **{op: _same_shape for op in (aten.contiguous.default, aten.clone.default, aten.alias.default, aten.detach.default,
                                   aten.lift_fresh_copy.default)},
    aten.to.dtype: lambda op, r: _same_shape(op, r, torch.float64),
    aten.to.dtype_layout: lambda op, r: _same_shape(op, r, dtype=torch.float64),
    aten.to.device: lambda op, r: _same_shape(op, r, torch.device("cpu"), torch.float64),
    aten._to_copy.default: lambda op, r: _same_shape(op, r, dtype=torch.float64),
    aten.type_as.default: _type_as,
    **dict.fromkeys((aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar), _where_scalar),
    aten.mul.Tensor: _product,
    **dict.fromkeys((aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default), _dropout),
    aten.softmax.int: _softmax, aten.log_softmax.int: _softmax,
    aten._softmax.default: lambda op, r: _softmax(op, r, False),
    aten._log_softmax.default: lambda op, r: _softmax(op, r, False),
    **{op: (lambda args: lambda op, r: _move(op, r, *args))(args) for op, args in _MOVE_ARGS.items()},
    **dict.fromkeys((aten.view.default, aten.reshape.default, aten._unsafe_view.default), _view),
    aten.flatten.using_ints: _flatten, aten.expand.default: _expand, aten.broadcast_to.default: _expand,
    aten.expand_as.default: _expand_as, aten.repeat.default: _repeat, aten.tile.default: _tile,
    aten.repeat_interleave.self_int: _repeat_interleave,
    aten.view_as_complex.default: _complex_view, aten.view_as_real.default: _complex_view,
    aten.slice.Tensor: _slice, aten.narrow.default: _narrow, aten.select.int: _select, aten.index.Tensor: _index,
    **{op: _split for op, r in OP_RULES.items() if r.kind == "split"},
    **{op: _cat for op, r in OP_RULES.items() if r.kind == "cat"}, aten.stack.default: _stack,
    **{op: _triangle for op, r in OP_RULES.items() if r.kind == "triangle"}, aten.unfold.default: _unfold,
    **{op: _conv for op, r in OP_RULES.items() if r.kind == "conv"},
    **{op: _reduction for op, r in OP_RULES.items() if r.kind == "reduction"},
    aten.max.dim: _max_min, aten.min.dim: _max_min, aten.rms_norm.default: _norm, aten.layer_norm.default: _norm,
    aten.matmul.default: _matmul, aten.bmm.default: _matmul, aten.baddbmm.default: _baddbmm,
    aten.einsum.default: _einsum,
    aten.scaled_dot_product_attention.default: _sdpa,
    aten.index_put_.default: _index_put, aten.index_put.default: _index_put,
    aten.index_copy_.default: _index_copy, aten.index_copy.default: _index_copy, aten.copy_.default: _copy,
    **{op: _new_like for op, r in OP_RULES.items() if r.kind == "new_like"},
    **{op: _like for op, r in OP_RULES.items() if r.kind == "like"},
    **{op: _factory for op, r in OP_RULES.items() if r.kind == "factory"},
    **{op: _losses for op, r in OP_RULES.items() if r.kind in ("cross_entropy", "nll_loss")},
    operator.getitem: _getitem, aten.sym_size.int: _sym_size, aten._assert_tensor_metadata.default: _no_output,
}


def _name(op: object) -> str:
    return getattr(op, "__name__", str(op))


@pytest.mark.parametrize("op", list(OP_RULES), ids=[_name(op) for op in OP_RULES])
def test_rule(op):
    CHECKS[op](op, OP_RULES[op])


def test_every_entry_is_checked():
    assert set(CHECKS) == set(OP_RULES)


def test_pointwise_ops_fall_back_to_their_tag():
    assert op_rule(aten.add.Tensor) is POINTWISE and op_rule(aten.where.self) is POINTWISE
    assert op_rule(aten.clone.default) is OP_RULES[aten.clone.default]  # the table first (clone is tagged too)
    assert op_rule(aten.topk.default) is TORCH  # not in the table: torch's rule (DTensor has a strategy)
    assert op_rule(aten.searchsorted.Tensor) is None and op_rule("output") is None  # in neither
    x, y = _x(2, 3, 8), _x(8)
    p, node = _propagate(aten.add.Tensor, {0: _s(2, 8)}, x, y)  # a replicated (8,) spans the sharded dim
    assert p.region.specs[node] == _s(2, 8) and [(c.operand.name, c.dim) for c in p.region.slices] == [("x1", 0)]


def test_the_table_is_immutable():
    with pytest.raises(TypeError):
        OP_RULES[aten.add.Tensor] = POINTWISE  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        OP_RULES[aten.view.default].kind = "move"  # type: ignore[misc]


def _kinds(cls: type) -> set[str]:
    return {m.removeprefix("_on_") for m in dir(cls) if m.startswith("_on_")}


def test_visitors_dispatch_on_the_table_only():
    """Every handler serves a kind of the table; no visitor names an aten op or keeps an op set of its own."""
    kinds = {r.kind for r in OP_RULES.values()} | {POINTWISE.kind, TORCH.kind}
    for cls in (Propagator, _Sequence, _VocabPropagator):
        assert _kinds(cls) <= kinds, (cls, _kinds(cls) - kinds)
    assert {"move", "view", "split", "reduction", "norm", "sdpa", "getitem"} <= _kinds(Propagator)
    for name in ("propagate.py", "sequence.py", "shape_rules.py", "value_rules.py", "column_layout.py"):
        src = (ANALYSIS / name).read_text()
        assert "aten." not in src and "torch.ops" not in src and "operator.getitem" not in src, name
    moves = [f"aten.{op.__name__}" for op, r in OP_RULES.items() if r.kind == "move"]
    for name in ("vocab.py", "matmuls.py", "coverage.py", "ops.py", "partial.py"):  # one definition of the ops that move a dim
        src = (ANALYSIS / name).read_text()
        assert not re.search(r"^_?(MOVES|TRANSPOSES\w*)\s*=\s*\{", src, re.M), name
        assert not [m for m in moves if re.search(re.escape(m) + r"\b", src)], name


def test_fingerprints_keep_the_divisions_the_graph_makes():
    """A size the graph divides (positions folded in groups of 4: ``view(b, s // 4, 4, f)``) is fingerprinted as a
    prime times the divisor, so the fold's view keeps the number of elements; other sizes stay distinct primes."""
    import view_gap_models

    from autotp.capture.tracer import capture
    from autotp.analysis.shapes import view_groups

    model, args, kwargs = view_gap_models.build("seq_fold")
    gm = capture(model, args, kwargs)[0]
    fp = Fingerprinter(gm)
    folds = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
             and n.meta["val"].dim() == 4 and fp.shape(n)[-2:] == [4, 128] and n.args[0].meta["val"].dim() == 3]
    assert len(folds) == 2, folds  # both layers' spellings
    for n in folds:
        src, dst = fp.shape(n.args[0]), fp.shape(n)
        b, s = src[:2]
        assert dst[:3] == [b, s // 4, 4] and s % 4 == 0 and b % 2 == 1  # only the divided size carries the 4
        assert view_groups(src, dst) == [([0], [0]), ([1], [1, 2]), ([2], [3])]
