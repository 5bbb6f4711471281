"""What the sharding rules know about aten ops and their arguments, shared by propagation and layout.

How to read a node's arguments whichever way the overload spells them (the op's facts are in
:mod:`autotp.analysis.op_rules`), where a dim goes through an op that moves dims, and the two values every
rule produces: :class:`Unshardable` (why a region stays replicated) and
:class:`Rewrite` (an integer constant of the graph that changes with the sharding).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.fx as fx

from autotp.errors import ShardingError
from autotp.analysis.op_rules import OP_RULES, OpRule, kind_of, ops_of, permutes
from autotp.analysis.shapes import is_static, normalize_dim
from autotp.shard_spec import Sharding

# views of the table for readers that test membership (see :mod:`autotp.analysis.op_rules`)
SAME_SHAPE = ops_of("same_shape")  # one input, shape and layout kept: casts, copies, dropout
NO_OUTPUT = ops_of("no_output")  # export's checks of its inputs: they compute nothing
TRANSPOSES = frozenset(op for op in ops_of("move") if permutes(op))  # every spelling of a dim reorder
# reductions over the sharded dim that one all-reduce of the ranks' partial values completes -> statistic
STAT_KINDS = MappingProxyType({op: r.stat for op, r in OP_RULES.items() if r.kind == "reduction" and r.stat})


@dataclass(frozen=True)
class ReductionArgs:
    dims: list[int] | None  # None: every dim
    keepdim: bool
    param: float | None = None  # a norm's order p, a var/std's correction


def reduction_args(node: fx.Node) -> ReductionArgs:
    """The reduced dims, keepdim and order/correction of a reduction node, whichever overload spells them."""
    param = OP_RULES[node.target].param  # the argument holding the order or correction, if any
    dims, keep = arg_named(node, "dim"), arg_named(node, "keepdim", False)
    if param == "unbiased":  # var.dim / std.dim: a Bessel correction of 1 or 0
        value = float(arg_named(node, param, True))
    elif param == "correction":
        c = arg_named(node, param)
        value = 1.0 if c is None else float(c)
    elif param is not None:  # a vector norm's order, 2 by default
        p = arg_named(node, param, 2)
        value = 2.0 if p is None else float(p)
    else:
        value = None
    dims = None if dims is None or dims == [] else [dims] if isinstance(dims, int) else list(dims)
    return ReductionArgs(dims, bool(keep), value)


def is_random(node: fx.Node, rule: OpRule) -> bool:
    """Does ``node`` draw random numbers: a dropout whose probability is not a literal 0?"""
    if rule.random_p is None:
        return False
    p = arg_of(node, rule.random_p, node.target._schema.arguments[rule.random_p].name, 0.0)
    return not (isinstance(p, (int, float)) and p == 0)


class Unshardable(Exception):
    def __init__(self, node: fx.Node, reason: str):
        self.node = node
        self.reason = reason
        super().__init__(f"{node.name}: {reason}")


class Strided(Unshardable):
    """Heads cut in order meet heads repeated head-minor (``k.repeat(1, n_rep, 1, 1)``: query head ``h`` reads
    kv head ``h % n_kv``), which each rank holds as ``[n_rep whole, its kv heads]`` (an ``outer`` sharding):
    the pair may still be cut if the column feeding the in-order operand is cut with that stride instead, its
    ``blocks`` repeats each whole on every rank (see :func:`autotp.shard_spec.strided`)."""

    def __init__(self, node: fx.Node, reason: str, blocks: int):
        super().__init__(node, reason)
        self.blocks = blocks


class Pieces(Unshardable):
    """Heads cut in order are chunked into ``blocks`` equal pieces that are read apart (DiffLlama's differential
    attention pairs head ``i`` with head ``i + n/2``: ``attn.chunk(2, dim=heads)``): each rank's heads would fall in
    one piece. The pair may still be cut if its columns are cut per piece (each rank the r-th slice of every
    piece, :func:`autotp.analysis.column_layout.column_segments` with ``pieces``), so that a piece never mixes
    ranks and the pieces a rank holds meet one another."""

    def __init__(self, node: fx.Node, reason: str, blocks: int):
        super().__init__(node, reason)
        self.blocks = blocks


def held_whole(s: object) -> bool:
    """Every rank holds all of ``s``: each segment is one block (a single kv head, replicated Megatron's way),
    so its size is the same on every rank and no dim of it is cut, whichever dim ``s`` names."""
    return isinstance(s, Sharding) and s.inner is None and not s.outer and s.group is None \
        and all(g.parts == 1 and not g.inner for g in s.segments)


def split_dims(gj: list[int], dst: list[int]) -> list[int]:
    """The dims a view splits one dim into, outermost first: ``[1, 16]`` is one head of 16 (two dims),
    ``[16, 1]`` is a plain reshape (one dim)."""
    real = [j for j in gj if dst[j] != 1]
    if not real:
        return gj[:1]
    lead = [j for j in gj if j < real[0]]
    return lead[-1:] + real


def permutation(node: fx.Node) -> list[int]:
    """The dims a dim-reordering node (:func:`~autotp.analysis.op_rules.permutes`) reorders, as a permutation
    of its input's: output dim ``j`` is input dim ``perm[j]``. ``k.mT`` of ``(b, nh, s, hd)`` is
    ``[0, 1, 3, 2]``; ``x.movedim(1, 0)`` of ``(b, s, h)`` is ``[1, 0, 2]``. mH and adjoint also conjugate
    complex values, which moves no sharding."""
    form, nd = OP_RULES[node.target].form, ndim_of(node.args[0])
    arg = lambda i: arg_of(node, i, node.target._schema.arguments[i].name)  # noqa: E731 - swapaxes says axis0, ..
    perm = list(range(nd))
    if form == "perm":
        return [normalize_dim(d, nd) for d in arg(1)]
    if form == "reverse":  # ``x.T``: all dims reversed
        return perm[::-1]
    if form == "movedim":
        src, dst = arg(1), arg(2)
        src, dst = ([src], [dst]) if isinstance(src, int) else (list(src), list(dst))
        src, dst = [normalize_dim(d, nd) for d in src], [normalize_dim(d, nd) for d in dst]
        rest = iter(d for d in perm if d not in src)
        placed = dict(zip(dst, src))
        return [placed[j] if j in placed else next(rest) for j in range(nd)]
    if form == "pair":
        a, b = normalize_dim(arg(1), nd), normalize_dim(arg(2), nd)
    elif form == "t":  # 0-D and 1-D: unchanged
        a, b = (0, 1) if nd == 2 else (0, 0)
    else:  # "last_two": mT, mH, adjoint
        a, b = nd - 2, nd - 1
    perm[a], perm[b] = perm[b], perm[a]
    return perm


def squeezed_dims(node: fx.Node, in_shape: list[int]) -> list[int]:
    """The dims of its input (of shape ``in_shape``) that a squeeze drops: those it names that have size 1."""
    form = OP_RULES[node.target].form
    if form == "drop_ones":
        return [i for i, n in enumerate(in_shape) if n == 1]
    if form != "drop":  # a transpose, permute, unsqueeze: no dim is dropped
        return []
    dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    return [normalize_dim(d, len(in_shape)) for d in dims if in_shape[normalize_dim(d, len(in_shape))] == 1]


def moved_dim(node: fx.Node, d: int, in_shape: list[int]) -> int:
    """Where dim ``d`` of a move node's input (of shape ``in_shape``) is in its output: reordered (a transpose),
    shifted by a new size-1 dim (unsqueeze) or by the size-1 dims dropped before it (squeeze; a dropped
    ``d`` gives the dim that follows it)."""
    form = OP_RULES[node.target].form
    if form == "insert":
        return d + (d >= normalize_dim(node.args[1], len(in_shape) + 1))
    if form in ("drop", "drop_ones"):
        return d - sum(g < d for g in squeezed_dims(node, in_shape))
    return permutation(node).index(d)


def reaches(node: fx.Node, hit, skip=lambda n: False) -> bool:
    """Whether ``node`` or anything it is computed from satisfies ``hit`` (not looking past ``skip`` nodes)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or skip(n):
            continue
        seen.add(n)
        if hit(n):
            return True
        todo.extend(n.all_input_nodes)
    return False


def unread(node: fx.Node) -> bool:
    """Does nothing computed from ``node`` reach the graph's output or a write (a value whose result no one
    reads: Gemma 4's pad row put by ``torch.where`` into embeddings its per-layer inputs do not read, a gate
    pooling windows longer than the call's sequence)?"""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "output" or (isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable):
            return False
        todo.extend(n.users)
    return True


def from_inputs(ids: fx.Node) -> bool:
    """Do ``ids`` come from the call's inputs (token ids), not only from shapes (positions)?"""
    return reaches(ids, lambda n: n.op == "placeholder", lambda n: kind_of(n.target) == "sym_size")


def arg_of(node: fx.Node, idx: int, name: str, default: object = None) -> object:
    if len(node.args) > idx:
        return node.args[idx]
    return node.kwargs.get(name, default)


def arg_named(node: fx.Node, name: str, default: object = None) -> object:
    """The argument ``name`` of an aten op's node, passed by position or by keyword, as its schema places it."""
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            return node.kwargs.get(name, default) if a.kwarg_only else arg_of(node, i, name, default)
    raise KeyError(f"{node.target} has no argument {name}")


def legacy_empty(x: object) -> bool:
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape[0] == 0


def ndim_of(node: object) -> int | None:
    if isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor):
        return node.meta["val"].dim()
    return None


def parts_for(units: int, size: int, tp: int, what: str) -> int:
    """How many blocks a dim of ``units`` heads (or features) is cut into; Megatron's rules."""
    if units % tp == 0:
        return tp
    if tp % units == 0 and size % units == 0:
        return units  # fewer heads than ranks: each head is replicated on tp // units ranks
    raise ShardingError(
        f"{what}: {units} is not divisible by tp={tp} (and tp is not a multiple of it)",
        hint=f"choose a tp that divides {units}",
    )


def slice_range(node: fx.Node, full: int) -> tuple[int, int] | None:
    """``[start, end)`` of a step-1 ``aten.slice`` with static bounds, clamped to ``full``; else None."""
    start, end, step = arg_of(node, 2, "start", None), arg_of(node, 3, "end", None), arg_of(node, 4, "step", 1)
    start = 0 if start is None else start
    end = full if end is None else end
    if step != 1 or not (is_static(start) and is_static(end)):
        return None
    start, end = (x + full if x < 0 else x for x in (start, end))
    return max(0, min(start, full)), max(0, min(end, full))


def is_guard(u: fx.Node) -> bool:
    """The exported module's check of its inputs' shapes (it reads sizes, never values)."""
    return u.op == "call_module" and str(u.target).startswith("_guards")


def unflattened_sequence_of_one(gj: list[int], dst: list[int], size: int) -> bool:
    """``[b·s, N] -> [b, s, N]`` with s = 1 looks like one head of N (``[.., 1, N]``); a size-1 dim right
    after the batch dim is the sequence (heads come after it: ``[b, s, 1, hd]``)."""
    return len(gj) == 2 and gj[0] == 1 and dst[1] == 1 and dst[gj[1]] == size



def unseen_write(node: fx.Node) -> torch._ops.OpOverload | None:
    """The functional form of ``node`` where it is an in-place op whose write no other node can see, else None.

    ``scores.masked_fill_(mask, -inf)`` (XLM) writes into the matmul's result; the graph shows the write is
    unseen when the written tensor is a fresh intermediate (made by an op that returns no view of its inputs,
    or by another unseen write: not a graph input, parameter, buffer or constant, not a view whose base the
    write would reach) and every other node that reads it, or a view of it, runs before the write (a later
    reader reads the write's result, which is the functional op's output). Then the op computes exactly
    ``masked_fill(scores, mask, -inf)`` and a rule for the functional form places it; the graph that runs
    keeps the in-place op, on each rank's shard."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.inplace not in target.tags:
        return None
    schema = target._schema
    written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    if written != [0] or not node.args or not isinstance(x := node.args[0], fx.Node):
        return None
    if x.op != "call_function" or not isinstance(x.target, torch._ops.OpOverload):
        return None  # a graph input, parameter, buffer or constant: the caller's or the model's tensor
    if _aliases(x.target) and unseen_write(x) is None:
        return None  # a view (the write would reach its base), or a write someone sees
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    seen, todo = {x}, [x]
    while todo:  # x and its views: every reader but the write runs before it
        for u in todo.pop().users:
            if u is node:
                continue
            if order[u] > order[node]:
                return None
            if u.op == "call_function" and _aliases(u.target) and u.args and u.args[0] in seen and u not in seen:
                seen.add(u)
                todo.append(u)
    name = schema.name.split("::")[-1]
    packet = getattr(torch.ops.aten, name[:-1], None) if schema.name.startswith("aten::") and name.endswith("_") \
        else None
    functional = getattr(packet, target._overloadname, None) if packet is not None else None
    if functional is None or functional._schema.is_mutable:
        return None
    return functional


def _aliases(target: object) -> bool:
    """Does ``target`` return a view of (or the same tensor as) its first input: ``view``, ``transpose``, ``add_``?"""
    return isinstance(target, torch._ops.OpOverload) and any(r.alias_info is not None for r in target._schema.returns)
