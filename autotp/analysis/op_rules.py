"""One table of what the analysis knows about each op: the kind of rule that shards it and the facts the
rule reads, as DTensor registers one sharding strategy per op.

Every visitor of a captured graph looks an op up here with :func:`op_rule` and dispatches on
:attr:`OpRule.kind` to one handler per kind: tensor-parallel propagation
(:class:`~autotp.analysis.propagate.Propagator`), sequence parallelism, the vocab-parallel heads, the
column layout probe and the weight chains of matmuls. A kind a visitor has no handler for is an op it has
no rule for. Ops tagged ``torch.Tag.pointwise`` that the table does not list are ``"pointwise"``; any other
op DTensor can place is ``"torch"``: the visitor asks DTensor's sharding propagator
(:mod:`~autotp.analysis.torch_rules`), where autotp's own rules are stricter or richer.

How an op spells its arguments (which overload names ``dim``, where ``keepdim`` is) is read from its
schema by :mod:`autotp.analysis.ops`; the table keeps only what the schema does not say.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from types import MappingProxyType

import torch

from autotp.analysis.torch_rules import has_torch_rule

aten = torch.ops.aten


@dataclass(frozen=True)
class OpRule:
    """The rule of one op. ``kind`` picks each visitor's handler; the other fields are per-op facts."""

    kind: str
    # move: how it names the dims it moves ("pair": two dims, "last_two", "t", "reverse": all of them,
    # "perm": a permutation, "movedim", "insert": a new size-1 dim, "drop": the size-1 dims named,
    # "drop_ones": every size-1 dim); split: how it gives the pieces ("size": one size for all, "sizes",
    # "chunks": a count, "unbind"); complex_view: "complex" (pairs of the last dim become one value) or "real"
    form: str | None = None
    stat: str | None = None  # reduction / norm over the sharded dim: the statistic one all-reduce completes
    param: str | None = None  # reduction: the argument holding a norm's order or a var/std's correction
    weights: tuple[int, ...] = ()  # norm: the args holding its affine weight (and bias)
    random_p: int | None = None  # the arg holding a dropout probability: the op is random where it is not 0
    cast: bool = False  # keeps a tensor's values (up to rounding) and shape: a weight is read through it
    dtype_arg: int | None = None  # the operand read only for its dtype (``W.type_as(x)``: x)
    log: bool = False  # softmax: gives log-probabilities
    broadcasts: bool = False  # broadcasts its first operand to more or larger dims, aligned from the right
    scales: bool = False  # pointwise: multiplies its operands, so a whole one scales the cut one elementwise


POINTWISE = OpRule("pointwise")  # the rule of every op tagged pointwise that the table does not list
_CAST = OpRule("same_shape", cast=True)
_SAME = OpRule("same_shape")
_DROPOUT = OpRule("same_shape", random_p=1)
_SOFTMAX, _LOG_SOFTMAX = OpRule("softmax"), OpRule("softmax", log=True)
_VIEW = OpRule("view")
_EXPAND = OpRule("expand", broadcasts=True)


def _move(form: str) -> OpRule:
    return OpRule("move", form=form)


def _split(form: str) -> OpRule:
    return OpRule("split", form=form)


def _reduction(stat: str | None, param: str | None = None) -> OpRule:
    return OpRule("reduction", stat=stat, param=param)


OP_RULES: MappingProxyType[object, OpRule] = MappingProxyType({
    # fx's pick of one output of a multi-output op, the size of a dim, the export's checks of its inputs
    operator.getitem: OpRule("getitem"),
    aten.sym_size.int: OpRule("sym_size"),
    aten._assert_tensor_metadata.default: OpRule("no_output"),
    # one input, its shape and layout kept: casts and copies, dropout
    aten.contiguous.default: _CAST, aten.clone.default: _CAST, aten.alias.default: _CAST,
    aten.to.dtype: _CAST, aten.to.dtype_layout: _CAST, aten.to.device: _CAST, aten._to_copy.default: _CAST,
    aten.type_as.default: OpRule("same_shape", cast=True, dtype_arg=1),
    aten.detach.default: _SAME, aten.lift_fresh_copy.default: _SAME,
    aten.dropout.default: _DROPOUT, aten.feature_dropout.default: _DROPOUT, aten.alpha_dropout.default: _DROPOUT,
    # ``torch.where(mask, scores, -inf)``: a Python scalar on either side is not tagged pointwise, but torch
    # decomposes each overload into ``where.self`` (pointwise) with the scalar as a 0-d tensor
    **dict.fromkeys((aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar), POINTWISE),
    # a product: a learned operand whole on every rank may enter through f and be read as this rank's slice
    aten.mul.Tensor: OpRule("pointwise", scales=True),
    aten.softmax.int: _SOFTMAX, aten._softmax.default: _SOFTMAX,
    aten.log_softmax.int: _LOG_SOFTMAX, aten._log_softmax.default: _LOG_SOFTMAX,
    # dims regrouped, moved, broadcast or repeated
    aten.view.default: _VIEW, aten.reshape.default: _VIEW, aten._unsafe_view.default: _VIEW,
    aten.flatten.using_ints: OpRule("flatten"),
    aten.expand.default: _EXPAND, aten.broadcast_to.default: _EXPAND,
    aten.expand_as.default: OpRule("expand_as", broadcasts=True),
    aten.repeat.default: OpRule("repeat", broadcasts=True),
    # ``torch.tile(k, (1, 1, n_rep, 1))``: repeat's counts, ones prepended where fewer than the dims
    aten.tile.default: OpRule("repeat", broadcasts=True),
    aten.repeat_interleave.self_int: OpRule("repeat_interleave"),
    aten.transpose.int: _move("pair"), aten.swapaxes.default: _move("pair"), aten.swapdims.default: _move("pair"),
    aten.t.default: _move("t"), aten.numpy_T.default: _move("reverse"),
    aten.mT.default: _move("last_two"), aten.mH.default: _move("last_two"), aten.adjoint.default: _move("last_two"),
    aten.permute.default: _move("perm"), aten.movedim.int: _move("movedim"), aten.movedim.intlist: _move("movedim"),
    aten.unsqueeze.default: _move("insert"), aten.squeeze.dim: _move("drop"), aten.squeeze.dims: _move("drop"),
    aten.squeeze.default: _move("drop_ones"),
    aten.view_as_complex.default: OpRule("complex_view", form="complex"),
    aten.view_as_real.default: OpRule("complex_view", form="real"),
    # parts cut out of one dim, or joined along one
    aten.slice.Tensor: OpRule("slice"), aten.narrow.default: OpRule("narrow"), aten.select.int: OpRule("select"),
    aten.index.Tensor: OpRule("index"),
    aten.split.Tensor: _split("size"), aten.split.sizes: _split("sizes"),
    aten.split_with_sizes.default: _split("sizes"), aten.chunk.default: _split("chunks"),
    aten.unbind.int: _split("unbind"),
    **dict.fromkeys((aten.cat.default, aten.concatenate.default, aten.concat.default), OpRule("cat")),
    aten.stack.default: OpRule("stack"),
    # reductions: over the sharded dim, those with a statistic are completed by one all-reduce
    aten.mean.dim: _reduction("mean"), aten.sum.dim_IntList: _reduction("sum"),
    aten.amax.default: _reduction(None), aten.amin.default: _reduction(None),
    aten.var.correction: _reduction("var", "correction"), aten.var.dim: _reduction("var", "unbiased"),
    aten.std.correction: _reduction("std", "correction"), aten.std.dim: _reduction("std", "unbiased"),
    aten.linalg_vector_norm.default: _reduction("norm", "ord"), aten.norm.ScalarOpt_dim: _reduction("norm", "p"),
    aten.max.dim: OpRule("max_min"), aten.min.dim: OpRule("max_min"),
    aten.rms_norm.default: OpRule("norm", stat="rms_norm", weights=(2,)),
    aten.layer_norm.default: OpRule("norm", stat="layer_norm", weights=(2, 3)),
    # the lower or upper triangle of the last two dims (torch's rule replicates them whatever the sharded dim)
    aten.tril.default: OpRule("triangle"), aten.triu.default: OpRule("triangle"),
    # sliding windows of one dim, ``x.unfold(d, k, step)``: (.., n, ..) -> (.., windows, .., k), other dims kept
    aten.unfold.default: OpRule("unfold"),
    # convolutions over the sequence: depthwise ones (one filter per channel) stay local to sharded channels
    aten.conv1d.default: OpRule("conv"), aten.conv1d.padding: OpRule("conv"),
    # einsum of any number of operands, read per letter (DTensor's einsum strategy places two at most)
    aten.einsum.default: OpRule("einsum"),
    # batched matmuls and attention
    aten.matmul.default: OpRule("matmul"), aten.bmm.default: OpRule("matmul"), aten.baddbmm.default: OpRule("baddbmm"),
    aten.scaled_dot_product_attention.default: OpRule("sdpa", random_p=4),
    # writes into a tensor
    aten.index_put_.default: OpRule("index_put"), aten.index_put.default: OpRule("index_put"),
    aten.index_copy_.default: OpRule("index_copy"), aten.index_copy.default: OpRule("index_copy"),
    aten.copy_.default: OpRule("copy"),
    # new tensors: shaped like an input (its values unread), or from sizes alone
    **dict.fromkeys((aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default),
                    OpRule("new_like")),
    **dict.fromkeys((aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
                     aten.full_like.default), OpRule("like")),
    **dict.fromkeys((aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format),
                    OpRule("factory")),
    # losses over class logits
    aten.cross_entropy_loss.default: OpRule("cross_entropy"),
    aten.nll_loss.default: OpRule("nll_loss"), aten.nll_loss_nd.default: OpRule("nll_loss"),
})

TORCH = OpRule("torch")  # the rule of every other op DTensor can place: asked of torch (analysis.torch_rules)
_PERMUTES = frozenset({"pair", "last_two", "t", "reverse", "perm", "movedim"})


def op_rule(target: object) -> OpRule | None:
    """The rule of an fx node's target: its table entry, else :data:`POINTWISE` for an op tagged pointwise,
    else :data:`TORCH` for an op DTensor has a sharding strategy (or decomposition) for."""
    rule = OP_RULES.get(target)
    if rule is not None or not isinstance(target, torch._ops.OpOverload):
        return rule
    if torch.Tag.pointwise in target.tags:
        return POINTWISE
    return TORCH if has_torch_rule(target) else None


def handler(visitor: object, target: object) -> tuple[object, OpRule] | None:
    """``visitor``'s ``_on_<kind>`` handler for ``target`` and the rule it reads; an op whose kind the visitor
    has no handler for falls back to torch's rule (``_on_torch``) where DTensor has one. None: no rule."""
    rule = op_rule(target)
    on = getattr(visitor, f"_on_{rule.kind}", None) if rule is not None else None
    if on is None and rule is not None and rule is not TORCH and has_torch_rule(target):
        on, rule = getattr(visitor, "_on_torch", None), TORCH
    return None if on is None else (on, rule)


def kind_of(target: object) -> str | None:
    """The kind of ``target``'s rule; None for an op with no rule (a placeholder's or output's target too)."""
    rule = op_rule(target)
    return None if rule is None else rule.kind


def permutes(target: object) -> bool:
    """Does ``target`` only reorder its input's dims (a transpose, permute or movedim of any spelling)?"""
    rule = op_rule(target)
    return rule is not None and rule.kind == "move" and rule.form in _PERMUTES


def inserts_dim(target: object) -> bool:
    """Does ``target`` only insert one size-1 dim (``unsqueeze``, ``x[:, None]``)?"""
    rule = op_rule(target)
    return rule is not None and rule.kind == "move" and rule.form == "insert"


def drops_dim(target: object) -> bool:
    """Does ``target`` only drop size-1 dims (``squeeze``)?"""
    rule = op_rule(target)
    return rule is not None and rule.kind == "move" and rule.form in ("drop", "drop_ones")


def is_cast(target: object) -> bool:
    """Does ``target`` keep its input's values (up to rounding) and shape (``W.to(dtype)``, ``W.contiguous()``)?"""
    rule = op_rule(target)
    return rule is not None and rule.cast


def ops_of(*kinds: str) -> frozenset:
    """The table's ops of these kinds."""
    return frozenset(op for op, rule in OP_RULES.items() if rule.kind in kinds)
