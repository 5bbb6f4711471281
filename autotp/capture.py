"""Capture a user's forward call with torch.export, on meta tensors, with dynamic batch and sequence.

Capture runs on a *skeleton* of the model whose parameters and buffers live on the meta device, so it
costs no memory and never touches real weights; the graph is then retargeted to the real device.
Batch and sequence dims (the first two of every tensor input) are ``Dim.AUTO``: export keeps them
symbolic unless the model pins them. A size of 1 is specialized by export, so it is part of the cache key.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import os
import traceback
from collections.abc import Hashable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export import Dim

from autotp.errors import CaptureError

aten = torch.ops.aten


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are meta tensors (ties preserved)."""
    memo: dict[int, object] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo:
            continue
        mt = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(mt, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else mt
    return copy.deepcopy(model, memo)


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


def _to_meta(x: object) -> object:
    return torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x


def _dynamic_shapes(args: tuple, kwargs: dict):
    def dims(x):
        if isinstance(x, torch.Tensor):
            return {i: Dim.AUTO for i in range(min(x.dim(), 2))}
        return None

    return (pytree.tree_map(dims, args), pytree.tree_map(dims, kwargs))


def capture(skeleton: nn.Module, args: tuple, kwargs: dict, device: torch.device) -> fx.GraphModule:
    """Export ``skeleton(*args, **kwargs)`` and return a GraphModule on ``device`` (weights still meta).

    A forward that builds a tensor from Python data on the input's device (``x[:, [-1]]``) leaves a constant
    whose value a meta capture loses; such a graph is captured again on the CPU with uninitialised weights
    of the real size. Their values are never read, so the pages behind them are never touched and cost
    address space, not memory.
    """
    gm = _export(skeleton, *pytree.tree_map(_to_meta, (args, kwargs)))
    source = torch.device("meta")
    if _meta_constants(gm):
        cpu = torch.device("cpu")
        real = materialized_skeleton(skeleton, cpu)
        gm = _export(real, *pytree.tree_map(lambda x: torch.empty_like(x, device=cpu) if isinstance(x, torch.Tensor)
                                            else x, (args, kwargs)))
        del real
        source = cpu
    retarget_device(gm, torch.device(device), source)
    return gm


def materialized_skeleton(skeleton: nn.Module, device: torch.device) -> nn.Module:
    memo: dict[int, object] = {}
    for t in [*skeleton.parameters(), *skeleton.buffers()]:
        if id(t) not in memo:
            e = torch.empty_like(t, device=device)
            memo[id(t)] = nn.Parameter(e, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else e
    return copy.deepcopy(skeleton, memo)


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


def _export(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    dyn_args, dyn_kwargs = _dynamic_shapes(args, kwargs)
    quiet = logging.getLogger("torch")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # a failed export logs its whole graph; the CaptureError says what matters
    try:
        # export prints the partial graph of a failed trace; the CaptureError below says what matters
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ep = torch.export.export(model, tuple(args), dict(kwargs),
                                     dynamic_shapes=_combine(model, dyn_args, dyn_kwargs), strict=False)
    except Exception as e:  # noqa: BLE001 - every export failure becomes one readable error
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}.forward: {_reason(e)}{_user_line(e)}",
            hint="make the forward traceable (no data-dependent Python control flow on tensor values), "
                 "or pass example_inputs shaped like a real batch",
        ) from e
    finally:
        quiet.setLevel(level)
    return ep.module()


def _combine(model: nn.Module, dyn_args: tuple, dyn_kwargs: dict):
    # export wants dynamic_shapes keyed like forward's signature when kwargs are used
    if not dyn_kwargs:
        return tuple(dyn_args)
    names = list(inspect.signature(model.forward).parameters)
    spec = {names[i]: d for i, d in enumerate(dyn_args)}
    spec.update(dyn_kwargs)
    return spec


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


def retarget_device(gm: fx.GraphModule, device: torch.device, source: torch.device | None = None) -> None:
    """Replace the capture device recorded in factory calls (``arange(..., device=meta)``) by ``device``."""
    meta = source or torch.device("meta")
    if meta == device:
        return
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.kwargs.get("device") == meta:
            node.kwargs = {**node.kwargs, "device": device}
        if any(a == meta for a in node.args if isinstance(a, torch.device)):
            node.args = tuple(device if isinstance(a, torch.device) and a == meta else a for a in node.args)
    gm.recompile()
