"""Which piece of a split graph each node runs in: a block's own piece, or the root-level code between blocks.

Read from the plan's block names and the module stack export records on every node, for the planner (pipeline
stages are balanced over these pieces) and for the passes that cut the graph (FSDP units, pipeline stages).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx


_SKIP = ("placeholder", "get_attr", "output")


def _block_of(node: fx.Node, index: dict[str, int]) -> int | None:
    """The index of the block whose code ``node`` is (export's module stack names it), or None: root-level."""
    for value in (node.meta.get("nn_module_stack") or {}).values():
        if isinstance(value, tuple) and value and value[0] in index:
            return index[value[0]]
    return None


def piece_keys(gm: fx.GraphModule, blocks: list[str]) -> dict[fx.Node, int]:
    """Each computing node's piece: ``2·i + 1`` for block i, ``2·i`` for root-level code after block i − 1
    (0 before the first block). Non-decreasing in graph order, so the pieces run one after another."""
    index = {b: i for i, b in enumerate(blocks)}
    nodes = [n for n in gm.graph.nodes if n.op not in _SKIP]
    tags = [_block_of(n, index) for n in nodes]
    after: list[int | None] = [None] * len(nodes)  # the next tagged node's block
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
                             f"runs after {earlier}: the blocks' code is interleaved, so the graph cannot be "
                             f"cut into one piece per block")
        keys[node], top = key, max(top, key)
        if tags[i] is not None:
            before, last = tags[i], tags[i]
    return keys


# Python's arithmetic on sizes (``s // cp`` of a symbolic length): a size computed from sizes
_SIZE_ARITHMETIC = frozenset({operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv,
                              operator.mod, operator.neg, operator.pow})


def _pure(node: fx.Node, gm: fx.GraphModule | None = None) -> bool:
    """An ATen op that reads its inputs only: no random stream, no write to an input; arithmetic on sizes; a
    module of the rewritten graph that says it is ``recomputable`` (a value of its inputs alone: this rank's
    chunk of an input under context parallelism)."""
    target = node.target
    if node.op == "call_module" and gm is not None:
        return getattr(gm.get_submodule(str(target)), "recomputable", False) is True
    if node.op != "call_function":
        return False
    if target is operator.getitem or target in _SIZE_ARITHMETIC:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags and not target._schema.is_mutable


def recomputable(gm: fx.GraphModule) -> set[fx.Node]:
    """The values made from graph inputs, buffers and constants alone by pure ops (no parameter, no random
    op): a pipeline stage that reads one computes it again rather than receive it, as Megatron makes its
    masks and rotary tables in every stage (attention masks, rotary cos/sin, position ids)."""
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node.op == "get_attr" and node.target not in params:
            out.add(node)
        elif _pure(node, gm) and all(a in out for a in node.all_input_nodes):
            out.add(node)
    return {n for n in out if n.op in ("call_function", "call_module")}
