"""torch's own sharding rules behind autotp's table: what DTensor says an op does with a sharded tensor.

For an op that :mod:`~autotp.analysis.op_rules` does not list (kind ``"torch"``), :func:`ask_torch` poses
DTensor's sharding propagator the question autotp's visitors ask of their own rules: with these operands
sharded on these dims (one mesh dim of ``tp`` ranks, every other operand replicated), where is the output
sharded, and does any operand have to change first? It runs on a :class:`DeviceMesh` built without a
process group, so analysis stays free of torch.distributed state.

An answer is used only where it keeps the op local and exact:

- every sharded operand stays as it is (no all-gather, no all-to-all);
- a replicated operand may be asked for a shard of itself: a local slice, as autotp's own rules do;
- each output is sharded, on a dim of the same size as the input's;
- no partial result (an all-reduce autotp would have to add), no random or mutating op, no op whose
  arguments carry the global shape (their local values would have to be rewritten).

Anything else raises :class:`TorchRefused` with a reason that names the op; the caller keeps the value whole.
The graph that runs keeps the op itself: the answer only says that running it on each rank's shard gives that
rank's shard of the result (and so, in the backward, that rank's shard of the gradient).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from autotp.errors import own_bug


class TorchRefused(Exception):
    """torch's rule for an op does not keep it local on a shard; the message says why."""


@dataclass(frozen=True)
class TorchAnswer:
    """Where DTensor places an op's results given its operands' shards.

    ``outputs``: the sharded dim of each output, in order (None: not a tensor);
    ``slices``: replicated operands that the op reads as a shard of themselves, with the dim cut.
    """

    outputs: tuple[int | None, ...]
    slices: tuple[tuple[fx.Node, int], ...]


def _propagator():
    from torch.distributed.tensor import DTensor
    return DTensor._op_dispatcher.sharding_propagator


def has_torch_rule(op: object) -> bool:
    """Does DTensor have a sharding strategy for ``op``, or derive one from its decomposition?"""
    if not isinstance(op, torch._ops.OpOverload) or not torch.distributed.is_available():
        return False
    sp = _propagator()
    if op in sp.op_strategy_funcs or op in sp.op_single_dim_strategy_funcs or op in sp.op_to_rules:
        return True
    from torch._decomp import decomposition_table
    return op in decomposition_table or op._can_decompose()


def torch_rule_source(op: object) -> str | None:
    """"strategy" where DTensor registers one for ``op``, "decomposition" where it derives one, else None."""
    if not has_torch_rule(op):
        return None
    sp = _propagator()
    registered = op in sp.op_strategy_funcs or op in sp.op_single_dim_strategy_funcs or op in sp.op_to_rules
    return "strategy" if registered else "decomposition"


def _mesh(tp: int):
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh("cpu", list(range(tp)), _init_backend=False, _rank=0)


def _hint(s: int | torch.SymInt) -> int | None:
    """A size as the example inputs gave it (symbolic sizes by their hint; None where there is none)."""
    return s if isinstance(s, int) else s.node.hint


def _size(s: int | torch.SymInt) -> int:
    """A size as the example inputs gave it, or, for one known only at run time, its stand-in
    (:func:`_stand_in`)."""
    hint = _hint(s)
    return hint if hint is not None else _stand_in(s)


def _stand_in(s: torch.SymInt) -> int:
    """A size known only at run time (a count of tokens per expert read by ``.tolist()``, and the sizes made of
    such counts) for the question put to torch and its check: each count is the share it would have were the
    tokens spread evenly over the counts the graph asserts to add up to a size it knows (JetMoE's
    ``u0 + u1 + u2 + u3 == 2·b·s``, the pieces of a split by expert counts joined again), else 2. The same
    count gets the same value wherever it is read, so operands of one op agree on their shapes. Asked only of
    dims no operand is cut on (:func:`_shape`): what torch's rule says of the cut dim does not depend on it."""
    env = s.node.shape_env
    known = {sym: int(v) for sym, v in env.backed_var_to_val.items()}
    values: dict[sympy.Symbol, int] = {}
    for asserts in env.deferred_runtime_asserts.values():
        for ra in asserts:
            e = ra.expr
            if not isinstance(e, sympy.Eq):
                continue
            for lhs, rhs in ((e.lhs, e.rhs), (e.rhs, e.lhs)):
                free = lhs.free_symbols
                total = rhs.xreplace(known)
                if not free or free & known.keys() or lhs != sympy.Add(*free) or not total.is_Integer:
                    continue
                n, k = int(total), len(free)
                for i, sym in enumerate(sorted(free, key=str)):  # the remainder to the first counts
                    values.setdefault(sym, n // k + (i < n % k))
    expr = s.node.expr
    value = expr.xreplace(known | values | {sym: 2 for sym in expr.free_symbols - known.keys() - values.keys()})
    return int(value)


def _shape(x: fx.Node, cut: int | None = None) -> list[int]:
    """``x``'s sizes as the example gave them; a size known only at run time is refused on the dim ``x`` is cut
    on (``cut``), and elsewhere is its stand-in: a dim no operand is cut on may vary at run time."""
    sizes = x.meta["val"].shape
    if cut is not None and _hint(sizes[cut]) is None:
        raise TorchRefused(f"{x.name} has a size known only at run time on its sharded dim {cut}")
    return [_size(s) for s in sizes]


def _keyed_in_full(schema) -> bool:
    """Does torch's sharding cache key ``schema`` by every argument? Its key holds the tensor specs and, from
    the op's registered ``static_argnum`` (and ``static_kwargkey``) on, the other arguments: an op without
    them (or a size before that index) would share one answer between calls that differ in a dim or a size,
    so those are asked afresh each time. Cached, the many equal questions of a model's repeated layers are
    answered once (a quarter of planning a 70B layout's CPU time)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    info = schema.schema_info
    if info is None or not all(isinstance(a, DTensorSpec) for a in schema.args_schema[:info.static_argnum]):
        return False
    if not set(schema.kwargs_schema) <= set(info.static_kwargkey or ()):
        return False
    try:
        hash(schema)
    except TypeError:  # an argument the key cannot hold
        return False
    return True


def ask_torch(node: fx.Node, sharded: dict[fx.Node, int], tp: int, op: object = None) -> TorchAnswer:
    """DTensor's placement of ``node``'s outputs with its operands in ``sharded`` cut on the given dims over
    ``tp`` ranks; raises :class:`TorchRefused` where running the op on each shard would not be exact. ``op``:
    the op asked about in place of ``node``'s own (the functional form of an in-place write no one sees)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    op = node.target if op is None else op
    name = str(op)  # the caller adds where the node is
    if not has_torch_rule(op):
        raise TorchRefused(f"no sharding rule for {op}, in autotp's table or torch's")
    if torch.Tag.nondeterministic_seeded in op.tags:
        raise TorchRefused(f"{name} draws random numbers")
    if op._schema.is_mutable:
        raise TorchRefused(f"{name} writes into its input")
    sp = _propagator()
    if op in sp.op_to_shape_and_stride_idx:
        raise TorchRefused(f"{name} takes the global shape as an argument")
    mesh = _mesh(tp)
    # the example's sizes: symbolic ones by their hint (torch's rules place shapes, fake tensors of them are made)
    sizes = {_shape(x, d)[d] for x, d in sharded.items()}
    if len(sizes) != 1:
        raise TorchRefused(f"{name} reads operands sharded on dims of different sizes")
    (full,) = sizes
    operands: list[fx.Node] = []

    def to_spec(a: object) -> object:
        if not isinstance(a, fx.Node):
            return a
        val = a.meta.get("val")
        if isinstance(val, torch.SymInt | int):
            return _size(val)
        if not isinstance(val, torch.Tensor):
            raise TorchRefused(f"{name} reads {a.name}, which is neither a tensor nor a size")
        operands.append(a)
        shape = _shape(a)
        d = sharded.get(a)
        return DTensorSpec(mesh, (Shard(d) if d is not None else Replicate(),),
                           TensorMeta(torch.Size(shape), _contiguous(shape), val.dtype))

    args, kwargs = _dims_normalized(node)
    args, kwargs = tree_map(to_spec, args), tree_map(to_spec, kwargs)
    if any(isinstance(v, DTensorSpec) for v in tree_flatten(kwargs)[0]):
        raise TorchRefused(f"{name} takes a tensor as a keyword argument")
    schema = OpSchema(op, args, kwargs, schema_info=sp.op_to_schema_info.get(op))
    try:
        out = (sp.propagate_op_sharding if _keyed_in_full(schema) else sp.propagate_op_sharding_non_cached)(schema)
    except NotImplementedError:
        raise TorchRefused(f"torch has no sharding strategy for {name}") from None
    except Exception as e:  # a strategy that cannot place these shapes
        if own_bug(e):  # autotp's own bug: shown, never a verdict
            raise
        raise TorchRefused(f"torch's sharding rule for {name} failed: {type(e).__name__}: {e}") from None

    slices = []
    if out.needs_redistribute:
        wanted = [s.placements[0] for s in tree_flatten(out.redistribute_schema.args_schema)[0]
                  if isinstance(s, DTensorSpec)]
        if len(wanted) != len(operands):
            raise TorchRefused(f"torch's answer for {name} does not match its operands")
        for x, p in zip(operands, wanted):
            d = sharded.get(x)
            if d is not None and p != Shard(d):
                raise TorchRefused(f"{name} needs {x.name} {_said(p)}, not sharded on dim {d}: torch's rule would "
                                   "move data between ranks")
            if d is None and isinstance(p, Shard):
                slices.append((x, p.dim))
            elif d is None and not isinstance(p, Replicate):
                raise TorchRefused(f"{name} needs the replicated {x.name} {_said(p)}")
    vals = node.meta.get("val")
    vals = list(vals) if isinstance(vals, (list, tuple)) else [vals]
    specs = out.output_spec if isinstance(out.output_spec, (list, tuple)) else [out.output_spec]
    dims = []
    for spec, val in zip(specs, vals):
        if not isinstance(val, torch.Tensor):
            dims.append(None)
            continue
        p = None if spec is None else spec.placements[0]
        if isinstance(p, Partial):
            raise TorchRefused(f"{name} over the sharded dim gives a partial result: it would need an all-reduce")
        if not isinstance(p, Shard):
            raise TorchRefused(f"{name} gives a whole result from a shard")
        if _size(val.shape[p.dim]) != full:
            raise TorchRefused(f"{name} changes the size of the sharded dim")
        dims.append(p.dim)
    answer = TorchAnswer(tuple(dims), tuple(slices))
    _check(node, op, sharded, answer, tp)
    return answer


def _dims_normalized(node: fx.Node) -> tuple[tuple, dict]:
    """``node``'s arguments with the dims it names (``dim``/``dims`` of its schema) made non-negative:
    the question put to torch must not depend on how the model spelled a dim (``cumsum(x, -1)``)."""
    args, kwargs = list(node.args), dict(node.kwargs)
    first = next((a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)), None)
    if first is None:
        return tuple(args), kwargs
    nd = first.meta["val"].dim()

    def norm(v: object) -> object:
        if isinstance(v, int) and not isinstance(v, bool):
            return v % nd if nd and v < 0 else v
        return type(v)(norm(x) for x in v) if isinstance(v, (list, tuple)) else v

    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name not in ("dim", "dims"):
            continue
        if i < len(args) and not arg.kwarg_only:
            args[i] = norm(args[i])
        elif arg.name in kwargs:
            kwargs[arg.name] = norm(kwargs[arg.name])
    return tuple(args), kwargs


_CHECK_ELEMENTS = 1 << 20  # operands checked by running the op on them up to this size; larger are trusted


def _check(node: fx.Node, op: object, sharded: dict[fx.Node, int], answer: TorchAnswer, tp: int) -> None:
    """Run the op on small random operands of the captured (example) sizes, whole and cut into ``tp`` parts as
    the answer says, and compare each part's result with the whole's: torch's rules are checked, not trusted
    (a rule that misreads an argument would otherwise make the sharded model silently wrong). Operands too
    large to check are left to the rule."""
    cut = dict(sharded) | dict(answer.slices)
    operands, shapes = [], {}
    for x in node.all_input_nodes:
        val = x.meta.get("val")
        if isinstance(val, torch.Tensor):
            shapes[x] = _shape(x)
            operands.append(x)
    if sum(math.prod(s) for s in shapes.values()) > _CHECK_ELEMENTS:
        return
    if any(shapes[x][d] < tp for x, d in cut.items()):
        return
    name = str(op)
    try:
        # in float64 first: the check asks which values a part depends on, and a matmul cut in parts may round
        # differently from the whole (another kernel for fewer rows; bf16 operands of a graph captured under
        # autocast, with fp32 weights that only autocast would cast); an op float64 cannot run, as captured
        try:
            full, again, parts = _run_parts(node, op, operands, shapes, cut, tp, wide=True)
        except Exception as exc:  # noqa: BLE001 - the op has no float64 kernel (or mixed dtypes need it as captured)
            if own_bug(exc):  # autotp's own bug: shown, never a verdict
                raise
            full, again, parts = _run_parts(node, op, operands, shapes, cut, tp, wide=False)
    except Exception as e:
        if own_bug(e):  # autotp's own bug: shown, never a verdict
            raise
        raise TorchRefused(f"{name} could not be checked on a shard: {type(e).__name__}: {e}") from None

    def listed(v: object) -> list:
        return list(v) if isinstance(v, (list, tuple)) else [v]

    # an output whose values are not a function of the operands (``empty_like``) is checked for its shape only
    defined = [not isinstance(f, torch.Tensor) or torch.equal(f, g) or bool(torch.isnan(f).any())
               for f, g in zip(listed(full), listed(again))]
    for r, part in enumerate(parts):
        for d, f, p, values in zip(answer.outputs, listed(full), listed(part), defined):
            if d is None:
                continue
            want = f.tensor_split(tp, d)[r]
            if want.shape != p.shape or values and not torch.allclose(p.double() if p.is_floating_point() else p,
                                                            want.double() if want.is_floating_point() else want,
                                                            rtol=1e-5, atol=1e-6, equal_nan=True):
                raise TorchRefused(f"{name}: torch's rule says each rank's part is computed from its shard alone, "
                                   "but a check on random values disagrees")


def _run_parts(node: fx.Node, op: object, operands: list[fx.Node], shapes: dict, cut: dict, tp: int,
               wide: bool) -> tuple[object, object, list]:
    """The op run twice on random operands of ``shapes`` (float64 where ``wide``, else as captured: 16-bit
    floats in fp32) and once per part cut as ``cut`` says: (whole, whole again, parts)."""
    gen = torch.Generator().manual_seed(0)
    whole = {}
    for x in operands:
        val = x.meta["val"]
        if val.dtype.is_floating_point or val.dtype.is_complex:
            dtype = (torch.complex128 if val.dtype.is_complex else torch.float64) if wide else \
                torch.float32 if val.dtype.is_floating_point and val.dtype.itemsize < 4 else val.dtype
            whole[x] = torch.randn(shapes[x], generator=gen, dtype=dtype)
        elif val.dtype == torch.bool:
            whole[x] = torch.rand(shapes[x], generator=gen) < 0.5
        else:  # index-like: small values stay valid indices along any dim of size 2 or more
            whole[x] = torch.randint(0, 2, shapes[x], generator=gen, dtype=val.dtype)

    def run(values: dict) -> object:
        def sub(a: object) -> object:
            if not isinstance(a, fx.Node):
                return a
            if a in values:
                return values[a]
            return _size(a.meta.get("val"))
        return op(*tree_map(sub, node.args), **tree_map(sub, dict(node.kwargs)))

    parts = [run({x: (t.tensor_split(tp, cut[x])[r] if x in cut else t) for x, t in whole.items()})
             for r in range(tp)]
    return run(whole), run(whole), parts


def _said(p: object) -> str:
    from torch.distributed.tensor.placement_types import Replicate, Shard
    return "whole" if isinstance(p, Replicate) else f"sharded on dim {p.dim}" if isinstance(p, Shard) else f"as {p}"


def _contiguous(shape: list[int]) -> tuple[int, ...]:
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= max(size, 1)
    return tuple(reversed(strides))
