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
import operator
from collections.abc import Hashable, Iterator

import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from autotp.runtime.rng import RegionRandom, RegionRNG

KEY = "autotp_recompute"  # node.meta["custom"][KEY]: the checkpoint call a node ran in (tagged at capture)


def region_of(node: fx.Node) -> Hashable | None:
    """The checkpoint call ``node`` ran in (None: outside any)."""
    custom = node.meta.get("custom")
    return custom.get(KEY) if isinstance(custom, dict) else None


class Recompute(nn.Module):
    """Run ``region`` under activation checkpointing: only its inputs are kept for backward."""

    def __init__(self, region: fx.GraphModule, rng: RegionRNG | None) -> None:
        super().__init__()
        self.region = region
        self.__dict__["rng"] = rng  # not a module: the model's one region stream

    def forward(self, *args):
        if self.rng is None:
            return checkpoint(self.region, *args, use_reentrant=False)
        return checkpoint(self.region, *args, use_reentrant=False, context_fn=self._contexts)

    def _contexts(self):
        saved = {}

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            saved["state"] = self.rng.get_state()
            yield

        @contextlib.contextmanager
        def again() -> Iterator[None]:  # the recomputation draws the forward's masks, then the stream moves on
            now = self.rng.get_state()
            self.rng.set_state(saved["state"])
            try:
                yield
            finally:
                self.rng.set_state(now)

        return forward(), again()


def _regions(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Maximal runs of computing nodes of one checkpoint call; an untagged node (inserted by a rewrite)
    between two nodes of the same call belongs to it."""
    compute = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module", "call_method")]
    tags = [region_of(n) for n in compute]
    for i, tag in enumerate(tags):
        if tag is None:
            before = next((t for t in reversed(tags[:i]) if t is not None), None)
            after = next((region_of(n) for n in compute[i + 1:] if region_of(n) is not None), None)
            if before is not None and before == after:
                tags[i] = before
    runs: list[list[fx.Node]] = []
    last = None
    for node, tag in zip(compute, tags):
        if tag is None:
            last = None
            continue
        if tag != last:
            runs.append([])
        runs[-1].append(node)
        last = tag
    return runs


def outline_recompute(gm: fx.GraphModule, rng: RegionRNG | None) -> int:
    """Replace each checkpointed region of ``gm`` by a :class:`Recompute` call; the number replaced."""
    regions = _regions(gm)
    for k, nodes in enumerate(regions):
        inside = set(nodes)
        inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        sub = fx.Graph()
        env = {a: sub.placeholder(f"in_{i}") for i, a in enumerate(inputs)}
        for a, p in env.items():
            p.meta = dict(a.meta)
        owners: dict[str, nn.Module] = {}
        for n in nodes:
            if n.op == "call_module":
                owners[n.target] = gm.get_submodule(n.target)
            env[n] = sub.node_copy(n, lambda a: env[a])
        sub.output(tuple(env[o] for o in outputs))
        region = fx.GraphModule(owners, sub, class_name="Region")
        random = any(isinstance(m, RegionRandom) for m in owners.values())
        name = f"autotp_recompute_{k}"
        gm.add_submodule(name, Recompute(region, rng if random else None))
        with gm.graph.inserting_after(nodes[-1]):
            call = gm.graph.call_module(name, tuple(inputs))
        with gm.graph.inserting_after(call):
            for i, o in enumerate(outputs):
                got = gm.graph.call_function(operator.getitem, (call, i))
                got.meta = dict(o.meta)
                o.replace_all_uses_with(got, delete_user_cb=lambda u: u not in inside)
        for n in reversed(nodes):
            gm.graph.erase_node(n)
    if regions:
        gm.graph.lint()
        gm.recompile()
    return len(regions)
