"""Autocast regions kept: each region the model ran under ``torch.autocast(...)`` (a ``with`` block or a
decorated function, which export wraps in the ``wrap_with_autocast`` higher-order op; the capture inlines its
body and tags the nodes, :mod:`autotp.capture.autocast`) runs in the rewritten graph under the same
``torch.autocast(device_type, dtype, enabled, cache_enabled)`` again, with whatever the passes inserted in it.

Before (an RMSNorm of the q projection in fp32, autocast off, the norm's variance summed over the group)::

    q = call_module[autotp_column_0](x)       # (b, s, h/t)
    to = aten.to.dtype(q, float32)            # region 0: autocast(cpu, bf16, enabled=False)
    var = aten.sum.dim_IntList(pow, [-1])     # region 0
    var = call_module[autotp_reduce_1](var)   # no tag: between two nodes of region 0, so in it
    normed = aten.mul.Tensor(to, rsqrt)       # region 0

After::

    autocast = call_module[autotp_autocast_0](q, weight)  # Autocast: with torch.autocast(...): region(...)
    normed = getitem(autocast, 0)
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

import torch
import torch.fx as fx
import torch.nn as nn

from autotp.operators.regions import outline, regions, tag

KEY = "autotp_autocast"  # node.meta["custom"][KEY]: the AutocastRegion a node ran in (tagged at capture)


class AutocastRegion(NamedTuple):
    """One ``torch.autocast`` call of the model: its arguments, and which call it was (``id``)."""

    device_type: str
    dtype: torch.dtype | None
    enabled: bool
    cache_enabled: bool | None
    id: Hashable

    def renamed(self, block: str) -> AutocastRegion:
        """The region of a copied block: numbered apart from the block it was copied from."""
        return self._replace(id=(self.id, block))


def region_of(node: fx.Node) -> AutocastRegion | None:
    found = tag(node, KEY)
    return found if isinstance(found, AutocastRegion) else None


class Autocast(nn.Module):
    """Run ``region`` under ``torch.autocast`` with the model's own arguments."""

    def __init__(self, region: fx.GraphModule, settings: AutocastRegion) -> None:
        super().__init__()
        self.region = region
        self.settings = settings

    def forward(self, *args):
        s = self.settings
        with torch.autocast(s.device_type, dtype=s.dtype, enabled=s.enabled, cache_enabled=s.cache_enabled):
            return self.region(*args)


def outline_autocast(gm: fx.GraphModule) -> int:
    """Replace each autocast region of ``gm`` by an :class:`Autocast` call, and of every graph ``gm`` was split
    into (FSDP units' pieces, pipeline stages: graph modules among its submodules); the number replaced.
    Before the recomputation regions are outlined: an autocast region inside a checkpointed one stays inside
    it."""
    pieces = [m for m in gm.modules() if isinstance(m, fx.GraphModule) and m is not gm]
    n = 0
    for g in (gm, *pieces):
        found = regions(g, region_of)
        for k, nodes in enumerate(found):
            outline(g, nodes, f"autotp_autocast_{k}", lambda region, owners, settings: Autocast(region, settings),
                    KEY)
        if found:
            g.graph.lint()
            g.recompile()
        n += len(found)
    return n
