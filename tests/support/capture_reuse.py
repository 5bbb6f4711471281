"""A rank process's captures reused by its later jobs: one export per model, not one per job.

A launch's ranks run a module's jobs one after the other (:class:`ranks.Launches`), and most jobs build the same
small model and parallelize it with other options (FSDP, sequence parallelism, a pipeline schedule, a resume):
each ``parallelize`` exports the model again, the same graph, for seconds of a tiny model's few. Inside
:func:`captures_reused`, autotp's export of a model (``autotp.capture.tracer._export_on``) is kept, and a later
export of an equal model on equal inputs gets a copy of the graph with the new model's own parameters, buffers
and tensor attributes bound in by name, instead of exporting again.

"Equal" is decided from everything the export reads that a test can vary between jobs: each module's class,
training flag and attributes (plain values compared by value; tensors by shape, dtype and value; functions
and other objects by identity), every parameter's and buffer's name, shape, dtype, device and gradient flag
(and which names share a tensor), the forward function, the inputs' structure, shapes and dtypes, the
stand-ins capture swaps in, and torch's global modes (grad, autocast, the default dtype). A model with hooks,
an attribute of any other kind, or a graph whose capture recorded the forward's writes, checks on values or
islands is exported every time. Module-level globals the model's code reads are not compared: the jobs that
reuse captures build their models from code that does not change between jobs.

The tests of capture itself (what it leaves on the model, the writes and checks it records, the call
signatures it tells apart) do not reuse: a reused graph would skip the very capture they check.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import sys
import types
import warnings
from collections.abc import Hashable, Iterator

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from autotp.capture import tracer
from autotp.capture.islands import ISLANDS_KEY
from autotp.capture.structure import Spec, flatten
from autotp.capture.values import CHECKS_KEY
from autotp.capture.writes import WRITES_KEY
from autotp.state import TPState

_ATOMS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size,
          torch.memory_format, torch.layout)
_STATE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
          "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


class _Unkeyable(Exception):
    """A value the key cannot compare: its export is not reused."""


def _tensor_key(t: torch.Tensor) -> Hashable:
    if t.is_meta or type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
        raise _Unkeyable(type(t).__name__)
    digest = hashlib.sha1(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest() \
        if t.numel() else ""
    return ("tensor", tuple(t.shape), t.dtype, t.device, t.requires_grad, digest)


def _value_key(v: object, depth: int = 0) -> Hashable:
    if depth > 12:
        raise _Unkeyable("too deep")
    if isinstance(v, _ATOMS):
        return (type(v), v)
    if isinstance(v, torch.Tensor):
        return _tensor_key(v)
    if isinstance(v, nn.Module):  # held outside _modules (a kernel's function wrapper): stateless ones by class
        if any(True for _ in v.parameters()) or any(True for _ in v.buffers()) or any(getattr(v, h, None) for h in _HOOKS):
            raise _Unkeyable("module attribute with state")
        return ("module", type(v), tuple((k, _value_key(x, depth + 1)) for k, x in sorted(vars(v).items())
                                         if k not in _STATE and k not in _HOOKS))
    if isinstance(v, (tuple, list, set, frozenset)):
        items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
        return (type(v), tuple(_value_key(x, depth + 1) for x in items))
    if isinstance(v, dict):
        return (type(v), tuple((_value_key(k, depth + 1), _value_key(x, depth + 1)) for k, x in v.items()))
    if isinstance(v, TPState):  # autotp's own state on the model, which the model's code never reads
        return ("autotp", _class_key(v.base), v.forward is None)
    if isinstance(v, dist.ProcessGroup):  # autotp's state on the model: its group by size and rank
        return ("group", v.size(), v.rank())
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, type)) or v is Ellipsis:
        return ("id", v)  # held by the key: the same object while the memo lives
    if isinstance(v, types.MethodType):
        raise _Unkeyable("bound method")  # its __self__ may be the first model
    d = getattr(v, "__dict__", None)
    if isinstance(d, dict) and not callable(v):  # a config or record: by its attributes
        return (type(v), tuple((k, _value_key(x, depth + 1)) for k, x in sorted(d.items())))
    raise _Unkeyable(type(v).__name__)


def _class_key(cls: type) -> Hashable:
    """A class by identity where its module names it; a class made at run time (the subclass
    ``parallelize`` swaps in for each model, FSDP's for each class it wraps) by its name, bases and own
    attributes, compared by identity."""
    if getattr(sys.modules.get(cls.__module__), cls.__name__, None) is cls or cls.__module__ == "builtins":
        return cls
    own = tuple((k, _value_key(v) if isinstance(v, _ATOMS) else ("id", v)) for k, v in sorted(vars(cls).items())
                if k not in ("__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "_abc_impl"))
    return ("made", cls.__module__, cls.__qualname__, tuple(_class_key(b) for b in cls.__bases__), own)


def _model_key(model: nn.Module) -> Hashable:
    modules = []
    for name, m in model.named_modules(remove_duplicate=False):
        if any(getattr(m, h, None) for h in _HOOKS):
            raise _Unkeyable(f"hooks on {name or 'the model'}")
        attrs = tuple((k, _value_key(v)) for k, v in sorted(vars(m).items())
                      if k not in _STATE and k not in _HOOKS)
        modules.append((name, _class_key(type(m)), m.training, attrs, tuple(sorted(m._non_persistent_buffers_set))))
    first: dict[int, str] = {}
    tensors = []
    for kind, named in (("p", model.named_parameters(remove_duplicate=False)),
                        ("b", model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            if t is None:
                continue
            tied = first.setdefault(id(t), name)
            tensors.append((kind, name, tuple(t.shape), t.dtype, t.device, t.requires_grad, type(t), tied))
    return tuple(modules), tuple(tensors)


def _spec_key(spec: Spec) -> Hashable:
    if spec.kind == "tensor":
        return ("T", spec.value)
    if spec.kind == "const":
        return ("C", _value_key(spec.value))
    head = str(spec.value) if spec.kind == "tree" else spec.value
    return (spec.kind, head, spec.keys, tuple(_spec_key(c) for c in spec.children))


def _call_key(model, forward, args, kwargs, params, device, static, writes) -> Hashable | None:
    """Everything the export of this call reads that can differ between jobs; None where it cannot be told."""
    func, bound = getattr(forward, "__func__", forward), getattr(forward, "__self__", None)
    if bound is not None and bound is not model:
        return None
    try:
        tensors, spec = flatten((tuple(args), dict(kwargs)))
        inputs = tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad, t._base is None) for t in tensors)
        swapped = tuple(sorted((n, tuple(t.shape), t.dtype, t.device) for n, t in (params or {}).items()))
        modes = (torch.is_grad_enabled(), torch.get_default_dtype(),
                 tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")))
        return (func, bound is not None, _model_key(model), _spec_key(spec), inputs, swapped, device, static,
                writes, modes)
    except _Unkeyable:
        return None


def _reusable(gm: fx.GraphModule, spec: Spec) -> bool:
    """A graph whose capture recorded nothing about this model object in particular, returning only tensors,
    plain values and structures of them."""
    if gm.meta.get(WRITES_KEY) or gm.meta.get(CHECKS_KEY) or gm.meta.get(ISLANDS_KEY):
        return False
    try:
        _spec_key(spec)
    except _Unkeyable:
        return False
    return True


def _owned_tensors(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Every tensor the graph module holds, by its dotted name (parameters, buffers, constants)."""
    found = {}
    for path, sub in gm.named_modules(remove_duplicate=False):
        for k, v in vars(sub).items():
            if isinstance(v, torch.Tensor):
                found[f"{path}.{k}" if path else k] = v
        for table in (sub._parameters, sub._buffers):
            for k, v in table.items():
                if v is not None:
                    found[f"{path}.{k}" if path else k] = v
    return found


def _bind(gm: fx.GraphModule, model: nn.Module, params: dict[str, torch.Tensor] | None) -> bool:
    """Put this model's tensors where the copied graph holds the first model's, by name; False where a name
    the graph holds has no tensor of this model's (the copy is then not used)."""
    state = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False)), **(params or {})}
    for name, t in _owned_tensors(gm).items():
        new = state.get(name)
        if new is None:
            owner, _, leaf = name.rpartition(".")
            try:
                held = getattr(model.get_submodule(owner) if owner else model, leaf)
            except AttributeError:
                held = None
            if not isinstance(held, torch.Tensor):
                if name.startswith("_") or "._" in name:  # a constant the export made itself (same code, same value)
                    continue
                return False
            new = held
        owner, _, leaf = name.rpartition(".")
        sub = gm.get_submodule(owner) if owner else gm
        if leaf in sub._parameters:
            sub._parameters[leaf] = new
        elif leaf in sub._buffers:
            sub._buffers[leaf] = new
        else:
            object.__setattr__(sub, leaf, new)
    return True


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """The graph module's structure and meta copied, its tensors shared (:func:`_bind` replaces them)."""
    with warnings.catch_warnings():  # torch's pytree specs warn about their own deprecated isinstance on copy
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(gm, {id(t): t for t in _owned_tensors(gm).values()})


@contextlib.contextmanager
def captures_reused() -> Iterator[dict[str, int]]:
    """Within: exports of an equal model on equal inputs are made once (see the module docstring). Yields
    the counts of exports made and reused."""
    real = tracer._export_on
    memo: dict[Hashable, tuple[fx.GraphModule, Spec]] = {}
    counts = {"exported": 0, "reused": 0}

    def export_on(model, forward, args, kwargs, params, device, static=False, writes=False):
        key = _call_key(model, forward, args, kwargs, params, device, static, writes)
        kept = memo.get(key) if key is not None else None
        if kept is not None:
            gm0, spec = kept
            # the graph's structure and meta copied, its tensors not (bound to this model's just below)
            gm = _copy(gm0)
            if _bind(gm, model, params):
                counts["reused"] += 1
                return gm, spec
        gm, spec = real(model, forward, args, kwargs, params, device, static, writes)
        counts["exported"] += 1
        if key is not None and _reusable(gm, spec):
            memo[key] = (_copy(gm), spec)
        return gm, spec

    tracer._export_on = export_on
    try:
        yield counts
    finally:
        tracer._export_on = real
