"""The state a forward writes on its model, written by every call of the parallel model as on one device.

Capture finds what the forward writes (:mod:`autotp.capture.writes`): each captured graph returns the
written tensors after the forward's own outputs, and :func:`write_back` assigns them (and replays the
Python values) after the call. A forward's Python code reads that state too (``if self.cache is None``),
and a graph is the forward as it ran on the state it was captured with; so each graph keeps the state of
everything any graph writes, as it was when captured (:func:`fingerprint`: None, a tensor's shape and
dtype, a Python value), and a call whose model holds other state is captured again (:func:`state_matches`).
A cache filled once costs one more capture, then none: the graph captured with the cache full reads it
and writes nothing.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Hashable, Iterable, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from autotp.capture.structure import Spec
from autotp.capture.writes import Write, Writes

__all__ = ["Where", "fingerprint", "state_difference", "state_matches", "write_back", "written_at"]

Where = tuple[str, str, str, Hashable]  # (module path, attribute, kind, dict key): one piece of written state
_MISSING = object()


def written_at(w: Write) -> Where:
    return (w.path, w.name, "item" if w.kind == "item" else "attr", w.key if w.kind == "item" else None)


def _read(model: nn.Module, at: Where) -> object:
    path, name, kind, key = at
    try:
        m = model.get_submodule(path) if path else model
    except AttributeError:
        return _MISSING
    value = getattr(m, name, _MISSING)
    if kind == "item":
        return value.get(key, _MISSING) if isinstance(value, dict) else _MISSING
    return value


def _fp(v: object, depth: int = 0) -> Hashable:
    if v is None or v is _MISSING:
        return "none" if v is None else "missing"
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype)
    if isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(v).__name__, v)
    if isinstance(v, (tuple, list)) and depth < 4:
        return (type(v).__name__, tuple(_fp(x, depth + 1) for x in v))
    return ("object", type(v).__qualname__)


def fingerprint(model: nn.Module, state: Iterable[Where]) -> tuple:
    """The model's written state as the forward's Python code can tell it apart: per piece, None or absent,
    a tensor's shape and dtype, a Python value, a container's items so."""
    return tuple((at, _fp(_read(model, at))) for at in state)


def state_matches(model: nn.Module, captured: tuple) -> bool:
    """Whether the model holds the written state a graph was captured with (``captured``: its fingerprint)."""
    return all(_fp(_read(model, at)) == fp for at, fp in captured)


def write_back(model: nn.Module, writes: Writes, flat: Sequence[torch.Tensor], graphs: Iterable[nn.Module],
               warned: set) -> None:
    """Write what the call wrote: ``flat``, the graph's flat outputs; ``graphs``, the modules of every
    captured graph (a rebound buffer is rebound there too, where the graph reads it)."""
    for named in writes.named:
        if ("writes", named) not in warned:
            warned.add(("writes", named))
            warnings.warn(f"autotp: the forward writes {named}; the parallel model does not write it",
                          stacklevel=4)
    for w in writes.items:
        m = model.get_submodule(w.path) if w.path else model
        if w.kind == "delete":
            if hasattr(m, w.name):
                delattr(m, w.name)
            continue
        value = _value(w.value, flat, model)
        if w.kind == "item":
            getattr(m, w.name)[w.key] = value
        elif w.kind == "buffer":
            _rebind(model, m, w, value, graphs)
        else:
            old = getattr(m, w.name, None)
            setattr(m, w.name, value)
            if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor):
                _rebind_constant(old, value, graphs)


def _rebind(model: nn.Module, m: nn.Module, w: Write, value: object, graphs: Iterable[nn.Module]) -> None:
    """``m``'s buffer ``w.name`` is ``value`` now, in every module of the model and of the graphs that held
    the old one (one device rebinds the name: the old tensor, which a backward may need, is not written)."""
    old = m._buffers.get(w.name)
    if w.name not in m._buffers:
        m.register_buffer(w.name, value, persistent=w.persistent)
    m._buffers[w.name] = value
    if old is None:
        return
    for holder in (*model.modules(), *(g for graph in graphs for g in graph.modules())):
        for name, b in holder._buffers.items():
            if b is old:
                holder._buffers[name] = value


def _rebind_constant(old: torch.Tensor, value: torch.Tensor, graphs: Iterable[nn.Module]) -> None:
    """A plain tensor attribute the forward re-assigns (``self.step = self.step + 1``) is a constant of the
    graphs that read it (export lifts it as the tensor it was): each graph holding that tensor holds the new
    one now, so the next call reads what one device's next call would."""
    for holder in (g for graph in graphs for g in graph.modules()):
        for name, v in list(vars(holder).items()):
            if v is old:
                setattr(holder, name, value)
        for name, b in holder._buffers.items():
            if b is old:
                holder._buffers[name] = value


def _value(spec: Spec, flat: Sequence[torch.Tensor], model: nn.Module) -> object:
    if spec.kind == "tensor":
        return flat[spec.value]
    if spec.kind == "size":
        return int(flat[spec.value].shape[0])
    if spec.kind == "ref":
        owner, _, leaf = spec.value.rpartition(".")
        return getattr(model.get_submodule(owner) if owner else model, leaf)
    if spec.kind == "const":
        return spec.value
    children = [_value(c, flat, model) for c in spec.children]
    if spec.kind == "tree":
        return pytree.tree_unflatten(children, spec.value)
    obj = spec.value.__new__(spec.value)
    obj.__dict__.update(zip(spec.keys, children))
    return obj


def state_difference(model: nn.Module, reference: nn.Module, state: Iterable[Where]) -> tuple[float, str]:
    """The largest difference between what the forward wrote on ``model`` (parallelized) and on ``reference``
    (the same forward on one device), over ``state`` (the pieces the graphs write), and where it is: tensors
    by value (gathered), Python values by equality (inf where they differ)."""
    worst, name = 0.0, ""
    for at in state:
        d = _difference(_read(model, at), _read(reference, at))
        if d > worst:
            path, attr, kind, key = at
            worst, name = d, (f"{path}." if path else "") + attr + (f"[{key!r}]" if kind == "item" else "")
    return worst, name


def _difference(a: object, b: object, depth: int = 0) -> float:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        a, b = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (a, b))
        if a.shape != b.shape or a.dtype != b.dtype:
            return math.inf
        if not a.numel():
            return 0.0
        if a.is_floating_point() or a.is_complex():
            return (a.detach().to(torch.complex128 if a.is_complex() else torch.float64) -
                    b.detach().to(a.device)).abs().max().item()
        return 0.0 if torch.equal(a.detach(), b.detach().to(a.device)) else math.inf
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and depth < 4:
        if len(a) != len(b):
            return math.inf
        return max((_difference(x, y, depth + 1) for x, y in zip(a, b)), default=0.0)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return math.inf
    try:
        return 0.0 if a == b or type(a) is type(b) and not isinstance(a, (int, float, str, bool)) else math.inf
    except (TypeError, RuntimeError):  # objects without an equality of their own: compared by type
        return 0.0 if type(a) is type(b) else math.inf
