"""Outline tagged regions of a rewritten graph into submodules: the machinery behind keeping the model's own
autograd Functions (:mod:`autotp.passes.outline_functions`), its autocast regions
(:mod:`autotp.passes.outline_autocast`) and its activation checkpointing
(:mod:`autotp.passes.outline_recompute`), which the capture inlined and tagged so that analysis and the
passes see plain ops. The modules the outlined calls run are the runtime's (:mod:`autotp.operators`).

A tagged region (so called to tell it from analysis's pair regions, a column→row pair's span) is a maximal run
of computing nodes with one tag; a node the passes inserted (a collective, a sharded operator) carries no tag,
and between two nodes of one region it belongs to that region. The outlined call takes the region's own inputs
(activations, parameters, sizes), so its parameters stay the graph's attributes and later rebinding finds
them, and it carries the tags of the region's nodes under other keys, so an enclosing region of another kind
still contains it.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Hashable

import torch.fx as fx
import torch.nn as nn


def tag(node: fx.Node, key: str) -> Hashable | None:
    """``node.meta["custom"][key]``: the region of that kind ``node`` ran in (None: outside any)."""
    custom = node.meta.get("custom")
    return custom.get(key) if isinstance(custom, dict) else None


def tagged_regions(gm: fx.GraphModule, tag_of: Callable[[fx.Node], Hashable | None]) -> list[list[fx.Node]]:
    """Maximal runs of computing nodes of one tag; an untagged node between two nodes of one tag is in it."""
    compute = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module", "call_method")]
    tags = [tag_of(n) for n in compute]
    for i, t in enumerate(tags):
        if t is None:
            before = next((b for b in reversed(tags[:i]) if b is not None), None)
            after = next((tag_of(n) for n in compute[i + 1:] if tag_of(n) is not None), None)
            if before is not None and before == after:
                tags[i] = before
    runs: list[list[fx.Node]] = []
    last = None
    for node, t in zip(compute, tags):
        if t is None:
            last = None
            continue
        if t != last:
            runs.append([])
        runs[-1].append(node)
        last = t
    return runs


def outline(gm: fx.GraphModule, nodes: list[fx.Node], name: str,
            make: Callable[[fx.GraphModule, dict[str, nn.Module], Hashable], nn.Module],
            key: str | None = None) -> fx.Node:
    """Replace ``nodes`` (one region, in graph order) by ``call_module[name]`` of ``make(region graph, its
    submodules, tag)``; the call node. ``key``: the tag key the region was found by, dropped from the call's
    tags (the others, an enclosing region's, are kept)."""
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
    region = fx.GraphModule(owners, sub, class_name="TaggedRegion")
    gm.add_submodule(name, make(region, owners, tag(nodes[0], key) if key else None))
    with gm.graph.inserting_after(nodes[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    custom = {k: v for k, v in (nodes[0].meta.get("custom") or {}).items() if k != key}
    if custom:
        call.meta["custom"] = custom
    with gm.graph.inserting_after(call):
        for i, o in enumerate(outputs):
            got = gm.graph.call_function(operator.getitem, (call, i))
            got.meta = dict(o.meta)
            o.replace_all_uses_with(got, delete_user_cb=lambda u: u not in inside)
    for n in reversed(nodes):
        gm.graph.erase_node(n)
    return call
