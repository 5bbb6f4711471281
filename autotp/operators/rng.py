"""Random streams for tensor parallelism (Megatron's RNG tracker, without global state).

Replicated activations draw from the default generator, which every rank of a TP group keeps in step, so
their dropout masks are identical across the group. Random ops inside a sharded region (attention dropout
on local heads) draw from a per-rank stream held by :class:`RegionRNG`, seeded ``seed + 2718 + tp_rank``,
so each rank's heads get independent masks and the default stream is not advanced by them.

With context parallelism each rank holds a chunk of every sequence: a random op on a chunk that tp leaves
replicated draws from the context stream, seeded ``seed + 3141 + cp_rank`` (the same on the tp ranks of a
chunk, different between chunks); the sharded-region stream is then seeded per (tp, cp) rank. Without it the
chunks would get the same masks, position by position.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

SEED_OFFSET = 2718
CONTEXT_SEED_OFFSET = 3141


class RegionRNG:
    """A saved generator state that random ops of sharded regions swap in while they run."""

    def __init__(self, seed: int, device: torch.device):
        self.device = torch.device(device)
        with torch.random.fork_rng(devices=self._devices()):
            torch.manual_seed(seed)
            self._state = self._get()

    def _devices(self) -> list[int]:
        return [self.device.index or 0] if self.device.type == "cuda" else []

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def get_state(self) -> torch.Tensor:
        """The stream's generator state (a checkpoint saves it)."""
        return self._state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state.clone()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        outer = self._get()
        self._set(self._state)
        try:
            yield
        finally:
            self._state = self._get()
            self._set(outer)


class RegionRandom(nn.Module):
    """Runs one random op (dropout, attention with dropout) on its stream when one is bound: the sharded
    region's (``stream="tp"``) or, on a sequence chunk that tp leaves replicated, the context's (``"cp"``)."""

    def __init__(self, op, stream: str = "tp") -> None:
        super().__init__()
        self.op = op
        self.stream = stream
        self.rng: RegionRNG | None = None

    def forward(self, *args, **kwargs):
        if self.rng is None:
            return self.op(*args, **kwargs)
        with self.rng.active():
            return self.op(*args, **kwargs)


def bind_rng(module: nn.Module, rng: RegionRNG | None, context: RegionRNG | None = None) -> None:
    """Bind each :class:`RegionRandom` of ``module`` to its stream: the region's ``rng``, or ``context``."""
    for m in module.modules():
        if isinstance(m, RegionRandom):
            m.rng = context if m.stream == "cp" else rng
