"""Capture a user's forward call with non-strict ``torch.export`` of the user's own model object.

Non-strict export runs the model's real Python code (closures over submodules, plain tensor attributes,
module-level tensors, hooks on submodules, buffers written in forward) on fake tensors that it makes from
the parameters and buffers itself: no copy of the model, no memory, no real compute, and the model is left
as it was. Batch and sequence dims (the first two of every tensor input) are ``Dim.AUTO``: export keeps them
symbolic unless the model pins them. A size of 1 is specialized by export, so it is part of the cache key.

Outputs are flattened to a tuple of tensors by :func:`flatten_output` before export sees them, so any
Python object a forward returns (a model-output dataclass, a cache object holding tensors) is captured
without registering its type anywhere; :func:`unflatten_output` rebuilds it around the graph's results.

A model whose parameters were already cut to local shards is captured with full-size stand-ins swapped in
for the duration of the export (``params=``): uninitialised CPU tensors (address space, never touched) or
meta tensors on other devices.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
import os
import traceback
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export import Dim
from torch.nn.utils.stateless import _reparametrize_module

from autotp.errors import CaptureError

_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")


def signature(args: tuple, kwargs: dict, training: bool) -> Hashable:
    """Cache key of a call: input structure, dtypes, ranks, which dims are 1, non-tensor values."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    key = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            key.append(("T", x.dtype, x.dim(), tuple(d == 1 for d in x.shape[:2])))
        else:
            key.append(("V", type(x).__name__, x if isinstance(x, Hashable) else repr(x)))
    return (str(spec), tuple(key), training)


# -- outputs -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OutSpec:
    """Structure of a forward's output. ``kind``: "tensor" (``value`` = flat index), "const", "tree"
    (a torch pytree node: ``value`` = its TreeSpec over ``children``) or "object" (``value`` = the class,
    ``keys`` its ``__dict__`` keys)."""

    kind: str
    value: object = None
    keys: tuple[str, ...] = ()
    children: tuple[OutSpec, ...] = ()


def _holds_tensor(x: object, depth: int = 0) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if depth > 8:
        return False
    if isinstance(x, (list, tuple)):
        return any(_holds_tensor(v, depth + 1) for v in x)
    if isinstance(x, dict):
        return any(_holds_tensor(v, depth + 1) for v in x.values())
    d = getattr(x, "__dict__", None)
    return isinstance(d, dict) and not isinstance(x, type) and any(_holds_tensor(v, depth + 1) for v in d.values())


def flatten_output(out: object) -> tuple[list[torch.Tensor], OutSpec]:
    tensors: list[torch.Tensor] = []

    def walk(x: object) -> OutSpec:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return OutSpec("tensor", len(tensors) - 1)
        if not pytree.tree_is_leaf(x):  # tuples, lists, dicts, namedtuples, registered output classes
            leaves, spec = pytree.tree_flatten(x)
            return OutSpec("tree", spec, children=tuple(walk(c) for c in leaves))
        if _holds_tensor(x):
            keys = tuple(vars(x))
            return OutSpec("object", type(x), keys, tuple(walk(vars(x)[k]) for k in keys))
        return OutSpec("const", x)

    return tensors, walk(out)


def unflatten_output(tensors: tuple | list, spec: OutSpec) -> object:
    if spec.kind == "tensor":
        return tensors[spec.value]
    if spec.kind == "const":
        return spec.value
    children = [unflatten_output(tensors, c) for c in spec.children]
    if spec.kind == "tree":
        return pytree.tree_unflatten(children, spec.value)
    obj = spec.value.__new__(spec.value)
    obj.__dict__.update(zip(spec.keys, children))
    return obj


# -- capture -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _as_plain_forward(model: nn.Module, forward: Callable, box: list) -> Iterator[None]:
    """Export ``model`` as if ``forward`` were its forward: root hooks off (they run around the rewritten
    graph at call time, as before), outputs flattened into ``box``."""

    @functools.wraps(forward)
    def flat_forward(*args, **kwargs):
        tensors, spec = flatten_output(forward(*args, **kwargs))
        box.append(spec)
        return tuple(tensors)

    saved = {name: getattr(model, name) for name in _HOOK_DICTS if hasattr(model, name)}
    had_forward = "forward" in model.__dict__
    old_forward = model.__dict__.get("forward")
    try:
        for name in saved:
            setattr(model, name, OrderedDict())
        model.__dict__["forward"] = flat_forward
        yield
    finally:
        for name, value in saved.items():
            setattr(model, name, value)
        if had_forward:
            model.__dict__["forward"] = old_forward
        else:
            model.__dict__.pop("forward", None)


def stand_ins(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Uninitialised tensors shaped like ``tensors`` on ``device``, one object per tied group.

    On the CPU they are address space until written (and capture never writes them); meta costs nothing.
    """
    made: dict[int, torch.Tensor] = {}
    for t in tensors.values():
        if id(t) not in made:
            e = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = nn.Parameter(e, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else e
    return {name: made[id(t)] for name, t in tensors.items()}


def capture(model: nn.Module, args: tuple, kwargs: dict, *, forward: Callable | None = None,
            params: dict[str, torch.Tensor] | None = None,
            device: torch.device | None = None) -> tuple[fx.GraphModule, OutSpec]:
    """Export ``model``'s call on ``(args, kwargs)``; returns the graph (flat tensor outputs) and the
    output structure. ``forward`` replaces the model's own forward for the export (default: the class's);
    ``params`` swaps in tensors for named parameters or buffers while exporting (full-size stand-ins for
    shards); ``device``: where the graph will run (factory calls are moved there), default the capture's.

    The model's device decides the capture: meta models are captured on meta inputs; a graph that then
    holds a constant whose value a meta capture loses (``x[:, [-1]]`` builds one from Python data) is
    captured again with uninitialised CPU stand-ins (address space only, never read).
    """
    forward = forward or type(model).forward.__get__(model)
    source = _model_device(model, params)
    gm, spec = _export_on(model, forward, args, kwargs, params, source)
    if source.type == "meta" and _meta_constants(gm):
        cpu = torch.device("cpu")
        state = {**dict(model.named_parameters(remove_duplicate=False)),
                 **{n: b for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta}, **(params or {})}
        try:
            gm, spec = _export_on(model, forward, args, kwargs, stand_ins(state, cpu), cpu)
            source = cpu
        except CaptureError:
            pass  # the meta constants are the model's own meta tensor attributes: the meta graph is all there is
    retarget_device(gm, device or source, source)
    return gm, spec


def _model_device(model: nn.Module, params: dict[str, torch.Tensor] | None) -> torch.device:
    for t in [*(params or {}).values(), *model.parameters(), *model.buffers()]:
        return t.device
    return torch.device("cpu")


def _export_on(model: nn.Module, forward: Callable, args: tuple, kwargs: dict,
               params: dict[str, torch.Tensor] | None, device: torch.device) -> tuple[fx.GraphModule, OutSpec]:
    def place(x: object) -> object:
        if isinstance(x, torch.Tensor) and x.device != device:
            return torch.empty_like(x, device=device)
        return x

    args, kwargs = pytree.tree_map(place, (tuple(args), dict(kwargs)))
    box: list[OutSpec] = []
    swap = _reparametrize_module(model, params) if params else contextlib.nullcontext()
    training = [m.training for m in model.modules()]
    try:
        with swap, _as_plain_forward(model, forward, box):
            gm = _export(model, args, kwargs, forward)
    finally:
        for m, t in zip(model.modules(), training):
            m.training = t
    return gm, box[-1]


def _meta_constants(gm: fx.GraphModule) -> list[str]:
    owned = {n for n, _ in gm.named_parameters(remove_duplicate=False)} | \
        {n for n, _ in gm.named_buffers(remove_duplicate=False)}
    found = []
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in owned:
            attr = gm
            for part in node.target.split("."):
                attr = getattr(attr, part)
            if isinstance(attr, torch.Tensor) and attr.is_meta:
                found.append(node.target)
    return found


def _dynamic_shapes(args: tuple, kwargs: dict, forward: Callable):
    def dims(x):
        if isinstance(x, torch.Tensor):
            return {i: Dim.AUTO for i in range(min(x.dim(), 2))}
        return None

    dyn_args, dyn_kwargs = pytree.tree_map(dims, args), pytree.tree_map(dims, kwargs)
    if not dyn_kwargs:
        return tuple(dyn_args)
    # export wants dynamic_shapes keyed like forward's signature when kwargs are used
    names = [n for n, p in inspect.signature(forward).parameters.items()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    spec = {names[i]: d for i, d in enumerate(dyn_args)}
    spec.update(dyn_kwargs)
    return spec


def _export(model: nn.Module, args: tuple, kwargs: dict, forward: Callable) -> fx.GraphModule:
    quiet = logging.getLogger("torch")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # a failed export logs its whole graph; the CaptureError says what matters
    name = f"{type(model).__name__}.forward"
    try:
        # export prints the partial graph of a failed trace; the CaptureError below says what matters
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ep = torch.export.export(model, tuple(args), dict(kwargs),
                                     dynamic_shapes=_dynamic_shapes(args, kwargs, forward), strict=False)
    except Exception as e:  # noqa: BLE001 - every export failure becomes one readable error
        raise CaptureError(
            f"torch.export could not capture {name}: {_reason(e)}{_user_line(e)}",
            hint="make the forward traceable (no data-dependent Python control flow on tensor values), "
                 "or pass example_inputs shaped like a real batch",
        ) from e
    finally:
        quiet.setLevel(level)
    return ep.module()


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _user_line(e: BaseException) -> str:
    """The deepest frame of the user's own code in the failure, as `` at file:line: source``."""
    frames = []
    while e is not None:
        frames += traceback.extract_tb(e.__traceback__)
        e = e.__cause__ or e.__context__
    torch_dir = os.path.dirname(torch.__file__)
    for fr in reversed(frames):
        if not fr.filename.startswith(torch_dir) and "site-packages" not in fr.filename \
                and os.sep + "autotp" + os.sep not in fr.filename:
            return f"\n  at {fr.filename}:{fr.lineno}: {(fr.line or '').strip()}"
    return ""


def retarget_device(gm: fx.GraphModule, device: torch.device, source: torch.device) -> None:
    """Replace the capture device recorded in factory calls (``arange(..., device=meta)``) by ``device``."""
    if source == device:
        return
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.kwargs.get("device") == source:
            node.kwargs = {**node.kwargs, "device": device}
        if any(a == source for a in node.args if isinstance(a, torch.device)):
            node.args = tuple(device if isinstance(a, torch.device) and a == source else a for a in node.args)
    gm.recompile()
