"""Pass: hand vocab-parallel logits back to the user as the full tensor, gathered only when read.

Before::

    return (logits, loss)                                   # logits: (b, s, V/t) local, padded

After::

    logits_out = autotp_vocab_output_logits(logits)         # (b, s, V) gathered on first use; no communication
    return (logits_out, loss)

A head padded past the vocabulary and cropped in the model (``lm_head(x)[..., :V]``) returns the crop, which the
plan made the identity on the local logits: each rank's columns at class ids >= V are padding, and the gathered
tensor has V classes, as the unsharded model's has.
"""
from __future__ import annotations

import torch.fx as fx

from autotp.plan.plan import Plan
from autotp.operators.vocab_ops import VocabOutput


def vocab_output(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    if not plan.vocab.outputs:
        return gm
    nodes = {n.name: n for n in gm.graph.nodes}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for name, dim, rows in plan.vocab.outputs:
        node = nodes[name]
        target = f"autotp_vocab_output_{name}"
        gm.add_submodule(target, VocabOutput(rows, dim))
        with gm.graph.inserting_before(output):
            wrapped = gm.graph.call_module(target, (node,))
        wrapped.meta = dict(node.meta)
        output.replace_input_with(node, wrapped)
    return gm
