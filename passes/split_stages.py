"""Pass: split the graph into pipeline stages, one piece per stage (``plan.stages``).

Each computing node belongs to the stage of its block (:func:`~autotp.plan.pieces.unit_keys`); root-level
code between two blocks runs with the block after it, the code before the first block in the first stage
and the code after the last block in the last. ``torch.fx``'s ``split_module`` cuts the graph there: each
piece takes the graph inputs it reads and the values earlier pieces computed, and is replaced by a
:class:`~autotp.runtime.units.PieceCall` that reads its parameters from the model when it runs (a rank
holds only its own stages' parameters). :mod:`autotp.runtime.stages` turns the top graph into the modules
``torch.distributed.pipelining`` runs.

Before::

    h = aten.embedding(wte, idx)                    # the embeddings
    ...                                             # blocks 0-1
    ...                                             # blocks 2-3
    loss = autotp_vocab_loss(aten.linear(y, wte), targets)

After (two stages)::

    x = autotp_stage_0(idx)                         # PieceCall: embeddings and blocks 0-1, reads wte, h.0, h.1
    loss = autotp_stage_1(x, targets)               # PieceCall: blocks 2-3, final norm, LM head, loss
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from autotp.plan.pieces import unit_keys
from autotp.plan.plan import Plan
from autotp.plan.stages import stage_of_key
from autotp.runtime.units import PieceCall

from autotp.runtime.stages import STAGE_PREFIX


def split_stages(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    blocks, stage = stage_of_key(plan.stages)
    keys = unit_keys(gm, blocks)
    top = split_module(gm, gm, lambda n: stage[min(keys[n] // 2, len(blocks) - 1)])
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    for node in list(top.graph.nodes):
        if node.op != "call_module" or not str(node.target).startswith("submod_"):
            continue
        index = int(str(node.target).removeprefix("submod_"))
        layout: list[int | str] = []
        kept = []
        for arg in node.args:
            if isinstance(arg, fx.Node) and arg.op == "get_attr" and arg.target in params:
                layout.append(arg.target)
            else:
                layout.append(len(kept))
                kept.append(arg)
        name = f"{STAGE_PREFIX}{index}"
        top.add_submodule(name, PieceCall(top.get_submodule(node.target), None, tuple(layout)))
        top.delete_submodule(node.target)
        node.target, node.args = name, tuple(kept)
    for node in list(top.graph.nodes):
        if node.op == "get_attr" and not node.users:
            top.graph.erase_node(node)
            path, _, leaf = node.target.rpartition(".")
            owner = top.get_submodule(path) if path else top
            owner._parameters.pop(leaf, None)  # the top graph keeps no parameter: the pieces read the model's
    _check_tensors(top)
    top.delete_all_unused_submodules()
    return top


def _check_tensors(top: fx.GraphModule) -> None:
    """What crosses from one stage to another travels point to point: it must be a tensor."""
    for node in top.graph.nodes:
        if node.op != "call_module":
            continue
        for arg in node.args:
            if isinstance(arg, fx.Node) and arg.op != "placeholder":
                val = arg.meta.get("val")
                if val is not None and not isinstance(val, torch.Tensor):
                    raise ValueError(f"{arg.name} ({type(val).__name__}) crosses into {node.target}: only tensors "
                                     "pass between pipeline stages")
