"""Python checks on the real value of the model's own state, resolved at capture and guarded at call time.

A forward may branch on a buffer's or a plain tensor attribute's value: a lazy re-initialisation
(``if self.freqs_cos[0, 0] == 0: self._init_rope()``), a flag kept as a tensor (``if not
bool(self.initialized)``), ``if self.step_buf.sum() > 0``, a scale read with ``.item()``. Export runs the
forward on fake tensors, so such a check is a data-dependent guard it cannot decide. The value is known,
though: it is on the model at capture time, and the branch it picks is the one the forward takes as long
as that state holds it.

:class:`ValueWatch` is a ``TorchFunctionMode`` entered around the exported forward. It follows every torch
function whose tensor arguments are all the model's state (buffers and plain tensor attributes, by the
objects the forward reads) or values computed from them alone (sizes and Python constants, never a
traced size), as an expression (:class:`Expr`). When Python asks for such a value (``__bool__``,
``item``, ``tolist``, ``int``, ``float``, ``torch.equal``) the expression is evaluated on the real tensors
the model held before the export (a handful of small ops, outside the trace), the answer is given to the
forward, and the pair is kept as a :class:`Check`. The graph is captured for that answer; at call time
:func:`checks_hold` evaluates each expression again on the model as it is then, and a call whose state
answers differently is captured again (as a call on other written state is,
:mod:`autotp.parallel.writeback`).

Not resolved (export's own data-dependent error stands): a value read from a parameter (this rank holds a
shard of it at call time), from the inputs, from a traced size, from state the forward changed in place
before the check, or from a model built on meta (there is no value).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["CHECKS_KEY", "Check", "Expr", "ValueWatch", "checks_hold", "real_state"]

CHECKS_KEY = "autotp_value_checks"  # the exported GraphModule's ``meta`` entry: its tuple of :class:`Check`

# Python asks for a tensor's value here: the answer picks a branch or becomes a constant of the graph
_QUERIES = frozenset({torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__,
                      torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.__complex__,
                      torch.equal, torch.Tensor.equal, torch.allclose, torch.Tensor.allclose,
                      torch.is_nonzero})
_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclass(frozen=True)
class Expr:
    """A value computed from the model's state alone: ``func`` is None for the state itself (``args``:
    module path and attribute name), else the torch function applied to ``args``/``kwargs`` (whose
    :class:`Expr` leaves are evaluated first); ``pick`` takes one tensor out of a tuple result."""

    func: object = None
    args: tuple = ()
    kwargs: tuple = ()  # (name, value) pairs
    pick: int | None = None

    def sources(self) -> Iterable[tuple[str, str]]:
        if self.func is None:
            yield self.args
            return
        for leaf in pytree.tree_leaves((self.args, dict(self.kwargs))):
            if isinstance(leaf, Expr):
                yield from leaf.sources()

    def evaluate(self, state: dict[tuple[str, str], torch.Tensor]) -> object:
        if self.func is None:
            return state[self.args]
        args, kwargs = pytree.tree_map(lambda x: x.evaluate(state) if isinstance(x, Expr) else x,
                                       (self.args, dict(self.kwargs)))
        out = self.func(*args, **kwargs)
        return out[self.pick] if self.pick is not None else out

    def describe(self) -> str:
        if self.func is None:
            return ".".join(p for p in self.args if p)
        name = getattr(self.func, "__name__", str(self.func))
        inner = ", ".join(a.describe() if isinstance(a, Expr) else repr(a) for a in self.args)
        return f"{name}({inner})" + (f"[{self.pick}]" if self.pick is not None else "")


@dataclass(frozen=True)
class Check:
    """A value the forward asked for, and the answer the graph was captured with."""

    expr: Expr
    value: object

    def holds(self, state: dict[tuple[str, str], torch.Tensor]) -> bool:
        try:
            got = _answer(self.expr, state)
        except (KeyError, RuntimeError, IndexError, ValueError, TypeError):  # the state is gone or reshaped
            return False
        return _same(got, self.value)


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _answer(query: Expr, state: dict[tuple[str, str], torch.Tensor]) -> object:
    """``query`` (a :data:`_QUERIES` call) evaluated on real tensors, outside any trace and without autograd."""
    with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
        return query.evaluate(state)


def _state_objects(model: nn.Module) -> dict[int, tuple[str, str]]:
    """Every buffer and plain tensor attribute of the model (the objects a forward reads now) by (path, name)."""
    found: dict[int, tuple[str, str]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        for name, t in [*m._buffers.items(), *((k, v) for k, v in m.__dict__.items() if isinstance(v, torch.Tensor))]:
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
                found.setdefault(id(t), (path, name))
    return found


def real_state(model: nn.Module, skip: Iterable[str] = ()) -> dict[tuple[str, str], torch.Tensor]:
    """The model's buffers and plain tensor attributes that hold values (not meta, not a stand-in named in
    ``skip``): what a :class:`Check` is evaluated on."""
    skip = set(skip)
    out: dict[tuple[str, str], torch.Tensor] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        for name, t in [*m._buffers.items(), *((k, v) for k, v in m.__dict__.items() if isinstance(v, torch.Tensor))]:
            full = f"{path}.{name}" if path else name
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and not t.is_meta and full not in skip:
                out.setdefault((path, name), t)
    return out


def checks_hold(model: nn.Module, checks: tuple[Check, ...], sharded: Iterable[str] = ()) -> bool:
    """Whether the model's state answers every check as it did when the graph was captured. ``sharded``: names
    of buffers this rank holds a slice of: a check reading one does not hold (its capture then leaves it to
    export, which refuses it)."""
    if not checks:
        return True
    state = real_state(model, sharded)
    return all(c.holds(state) for c in checks)


def _constant(x: object) -> bool:
    """A Python argument that is the same at every call: no traced size, float or bool (a slice's too)."""
    if isinstance(x, _SYM):
        return False
    if isinstance(x, slice):
        return all(_constant(v) for v in (x.start, x.stop, x.step))
    return not isinstance(x, torch.Tensor)


def _mutates(func: object, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    return "out" in kwargs or name == "__setitem__" or (name.endswith("_") and not name.endswith("__")) or \
        (name.startswith("__i") and name.endswith("__") and name not in ("__int__", "__index__", "__invert__"))


class ValueWatch(TorchFunctionMode):
    """Entered around the exported forward of ``model`` (whose state export has swapped for fake tensors);
    ``real``: the same state's real tensors by (path, name), from :func:`real_state` before the export."""

    def __init__(self, model: nn.Module, real: dict[tuple[str, str], torch.Tensor]) -> None:
        super().__init__()
        self.real = real
        # the state's objects are the model's while the forward runs: their ids stay theirs
        self.exprs: dict[int, Expr] = {i: Expr(None, at) for i, at in _state_objects(model).items() if at in real}
        self.alive: list[object] = []  # the traced tensors ``exprs`` is keyed by: no id is reused meanwhile
        self.dirty: set[tuple[str, str]] = set()  # state the forward changed in place: its value is not the model's
        self.checks: list[Check] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        known = [self.exprs.get(id(x)) if isinstance(x, torch.Tensor) else None for x in leaves]
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        pure = all(e is not None for x, e in zip(leaves, known) if isinstance(x, torch.Tensor)) and \
            all(_constant(x) for x in leaves if not isinstance(x, torch.Tensor))
        if _mutates(func, kwargs):
            for x in tensors:  # its value now differs from the model's at the call's start
                if (e := self.exprs.get(id(x))) is not None:
                    self.dirty.update(e.sources())
        if func in _QUERIES and tensors and pure:
            expr = self._expr(func, args, kwargs)
            if not any(s in self.dirty for s in expr.sources()):
                value = _answer(expr, self.real)
                self.checks.append(Check(expr, value))
                return value
        out = func(*args, **kwargs)
        if pure and not _mutates(func, kwargs) and func not in _QUERIES:
            expr = self._expr(func, args, kwargs)
            if isinstance(out, torch.Tensor):
                self._keep(out, expr)
            elif isinstance(out, (tuple, list)):
                for i, t in enumerate(out):
                    if isinstance(t, torch.Tensor):
                        self._keep(t, Expr(expr.func, expr.args, expr.kwargs, i))
        return out

    def _expr(self, func: object, args: tuple, kwargs: dict) -> Expr:
        swap = (lambda x: self.exprs[id(x)] if isinstance(x, torch.Tensor) else x)
        a, k = pytree.tree_map(swap, (tuple(args), dict(kwargs)))
        return Expr(func, a, tuple(k.items()))

    def _keep(self, t: torch.Tensor, expr: Expr) -> None:
        self.alive.append(t)
        self.exprs[id(t)] = expr

