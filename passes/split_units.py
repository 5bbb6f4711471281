"""Pass: split the graph at unit boundaries, so that data parallelism (FSDP) can gather one block at a time.

Each node belongs to the block (``plan.units`` of kind "block") on its ``nn_module_stack``; a node that
carries none (one a pass inserted) and sits between two nodes of the same block belongs to that block too;
everything else is root-level code, grouped by where it runs between the blocks: the code before the first
block runs as the "first" unit (the embeddings), the code after the last as the "last" (final norm, LM
head), where the plan has them. ``torch.fx``'s
``split_module`` cuts the graph there, and each piece is replaced by a
:class:`~autotp.operators.pieces.PieceCall` that reads the piece's parameters from the model when it runs (a
unit's piece through the unit's FSDP forward method), so the top graph keeps no parameter.

Before::

    w0 = get_attr[transformer.h.0.attn.c_attn.weight]
    h0 = aten.linear(x, w0, ...)                    # ... all of block 0
    w1 = get_attr[transformer.h.1.attn.c_attn.weight]
    h1 = aten.linear(y0, w1, ...)                   # ... all of block 1
    logits = aten.linear(y1, wte)                   # root: final norm, LM head, loss

After::

    y0 = autotp_unit_1(x)                           # PieceCall(unit="transformer.h.0"): reads w0 itself
    y1 = autotp_unit_3(y0)                          # PieceCall(unit="transformer.h.1")
    out = autotp_unit_4(y1)                         # PieceCall(unit="transformer.ln_f"): code after the blocks

A model whose units run interleaved (one block's nodes between another's, a block called twice) or that
reads a block's parameter outside the block cannot be cut this way: the pass fails and says where.
"""
from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx
from torch.fx.passes.split_module import split_module

from autotp.plan.pieces import piece_keys
from autotp.plan.plan import Plan
from autotp.operators.pieces import PieceCall


def split_units(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    # with no units: one piece, which still reads its parameters when it runs
    keys = piece_keys(gm, [u.module for u in plan.units if u.kind == "block"])
    owner = {p: u.module for u in plan.units for p in u.params}
    blocks = [u.module for u in plan.units if u.kind == "block"]
    # root-level code before the first block and after the last runs as the edge units, where there are any
    edges = {0: next((u.module for u in plan.units if u.kind == "first"), None),
             2 * len(blocks): next((u.module for u in plan.units if u.kind == "last"), None)}

    def unit(key: int, inputs: tuple[int | str, ...]) -> tuple[str, str | None]:
        unit = blocks[(key - 1) // 2] if key % 2 else edges.get(key)
        foreign = [n for n in inputs if isinstance(n, str) and owner.get(n, unit) != unit]
        if foreign:  # FSDP gathers a unit's parameters only while that unit runs
            raise ValueError(f"{foreign[0]} (of {owner[foreign[0]]}) is read outside its block, by "
                             f"{unit or 'root-level code'}: the graph cannot be cut into one piece per block")
        return f"autotp_unit_{key}", unit

    return split_into_pieces(gm, lambda n: keys[n], unit)


def split_into_pieces(gm: fx.GraphModule, part: Callable[[fx.Node], int],
                      name: Callable[[int, tuple[int | str, ...]], tuple[str, str | None]]) -> fx.GraphModule:
    """``split_module`` of ``gm`` by ``part`` (each computing node's piece key), every piece replaced by a
    :class:`PieceCall` that reads its parameters from the model when it runs; ``name(key, inputs)`` gives the
    piece's attribute name and its unit (or raises when the piece cannot be one). The top graph keeps no
    parameter."""
    top = split_module(gm, gm, part)
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    for node in list(top.graph.nodes):
        if node.op != "call_module" or not str(node.target).startswith("submod_"):
            continue
        key = int(str(node.target).removeprefix("submod_"))
        inputs: list[int | str] = []  # each of the piece's inputs: an index into ``kept``, or a parameter's name
        kept = []
        for arg in node.args:
            if isinstance(arg, fx.Node) and arg.op == "get_attr" and arg.target in params:
                inputs.append(arg.target)
            else:
                inputs.append(len(kept))
                kept.append(arg)
        attr, unit = name(key, tuple(inputs))
        top.add_submodule(attr, PieceCall(top.get_submodule(node.target), unit, tuple(inputs)))
        top.delete_submodule(node.target)
        node.target, node.args = attr, tuple(kept)
    for node in list(top.graph.nodes):
        if node.op == "get_attr" and node.target in params and not node.users:
            top.graph.erase_node(node)
            path, _, leaf = node.target.rpartition(".")
            holder = top.get_submodule(path) if path else top
            holder._parameters.pop(leaf, None)  # the pieces read the model's parameters when they run
    top.delete_all_unused_submodules()
    return top
