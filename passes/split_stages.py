"""Pass: split the graph into pipeline stages, one piece per stage (``plan.stages``).

Each computing node belongs to the stage of its block (:func:`~autotp.plan.pieces.piece_keys`); root-level
code between two blocks runs with the block after it, the code before the first block in the first stage
and the code after the last block in the last. A value made from the graph's inputs and buffers alone
(an attention mask, rotary tables: :func:`~autotp.plan.pieces.recomputable`) is computed again in each
stage that reads it, so only what the blocks compute (the hidden state) crosses a cut. ``torch.fx``'s ``split_module`` cuts the graph there: each
piece takes the graph inputs it reads and the values earlier pieces computed, and is replaced by a
:class:`~autotp.operators.pieces.PieceCall` that reads its parameters from the model when it runs (a rank
holds only its own stages' parameters). :mod:`autotp.operators.stages` turns the top graph into the modules
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

from autotp.passes.split_units import split_into_pieces
from autotp.plan.pieces import recomputable, piece_keys
from autotp.plan.plan import Plan
from autotp.plan.stages import stage_of_key
from autotp.operators.stages import STAGE_PREFIX


def split_stages(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    blocks, stage = stage_of_key(plan.stages)
    keys = piece_keys(gm, blocks)
    of = {n: stage[min(k // 2, len(blocks) - 1)] for n, k in keys.items()}
    _recompute_in_stages(gm, of)
    top = split_into_pieces(gm, lambda n: of[n], lambda key, _: (f"{STAGE_PREFIX}{key}", None))
    _check_tensors(top)
    return top


def _recompute_in_stages(gm: fx.GraphModule, of: dict[fx.Node, int]) -> None:
    """A value made from the graph's inputs and buffers alone (a mask, rotary tables) that a later stage reads
    is computed again there, from its own copy of the inputs, instead of being sent. The copies a stage needs go
    together, in the model's order, just before the first of its nodes that reads one: so an autocast or
    checkpointed region they come from stays one run of nodes, holding none of the stage's own ops (copies
    put before each reader would leave the stage's ops between two of the region's, and those would run
    under the region's autocast). ``of`` (each node's stage) gets the copies."""
    again = recomputable(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    wanted: dict[int, set[fx.Node]] = {}  # stage -> the values (and their inputs) it computes again
    first: dict[int, fx.Node] = {}  # stage -> its first node that reads one

    def want(node: fx.Node, s: int) -> None:
        if node in again and of.get(node) != s and node not in wanted[s]:
            wanted[s].add(node)
            for a in node.all_input_nodes:
                want(a, s)

    for node in gm.graph.nodes:
        s = of.get(node)
        for arg in node.all_input_nodes if s is not None else ():
            if arg in again and of[arg] < s:
                wanted.setdefault(s, set())
                first.setdefault(s, node)
                want(arg, s)
    copies: dict[tuple[fx.Node, int], fx.Node] = {}
    for s, nodes in wanted.items():
        with gm.graph.inserting_before(first[s]):
            for node in sorted(nodes, key=order.__getitem__):
                made = gm.graph.node_copy(node, lambda a: copies.get((a, s), a))
                made.meta = dict(node.meta)
                of[made] = s
                copies[(node, s)] = made
    copied = set(copies.values())
    for node in list(gm.graph.nodes):
        s = of.get(node)
        if s is None or node in copied:
            continue
        for arg in node.all_input_nodes:
            if arg in again and of[arg] < s:
                node.replace_input_with(arg, copies[(arg, s)])
    for node in reversed(list(gm.graph.nodes)):
        if node in again and not node.users:
            gm.graph.erase_node(node)
            of.pop(node, None)


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
