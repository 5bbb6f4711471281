"""Capture never changes the user's model: every module's state is put back as it was, on success and failure.

A forward may write to its model as it runs: a causal mask or a rotary table registered as a buffer on first
use (``self.register_buffer("mask", ...)``), a Python-side cache (``self.seq_len_cached = n``,
``self.cos_cached = ...``), a counter. Meta runs and ``torch.export`` run that code on meta or fake tensors,
so what it writes is a meta tensor, a fake one or a symbolic size: left on the model it breaks the next trace
(which trusts the half-written cache) and the user's own later calls. ``torch.nn.utils.stateless``'s
swap alone does not cover it, and it restores a module registered under several paths (a rotary module
shared by every block, an embedding held by a tied head) in the wrong order.

:func:`preserved` takes a shallow snapshot of every module's ``__dict__`` (and of the dicts, lists and sets in
it: ``_parameters``, ``_buffers``, ``_modules``, hook dicts, a user's cache dict) and of every tensor's version
counter, and puts it back on exit: the same objects under the same names, the containers restored in place.
A plain tensor attribute (neither parameter nor buffer, e.g. ``inv_freq``) is cloned first, so an in-place
write to it is undone too; a parameter or buffer changed in place (capture swaps those for meta or fake
tensors, so it cannot be) is reported, never silently kept.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from autotp.errors import CaptureError

__all__ = ["preserved", "unique_names"]

_CONTAINERS = (dict, list, set)


def _real(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_meta and type(t) in (torch.Tensor, nn.Parameter)


@dataclass
class _Saved:
    module: nn.Module
    cls: type  # its class (parallelize and fully_shard swap in subclasses)
    attrs: dict  # the module's __dict__, shallow
    inner: dict[str, object] = field(default_factory=dict)  # key -> a shallow copy of the container there
    plain: dict[str, torch.Tensor] = field(default_factory=dict)  # plain tensor attribute -> its clone


def _tensors(saved: _Saved) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor the module holds, by a readable name: its attributes and the values in its containers."""
    for key, value in saved.attrs.items():
        if isinstance(value, torch.Tensor):
            yield key, value
        for k, t in value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ():
            if isinstance(t, torch.Tensor):
                yield (k if key in ("_parameters", "_buffers") else f"{key}[{k!r}]"), t


def _snapshot(model: nn.Module) -> list[_Saved]:
    out = []
    for m in model.modules():
        saved = _Saved(m, type(m), dict(m.__dict__))
        for key, value in saved.attrs.items():
            if isinstance(value, _CONTAINERS):
                saved.inner[key] = _copy(value)
            elif _real(value) and not isinstance(value, nn.Parameter):
                saved.plain[key] = value.detach().clone()
        out.append(saved)
    return out


def _copy(value: dict | list | set) -> dict | list | set:
    if isinstance(value, dict):
        return list(value.items())  # the order too: an OrderedDict of buffers keeps it
    return list(value)


def _fill(container: dict | list | set, items: list) -> None:
    """Put ``items`` back into ``container`` itself (code may hold a reference to ``m._buffers``)."""
    container.clear()
    container.extend(items) if isinstance(container, list) else container.update(items)


@contextlib.contextmanager
def preserved(model: nn.Module, *, on_failure_only: bool = False) -> Iterator[None]:
    """Run the body; then every module of ``model`` holds exactly the objects it held before, and every tensor
    it held has the values it had (see the module doc). ``on_failure_only``: put the model back only where the
    body raises (a failed ``parallelize`` leaves the model as it was; a successful one keeps its changes)."""
    saved = _snapshot(model)
    # an inference tensor (made under torch.inference_mode, e.g. state a no-grad call wrote) keeps no version
    # counter, and nothing outside inference mode can write it in place: there is nothing to watch
    versions = {id(t): (name, t, t._version) for s in saved for name, t in _tensors(s)
                if _real(t) and not t.is_inference()}
    failed = True
    try:
        yield
        failed = False
    finally:
        if failed or not on_failure_only:
            _restore(saved, versions, failed)


def _restore(saved: list[_Saved], versions: dict, failed: bool) -> None:
    for s in saved:
        if type(s.module) is not s.cls:
            s.module.__class__ = s.cls
        for key, items in s.inner.items():
            _fill(s.attrs[key], items)
        s.module.__dict__.clear()
        s.module.__dict__.update(s.attrs)
    undone = set()
    for s in saved:
        for key, clone in s.plain.items():
            t = s.attrs[key]
            undone.add(id(t))
            if id(t) in versions and t._version != versions[id(t)][2]:
                with torch.no_grad():
                    t.copy_(clone)
    changed = sorted(name for i, (name, t, version) in versions.items() if t._version != version and i not in undone)
    if changed and not failed:
        raise CaptureError(f"capturing the forward wrote to {', '.join(changed[:3])} in place",
                           hint="a bug in autotp's capture, which runs the forward on stand-ins: please "
                                "report it with the model")


def unique_names(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` keyed by parameter or buffer name, keeping one name per (module, attribute): a module
    registered under several paths (a shared rotary module, an embedding its tied head holds) is swapped
    once, so ``torch.nn.utils.stateless`` restores it once, to the original."""
    seen: set[tuple[int, str]] = set()
    out = {}
    for name, t in tensors.items():
        path, _, leaf = name.rpartition(".")
        try:
            owner = model.get_submodule(path) if path else model
        except AttributeError:
            out[name] = t
            continue
        if (id(owner), leaf) not in seen:
            seen.add((id(owner), leaf))
            out[name] = t
    return out
