"""Each autocast region of the model outlined again: the nodes the capture tagged with one
``torch.autocast(...)`` call (:mod:`autotp.capture.autocast`) become one call of an
:class:`~autotp.operators.autocast.Autocast`, which runs them under the same
``torch.autocast(device_type, dtype, enabled, cache_enabled)``, with whatever the passes inserted in them.

Before (an RMSNorm of the q projection in fp32, autocast off, the norm's variance summed over the group)::

    q = call_module[autotp_column_0](x)       # (b, s, h/t)
    to = aten.to.dtype(q, float32)            # region 0: autocast(cpu, bf16, enabled=False)
    var = aten.sum.dim_IntList(pow, [-1])     # region 0
    var = call_module[autotp_reduce_1](var)   # no tag: between two nodes of region 0, so in it
    normed = aten.mul.Tensor(to, rsqrt)       # region 0

After::

    autocast = call_module[autotp_autocast_0](q, weight)  # Autocast: with torch.autocast(...): region(...)
    normed = getitem(autocast, 0)

Run on the bound graph after the model's autograd Functions and before its checkpointed regions are
outlined (see :mod:`autotp.parallel.apply`).
"""
from __future__ import annotations

import torch.fx as fx

from autotp.operators.autocast import KEY, Autocast, region_of
from autotp.passes.tagged_regions import outline, tagged_regions


def outline_autocast(gm: fx.GraphModule) -> int:
    """Replace each autocast region of ``gm``, and of every graph ``gm`` was split into (FSDP units' pieces,
    pipeline stages: graph modules among its submodules), by an :class:`~autotp.operators.autocast.Autocast`
    call; the number replaced. Before the recomputation regions are outlined: an autocast region inside a
    checkpointed one stays inside it."""
    pieces = [m for m in gm.modules() if isinstance(m, fx.GraphModule) and m is not gm]
    n = 0
    for g in (gm, *pieces):
        found = tagged_regions(g, region_of)
        for k, nodes in enumerate(found):
            outline(g, nodes, f"autotp_autocast_{k}", lambda region, owners, settings: Autocast(region, settings),
                    KEY)
        if found:
            g.graph.lint()
            g.recompile()
        n += len(found)
    return n
