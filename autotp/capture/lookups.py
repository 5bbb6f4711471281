"""Row reads of a 2-D parameter by integer ids as the embedding lookups they are, so analysis finds a token
table written as a raw ``nn.Parameter`` like an ``nn.Embedding`` (vocab-parallel, tied to a head ``x @ E.T``).

``E[ids]`` (``aten.index.Tensor(E, [ids])``) and ``E.index_select(0, ids)`` of a parameter E [V, h] by an
integer tensor ids [...] give ``E``'s rows, [..., h]: ``aten.embedding(E, ids)`` computes the same values, and
its backward sums each id's output gradients into that row as index's does. Only ids that are tensors of
int64/int32 (what embedding accepts), one index on dim 0; a bool mask, several index tensors, or a 1-D or
3-D parameter are left as they are, and so are ids computed from the model's parameters (a router's top-k
choice reading an expert's bias by expert index: a selection the expert analysis owns, not a vocabulary of
tokens). An id outside [0, V) (index counts a negative one from the end) is an
error of the lookup, as it is of ``nn.Embedding``.

Before::

    x = aten.index.Tensor(wte, [idx])          # wte [V, h], idx [b, s] int64 -> [b, s, h]

After::

    x = aten.embedding.default(wte, idx)
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

_IDS = (torch.int64, torch.int32)


def _table(gm: fx.GraphModule, node: object) -> bool:
    """Is ``node`` a 2-D floating parameter read whole (a ``get_attr`` of one of ``gm``'s parameters)?"""
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return False
    try:
        p = gm.get_parameter(node.target)
    except AttributeError:  # a buffer or constant: not a weight the plan cuts
        return False
    return p.dim() == 2 and p.dtype.is_floating_point


def _ids(node: fx.Node) -> fx.Node | None:
    """The ids of a row read of a 2-D table: ``index.Tensor(E, [ids])`` or ``index_select(E, 0, ids)``."""
    if node.target is aten.index.Tensor and len(node.args[1]) == 1:
        ids = node.args[1][0]
    elif node.target is aten.index_select.default and node.args[1] in (0, -2):
        ids = node.args[2]
    else:
        return None
    val = ids.meta.get("val") if isinstance(ids, fx.Node) else None
    return ids if isinstance(val, torch.Tensor) and val.dtype in _IDS else None


def _from_parameters(gm: fx.GraphModule, ids: fx.Node) -> bool:
    """Does ``ids`` depend on any of ``gm``'s parameters (a router's choice), rather than on inputs alone?"""
    params = {name for name, _ in gm.named_parameters()}
    seen, todo = set(), [ids]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "get_attr" and node.target in params:
            return True
        todo.extend(node.all_input_nodes)
    return False


def row_reads_as_embeddings(gm: fx.GraphModule) -> bool:
    """Rewrite the row reads described in the module doc, in place; whether any was."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not _table(gm, node.args[0] if node.args else None):
            continue
        ids = _ids(node)
        if ids is None or _from_parameters(gm, ids):
            continue
        with gm.graph.inserting_before(node):
            emb = gm.graph.call_function(aten.embedding.default, (node.args[0], ids))
        emb.meta = dict(node.meta)
        node.replace_all_uses_with(emb)
        gm.graph.erase_node(node)
        changed = True
    return changed
