"""The model's cached helpers, run uncached while capturing, and its memo dicts put back as they were.

Model files build masks and position tables through cached helpers keyed by shape values::

    @functools.lru_cache(maxsize=4)
    def decay_mask(seq_len, device, dtype): ...        # or functools.cache, or a staticmethod of one

    _MASKS = {}
    def mask(seq_len, device, dtype):                    # a dict memo
        if (seq_len, device, dtype) not in _MASKS: ...

Capture runs the forward on meta or fake tensors with symbolic sizes, which breaks both: a symbolic size
cannot be hashed (``unhashable type: non-nested SymInt``), and a static one makes the cache keep the trace's
meta or fake tensor, which the model's next eager call would get back. :func:`helpers_uncached` therefore,
for the duration of a capture, puts each ``functools`` cache wrapper that the model's code reaches by name (a
global of a module defining one of the model's classes, or an attribute of such a class) back to the
function it wraps, and snapshots the dicts held there (the memos), restoring each one's items exactly on
exit. A memo keyed by a size still cannot be looked up with a symbolic one: :func:`keyed_by_size` tells that
failure apart, and the caller captures again with every size as given (the graph is then guarded on the
sizes, and a call of another size is captured for itself).

Only names the model's own modules and classes hold are seen: a cached helper called from a helper module's
own function, which the model imports, is not.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Iterator

import torch.nn as nn

_FRAMEWORK = ("torch", "autotp", "functools", "builtins")


def _own(module_name: str | None) -> bool:
    """A module the model's code lives in: not torch, autotp, or the standard library."""
    top = (module_name or "").partition(".")[0]
    return bool(top) and top not in _FRAMEWORK and top not in sys.stdlib_module_names


def _namespaces(model: nn.Module) -> list[tuple[object, dict]]:
    """(owner, its namespace) for every module defining a class of the model (or a base of one) and every
    such class: where the model's code finds its helpers by name."""
    classes: dict[type, None] = {}
    for m in model.modules():
        for cls in type(m).__mro__:
            if _own(cls.__module__):
                classes.setdefault(cls)
    modules: dict[str, types.ModuleType] = {}
    for cls in classes:
        mod = sys.modules.get(cls.__module__)
        if mod is not None:
            modules.setdefault(mod.__name__, mod)
    for mod in modules.values():  # helper classes defined next to the model's (a mask builder's class)
        for value in list(vars(mod).values()):
            if isinstance(value, type) and value.__module__ == mod.__name__:
                classes.setdefault(value)
    return [*((m, vars(m)) for m in modules.values()), *((c, c.__dict__) for c in classes)]


def _uncached(value: object) -> object | None:
    """The plain function behind a ``functools`` cache wrapper (kept a staticmethod or classmethod as it was
    held); None for anything else."""
    if isinstance(value, functools._lru_cache_wrapper):
        return value.__wrapped__
    if isinstance(value, (staticmethod, classmethod)) and isinstance(value.__func__, functools._lru_cache_wrapper):
        return type(value)(value.__func__.__wrapped__)
    return None


@contextlib.contextmanager
def helpers_uncached(model: nn.Module) -> Iterator[None]:
    """Inside: the model's cached helpers run uncached and its memo dicts are restored on exit (see the
    module); on exit every name holds the object it held before."""
    swapped: list[tuple[object, str, object]] = []
    memos: list[tuple[dict, list]] = []
    seen: set[int] = set()
    try:
        for owner, space in _namespaces(model):
            for name, value in list(space.items()):
                plain = _uncached(value)
                if plain is not None:
                    setattr(owner, name, plain)
                    swapped.append((owner, name, value))
                elif type(value) is dict and id(value) not in seen and not name.startswith("__"):
                    seen.add(id(value))
                    memos.append((value, list(value.items())))
        yield
    finally:
        for owner, name, value in reversed(swapped):
            setattr(owner, name, value)
        for memo, items in memos:
            if len(memo) != len(items) or any(memo.get(k, memo) is not v for k, v in items):
                memo.clear()
                memo.update(items)


def keyed_by_size(error: BaseException) -> bool:
    """Did the capture fail hashing a symbolic size (a memo or cache keyed by a sequence length)?"""
    e: BaseException | None = error
    while e is not None:
        if isinstance(e, TypeError) and "unhashable" in str(e) and "Sym" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False
