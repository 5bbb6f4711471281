"""What one rank holds of a model's training state: parameters, gradients, optimizer state.

The one accessor every report of a running model uses (``autotp shard``'s summary, its pipeline path, the
benchmarks), so that each layout counts alike: a DTensor is its local shard (tensor parallelism's ``Shard``,
FSDP2's ``Shard(0)`` over the data-parallel ranks, both at once on a 2-D mesh), a plain tensor its whole size,
and a tensor reached twice (a weight tied to another, a module two pipeline stages share) once.

A parameter on the meta device (a model built under ``autotp.empty_weights()``) counts its size: the bytes it
stands for, which loading allocates.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class Held:
    elements: int = 0
    bytes: int = 0

    def __add__(self, other: Held) -> Held:
        return Held(self.elements + other.elements, self.bytes + other.bytes)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank stores: a DTensor's local shard, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def held(tensors: Iterable[torch.Tensor | None]) -> Held:
    """Elements and bytes this rank holds of ``tensors`` (None skipped), each distinct tensor once."""
    seen: set[int] = set()
    elements = size = 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        piece = local(t)
        elements += piece.numel()
        size += piece.numel() * piece.element_size()
    return Held(elements, size)


def held_params(module: torch.nn.Module | Iterable[torch.nn.Parameter]) -> Held:
    """This rank's parameters of ``module`` (or of an iterable of parameters, a pipeline's stages)."""
    return held(module.parameters() if isinstance(module, torch.nn.Module) else module)


def held_grads(params: Iterable[torch.Tensor]) -> Held:
    """This rank's gradients of ``params`` (those that have one now: after backward, before zero_grad)."""
    return held(p.grad for p in params)


def held_state(opt: torch.optim.Optimizer) -> Held:
    """This rank's optimizer state: the state tensors shaped like their parameter (Adam's two moments, SGD's
    momentum), as sharded as the parameter is; scalar bookkeeping (Adam's step count) is not state per
    parameter and is left out."""
    return held(v for p, state in opt.state.items() for v in state.values()
                if isinstance(v, torch.Tensor) and v.shape == p.shape)
