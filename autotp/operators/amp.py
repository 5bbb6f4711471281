"""Autocast for autotp's hand-written autograd Functions.

A GPU training script runs its forward under ``torch.autocast(device, dtype=torch.bfloat16)`` (or fp16 with a
GradScaler). Autocast casts the inputs of ops it knows (matmuls to the low dtype, ``cross_entropy`` to fp32);
it does not know autotp's Functions, and it is off in their backward. These decorators make them follow it
as ``torch.amp.custom_fwd``/``custom_bwd`` do for Megatron's own layers, with the device taken from the
Function's tensor inputs (the same Function runs on CPU and CUDA):

- :func:`amp_fwd` records the autocast state of the forward; with ``cast`` it casts the floating-point
  inputs (to autocast's low dtype with ``cast="low"``, or to a given dtype) and runs the forward with autocast
  off, so the forward computes, and saves for backward, exactly what autocast would have given the op;
- :func:`amp_bwd` runs the backward under the forward's autocast state.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch


class AutocastState(NamedTuple):
    device_type: str
    enabled: bool
    dtype: torch.dtype


def autocast_state(device_type: str) -> AutocastState:
    return AutocastState(device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))


def _device_type(args: tuple) -> str:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return "cpu"


def _cast(x: object, dtype: torch.dtype) -> object:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64:
        return x.to(dtype)
    return x


def matmul_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as autocast would cast it for a matmul: to the low dtype where autocast is on. The compiled
    path casts before f, so the gradient all-reduced there is the low-precision one, as in the eager path."""
    state = autocast_state(x.device.type)
    return _cast(x, state.dtype) if state.enabled else x


def amp_fwd(forward: Callable | None = None, *, cast: str | torch.dtype | None = None) -> Callable:
    """Decorate an autograd Function's ``forward(ctx, ...)``. ``cast``: None records the state only;
    ``"low"`` casts floating inputs to autocast's dtype when autocast is on (a matmul's policy); a dtype
    casts them to it (``torch.float32``: the policy of ``cross_entropy`` and softmax-like reductions)."""
    if forward is None:
        return functools.partial(amp_fwd, cast=cast)

    @functools.wraps(forward)
    def wrapped(ctx, *args):
        state = autocast_state(_device_type(args))
        if cast is None or not state.enabled:
            ctx.autocast = state
            return forward(ctx, *args)
        ctx.autocast = state._replace(enabled=False)  # backward computes on what forward saved: no recasting
        dtype = state.dtype if cast == "low" else cast
        with torch.autocast(state.device_type, enabled=False):
            return forward(ctx, *(_cast(a, dtype) for a in args))

    return wrapped


def amp_bwd(backward: Callable) -> Callable:
    """Decorate the matching ``backward(ctx, *grads)``: run under the state :func:`amp_fwd` recorded."""

    @functools.wraps(backward)
    def wrapped(ctx, *grads):
        state: AutocastState = ctx.autocast
        with torch.autocast(state.device_type, dtype=state.dtype, enabled=state.enabled):
            return backward(ctx, *grads)

    return wrapped
