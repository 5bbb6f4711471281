"""Each checkpointed region of the model outlined again: the nodes the capture tagged with one
``torch.utils.checkpoint`` call (:mod:`autotp.capture.recompute`) become one call of a
:class:`~autotp.operators.recompute.Recompute`, which runs them under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, with the collectives the passes inserted inside
(Megatron's full recomputation repeats the forward's all-reduces too).

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
attributes and later rebinding finds them. Last of the outliners, on the bound graph (see
:mod:`autotp.parallel.apply`): a region's random ops are already bound to their streams, which the
:class:`~autotp.operators.recompute.Recompute` puts back for the recomputation, and the autocast regions and
Function calls inside it are already outlined.
"""
from __future__ import annotations

from collections.abc import Hashable

import torch.fx as fx
import torch.nn as nn

from autotp.operators.recompute import KEY, Recompute, region_of
from autotp.operators.rng import RegionRandom
from autotp.operators.pieces import PieceCall
from autotp.passes.tagged_regions import outline, tagged_regions


def _make(region: fx.GraphModule, owners: dict[str, nn.Module], tag: Hashable) -> nn.Module:
    """The region run under checkpointing, with the streams its bound random ops draw from."""
    streams = {id(m.rng): m.rng for m in owners.values() if isinstance(m, RegionRandom) and m.rng is not None}
    return Recompute(region, tuple(streams.values()))


def outline_recompute(gm: fx.GraphModule) -> int:
    """Replace each checkpointed region of ``gm``, and of every piece ``gm`` was split into (FSDP units,
    pipeline stages: each :class:`~autotp.operators.pieces.PieceCall`'s graph), by a
    :class:`~autotp.operators.recompute.Recompute` call; the number replaced. Its random ops' streams are
    those they were bound to (:func:`~autotp.operators.rng.bind_rng`).

    Inside a piece the region recomputes within the piece's backward: an FSDP unit's parameters are gathered
    again before it (FSDP's pre-backward hook on the piece's outputs) and the recomputation reads them through
    the same tensors, refilled; a pipeline stage recomputes in its own backward of each micro-batch. A region
    the split cut in two (a checkpoint around two blocks) is recomputed piece by piece. Not the regions' own
    graphs (an autocast region inside a checkpointed one is already inside it)."""
    pieces = [m for m in gm.modules() if isinstance(m, PieceCall) and isinstance(m.piece, fx.GraphModule)]
    n = 0
    for g in (gm, *(m.piece for m in pieces)):
        found = tagged_regions(g, region_of)
        for k, nodes in enumerate(found):
            outline(g, nodes, f"autotp_recompute_{k}", _make, KEY)
        if found:
            g.graph.lint()
            g.recompile()
        n += len(found)
    for m in pieces:  # a copy made for running before the regions were outlined is stale
        m.__dict__.pop("_lazy", None)
    return n
