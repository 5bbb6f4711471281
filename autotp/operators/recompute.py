"""Activation checkpointing kept: each region the model ran under ``torch.utils.checkpoint`` (the capture
tags its nodes, :mod:`autotp.capture.recompute`) runs in the rewritten graph as a :class:`Recompute` call (the
region outlined by :mod:`autotp.passes.outline_recompute`): under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` again, with its collectives inside (Megatron's full
recomputation repeats the forward's all-reduces too). A region with random ops of a sharded region (dropout on
the rank's heads) recomputes with the region stream put back where the forward found it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator

import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from autotp.operators.rng import RegionRNG

KEY = "autotp_recompute"  # node.meta["custom"][KEY]: the checkpoint call a node ran in (tagged at capture)


def region_of(node: fx.Node) -> Hashable | None:
    """The checkpoint call ``node`` ran in (None: outside any)."""
    custom = node.meta.get("custom")
    return custom.get(KEY) if isinstance(custom, dict) else None


class Recompute(nn.Module):
    """Run ``region`` under activation checkpointing: only its inputs are kept for backward."""

    def __init__(self, region: fx.GraphModule, streams: tuple[RegionRNG, ...] = ()) -> None:
        super().__init__()
        self.region = region
        self.__dict__["streams"] = streams  # not modules: the model's region and context streams it draws from

    def forward(self, *args):
        if not self.streams:
            return checkpoint(self.region, *args, use_reentrant=False)
        return checkpoint(self.region, *args, use_reentrant=False, context_fn=self._contexts)

    def _contexts(self):
        saved = []

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            saved[:] = [rng.get_state() for rng in self.streams]
            yield

        @contextlib.contextmanager
        def again() -> Iterator[None]:  # the recomputation draws the forward's masks, then the streams move on
            now = [rng.get_state() for rng in self.streams]
            for rng, state in zip(self.streams, saved):
                rng.set_state(state)
            try:
                yield
            finally:
                for rng, state in zip(self.streams, now):
                    rng.set_state(state)

        return forward(), again()
