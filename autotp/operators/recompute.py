"""Activation checkpointing kept: each region the model ran under ``torch.utils.checkpoint`` (the capture
tags its nodes, :mod:`autotp.capture.recompute`) runs in the rewritten graph under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` again, with its collectives inside (Megatron's full
recomputation repeats the forward's all-reduces too).

Before (one checkpointed layer; the all-reduce inserted by the rewrite has no tag of its own)::

    x = placeholder                          # residual stream, (b, s, h)
    norm = aten.rms_norm(x, ..)              # region 0
    qkv = call_module[autotp_column_0](norm) # region 0
    ...
    out = call_module[autotp_reduce_1](o)    # no tag: between two nodes of region 0, so in it
    add = aten.add(x, out)                   # region 0

After::

    recompute = call_module[autotp_recompute_0](x, weight, ..)  # Recompute: checkpoint(region, *inputs)
    add = getitem(recompute, 0)

The region's own inputs (activations, parameters, sizes) are passed in, so its parameters stay the graph's
attributes and later rebinding finds them. A region with random ops of a sharded region (dropout on the
rank's heads) recomputes with the region stream put back where the forward found it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator

import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from autotp.operators.regions import outline, regions
from autotp.operators.rng import RegionRandom, RegionRNG
from autotp.operators.units import PieceCall

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


def _make(region: fx.GraphModule, owners: dict[str, nn.Module], tag: Hashable) -> nn.Module:
    streams = {id(m.rng): m.rng for m in owners.values() if isinstance(m, RegionRandom) and m.rng is not None}
    return Recompute(region, tuple(streams.values()))


def outline_recompute(gm: fx.GraphModule) -> int:
    """Replace each checkpointed region of ``gm``, and of every piece ``gm`` was split into (FSDP units,
    pipeline stages: each :class:`~autotp.operators.units.PieceCall`'s graph), by a :class:`Recompute` call; the
    number replaced. Its random ops' streams are those they were bound to (:func:`~autotp.operators.rng.bind_rng`).

    Inside a piece the region recomputes within the piece's backward: an FSDP unit's parameters are gathered
    again before it (FSDP's pre-backward hook on the piece's outputs) and the recomputation reads them through
    the same tensors, refilled; a pipeline stage recomputes in its own backward of each micro-batch. A region
    the split cut in two (a checkpoint around two blocks) is recomputed piece by piece. Not the regions' own
    graphs (an autocast region inside a checkpointed one is already inside it)."""
    pieces = [m for m in gm.modules() if isinstance(m, PieceCall) and isinstance(m.piece, fx.GraphModule)]
    n = 0
    for g in (gm, *(m.piece for m in pieces)):
        found = regions(g, region_of)
        for k, nodes in enumerate(found):
            outline(g, nodes, f"autotp_recompute_{k}", _make, KEY)
        if found:
            g.graph.lint()
            g.recompile()
        n += len(found)
    for m in pieces:  # a copy made for running before the regions were outlined is stale
        m.__dict__.pop("_lazy", None)
    return n
