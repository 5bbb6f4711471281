"""The structure of a call's inputs and outputs: flat tensors plus a :class:`Spec` to rebuild the rest.

The graph autotp exports takes and returns flat tuples of tensors, so any Python object a forward takes or
returns (a model-output dataclass, a cache object holding tensors, a config flag) is captured without
registering its type anywhere: torch pytree nodes (tuples, lists, dicts, namedtuples, registered output
classes) are walked as pytree does; other plain objects are walked through their ``__dict__`` and rebuilt
as a fresh instance of the same class (so capture never changes the caller's object); functions, modules,
classes and atoms (numbers, strings, dtypes, devices) are constants.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree


@dataclass(frozen=True)
class Spec:
    """``kind``: "tensor" (``value`` = flat index), "const" (``value``), "tree" (a torch pytree node:
    ``value`` = its TreeSpec over ``children``) or "object" (``value`` = the class, ``keys`` its attributes)."""

    kind: str
    value: object = None
    keys: tuple[str, ...] = ()
    children: tuple[Spec, ...] = ()


_ATOMS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size,
          torch.memory_format, torch.layout)


def _is_record(x: object) -> bool:
    """A plain Python object (a cache, a small dataclass): walked through its ``__dict__`` and rebuilt fresh,
    so that nothing a forward does to it during capture reaches the caller's object."""
    if isinstance(x, (_ATOMS, type, torch.nn.Module)) or callable(x) or not isinstance(getattr(x, "__dict__", None), dict):
        return False
    slots = (getattr(k, "__slots__", ()) for k in type(x).__mro__)
    return not any(n not in ("__dict__", "__weakref__") for names in slots
                   for n in ([names] if isinstance(names, str) else names))  # state in slots would be lost


def flatten(obj: object) -> tuple[list[torch.Tensor], Spec]:
    tensors: list[torch.Tensor] = []
    # a record reached again (a cache's layers sharing one config) is walked once: each path to it reads the
    # same spec and tensors, so the walk is linear in the objects, not in the paths (exponential in depth)
    records: dict[int, Spec | None] = {}

    def walk(x: object, depth: int) -> Spec:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return Spec("tensor", len(tensors) - 1)
        if depth > 16:
            return Spec("const", x)
        if not pytree.tree_is_leaf(x):  # tuples, lists, dicts, namedtuples, registered output classes
            leaves, spec = pytree.tree_flatten(x)
            return Spec("tree", spec, children=tuple(walk(c, depth + 1) for c in leaves))
        if _is_record(x):
            if id(x) in records:  # done: its spec; still being walked (a cycle): the object itself
                return records[id(x)] or Spec("const", x)
            records[id(x)] = None
            keys = tuple(vars(x))
            records[id(x)] = done = Spec("object", type(x), keys, tuple(walk(vars(x)[k], depth + 1) for k in keys))
            return done
        return Spec("const", x)

    return tensors, walk(obj, 0)


def unflatten(tensors: tuple | list, spec: Spec) -> object:
    if spec.kind == "tensor":
        return tensors[spec.value]
    if spec.kind == "const":
        return spec.value
    children = [unflatten(tensors, c) for c in spec.children]
    if spec.kind == "tree":
        return pytree.tree_unflatten(children, spec.value)
    obj = spec.value.__new__(spec.value)
    obj.__dict__.update(zip(spec.keys, children))
    return obj


def _const_key(x: object) -> Hashable:
    return ("V", x) if isinstance(x, _ATOMS) else ("V", type(x).__qualname__, id(x))


def _spec_key(spec: Spec) -> Hashable:
    if spec.kind == "tensor":
        return ("T", spec.value)
    if spec.kind == "const":
        return _const_key(spec.value)
    head = str(spec.value) if spec.kind == "tree" else spec.value.__qualname__
    return (spec.kind, head, spec.keys, tuple(_spec_key(c) for c in spec.children))


def _autocast_key(tensors: list[torch.Tensor]) -> Hashable:
    """The autocast dtype in force for each device the inputs are on (None where autocast is off): a call
    under ``torch.autocast`` is captured under it, so the graph's recorded dtypes (what its collectives
    carry) are the ones that run."""
    devices = sorted({t.device.type for t in tensors} | {"cpu"})
    return tuple((d, torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None) for d in devices)


def call_key(args: tuple, kwargs: dict, training: bool) -> Hashable:
    """Cache key of a call: its structure, constants, and per tensor the dtype, rank and which dims are 0
    or 1 (export specializes those sizes); other sizes are dynamic in the captured graph; and the autocast
    state."""
    tensors, spec = flatten((args, kwargs))
    metas = tuple((t.dtype, t.dim(), tuple(d <= 1 for d in t.shape)) for t in tensors)
    return (_spec_key(spec), metas, training, _autocast_key(tensors))
