"""What the sharding rules know about aten ops and their arguments, shared by propagation and layout.

The op families the rules treat alike, how to read a node's arguments whichever way the overload spells
them, and the two values every rule produces: :class:`Unshardable` (why a region stays replicated) and
:class:`Rewrite` (an integer constant of the graph that changes with the sharding).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autotp.errors import ShardingError
from autotp.analysis.shapes import is_static, normalize_dim
from autotp.plan.shard_spec import Sharding

aten = torch.ops.aten

# ops whose output has the input's shape and sharding (besides every op tagged pointwise)
SAME_SHAPE = {
    aten.contiguous.default, aten.clone.default, aten.dropout.default, aten.alias.default, aten.detach.default,
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default,
    aten.feature_dropout.default, aten.alpha_dropout.default, aten.lift_fresh_copy.default,
}
SOFTMAX = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default}
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int, aten.split.sizes}
NO_OUTPUT = {aten._assert_tensor_metadata.default}
# ops that only reorder dims, however the model spells them (``k.mT``, ``swapaxes(-2, -1)``, ``movedim``,
# ``permute(0, 1, -1, -2)``, ``adjoint()``): one rule each visitor shares, through :func:`permutation`
TRANSPOSES = {aten.transpose.int, aten.swapaxes.default, aten.swapdims.default, aten.t.default,
              aten.numpy_T.default, aten.mT.default, aten.mH.default, aten.adjoint.default, aten.permute.default,
              aten.movedim.int, aten.movedim.intlist}
# reductions (dims, keepdim) that pass a sharding through when they do not reduce the sharded dim
REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.var.correction,
               aten.std.correction, aten.var.dim, aten.std.dim, aten.linalg_vector_norm.default, aten.norm.ScalarOpt_dim}
NORMS = {aten.rms_norm.default: "rms_norm", aten.layer_norm.default: "layer_norm"}
FACTORIES = {aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format}
RANDOM_P_ARG = {aten.dropout.default: 1, aten.feature_dropout.default: 1, aten.alpha_dropout.default: 1,
                 aten.scaled_dot_product_attention.default: 4}


# reductions over the sharded dim that one all-reduce of the ranks' partial values completes
STAT_KINDS = {aten.mean.dim: "mean", aten.sum.dim_IntList: "sum", aten.var.correction: "var", aten.var.dim: "var",
               aten.std.correction: "std", aten.std.dim: "std", aten.linalg_vector_norm.default: "norm",
               aten.norm.ScalarOpt_dim: "norm"}


@dataclass(frozen=True)
class ReductionArgs:
    dims: list[int] | None  # None: every dim
    keepdim: bool
    param: float | None = None  # a norm's order p, a var/std's correction


def reduction_args(node: fx.Node) -> ReductionArgs:
    """The reduced dims, keepdim and order/correction of a reduction node, whichever overload spells them."""
    t = node.target
    if t in (aten.linalg_vector_norm.default, aten.norm.ScalarOpt_dim):
        p = arg_of(node, 1, "ord" if t is aten.linalg_vector_norm.default else "p", 2)
        dims, keep = arg_of(node, 2, "dim", None), arg_of(node, 3, "keepdim", False)
        param = 2.0 if p is None else float(p)
    elif t in (aten.var.dim, aten.std.dim):
        dims, keep, param = arg_of(node, 1, "dim", None), arg_of(node, 3, "keepdim", False), float(arg_of(node, 2, "unbiased", True))
    elif t in (aten.var.correction, aten.std.correction):
        c = node.kwargs.get("correction")
        dims, keep, param = arg_of(node, 1, "dim", None), node.kwargs.get("keepdim", False), 1.0 if c is None else float(c)
    else:
        dims, keep, param = arg_of(node, 1, "dim", None), arg_of(node, 2, "keepdim", False), None
    dims = None if dims is None or dims == [] else [dims] if isinstance(dims, int) else list(dims)
    return ReductionArgs(dims, bool(keep), param)


class Unshardable(Exception):
    def __init__(self, node: fx.Node, reason: str):
        self.node = node
        self.reason = reason
        super().__init__(f"{node.name}: {reason}")


@dataclass(frozen=True)
class Rewrite:
    """``node.args[arg]`` (or its element ``index`` when the arg is a list) changes from ``old`` to ``new``.

    ``factor_of``: the element is a size computed at run time, ``factor_of = x * old`` (``b * n_heads``); it
    becomes a fresh ``x * new`` for this node only (other readers of ``factor_of`` keep the full size).
    """

    node: str
    arg: int
    index: int | None
    old: int
    new: int
    factor_of: str | None = None


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
    """The dims a :data:`TRANSPOSES` node reorders, as a permutation of its input's: output dim ``j`` is input
    dim ``perm[j]``. ``k.mT`` of ``(b, nh, s, hd)`` is ``[0, 1, 3, 2]``; ``x.movedim(1, 0)`` of ``(b, s, h)`` is
    ``[1, 0, 2]``. mH and adjoint also conjugate complex values, which moves no sharding."""
    t, nd = node.target, ndim_of(node.args[0])
    arg = lambda i: arg_of(node, i, t._schema.arguments[i].name)  # noqa: E731 - swapaxes says axis0, ..
    perm = list(range(nd))
    if t is aten.permute.default:
        return [normalize_dim(d, nd) for d in arg(1)]
    if t is aten.numpy_T.default:  # ``x.T``: all dims reversed
        return perm[::-1]
    if t in (aten.movedim.int, aten.movedim.intlist):
        src, dst = arg(1), arg(2)
        src, dst = ([src], [dst]) if isinstance(src, int) else (list(src), list(dst))
        src, dst = [normalize_dim(d, nd) for d in src], [normalize_dim(d, nd) for d in dst]
        rest = iter(d for d in perm if d not in src)
        placed = dict(zip(dst, src))
        return [placed[j] if j in placed else next(rest) for j in range(nd)]
    if t in (aten.transpose.int, aten.swapaxes.default, aten.swapdims.default):
        a, b = normalize_dim(arg(1), nd), normalize_dim(arg(2), nd)
    elif t is aten.t.default:  # 0-D and 1-D: unchanged
        a, b = (0, 1) if nd == 2 else (0, 0)
    else:  # mT, mH, adjoint: the last two dims
        a, b = nd - 2, nd - 1
    perm[a], perm[b] = perm[b], perm[a]
    return perm


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


def from_inputs(ids: fx.Node) -> bool:
    """Do ``ids`` come from the call's inputs (token ids), not only from shapes (positions)?"""
    return reaches(ids, lambda n: n.op == "placeholder", lambda n: n.target is aten.sym_size.int)


def arg_of(node: fx.Node, idx: int, name: str, default: object = None) -> object:
    if len(node.args) > idx:
        return node.args[idx]
    return node.kwargs.get(name, default)


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
