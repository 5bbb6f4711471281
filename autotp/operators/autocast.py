"""Autocast regions kept: each region the model ran under ``torch.autocast(...)`` (a ``with`` block or a
decorated function, which export wraps in the ``wrap_with_autocast`` higher-order op; the capture inlines its
body and tags the nodes, :mod:`autotp.capture.autocast`) runs in the rewritten graph as an :class:`Autocast`
call (the region outlined by :mod:`autotp.passes.outline_autocast`): under the same
``torch.autocast(device_type, dtype, enabled, cache_enabled)`` again, with whatever the passes inserted in it.
Here: the tag the capture writes (:class:`AutocastRegion`) and the module that runs a region under it.
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

import torch
import torch.fx as fx
import torch.nn as nn

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
    """The autocast region ``node`` ran in (None: outside any)."""
    custom = node.meta.get("custom")
    found = custom.get(KEY) if isinstance(custom, dict) else None
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
