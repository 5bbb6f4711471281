"""Which piece of a split graph each node runs in: a block's own piece, or the root-level code between blocks.

Read from the plan's block names and the module stack export records on every node, for the planner (pipeline
stages are balanced over these pieces) and for the passes that cut the graph (FSDP units, pipeline stages).
"""
from __future__ import annotations

import torch.fx as fx


_SKIP = ("placeholder", "get_attr", "output")


def _unit_of(node: fx.Node, units: dict[str, int]) -> int | None:
    for value in (node.meta.get("nn_module_stack") or {}).values():
        if isinstance(value, tuple) and value and value[0] in units:
            return units[value[0]]
    return None


def unit_keys(gm: fx.GraphModule, blocks: list[str]) -> dict[fx.Node, int]:
    """Each computing node's piece: ``2·i + 1`` for block i, ``2·i`` for root-level code after block i − 1
    (0 before the first block). Non-decreasing in graph order, so the pieces run one after another."""
    units = {b: i for i, b in enumerate(blocks)}
    nodes = [n for n in gm.graph.nodes if n.op not in _SKIP]
    tags = [_unit_of(n, units) for n in nodes]
    after: list[int | None] = [None] * len(nodes)  # the next tagged node's unit
    nxt = None
    for i in range(len(nodes) - 1, -1, -1):
        after[i] = nxt
        nxt = tags[i] if tags[i] is not None else nxt
    keys, last, before, top = {}, -1, None, 0
    for i, node in enumerate(nodes):
        tag = tags[i] if tags[i] is not None else (before if before is not None and before == after[i] else None)
        key = 2 * tag + 1 if tag is not None else 2 * (last + 1)
        if key < top:
            earlier = blocks[last] if last >= 0 else "root-level code"
            raise ValueError(f"{node.name} ({blocks[tag] if tag is not None else 'root-level code'}) "
                             f"runs after {earlier}: the units' code is interleaved, so the graph cannot be "
                             f"cut into one piece per unit")
        keys[node], top = key, max(top, key)
        if tags[i] is not None:
            before, last = tags[i], tags[i]
    return keys
