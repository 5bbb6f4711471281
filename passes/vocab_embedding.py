"""Pass: vocab-parallel token embeddings.

Before::

    emb = aten.embedding(wte_weight, idx)                     # (b, s, h), wte: (V, h)

After::

    emb_local = autotp_vocab_embedding_emb(wte_weight, idx)   # rows this rank owns, others zero; wte: (V/t, h)
    emb = autotp_leave(emb_local)                             # all-reduce (sum)
    # or, with sequence parallelism:
    emb = autotp_seq_leave_1(emb_local)                       # reduce-scatter: (b, s/t, h)
"""
from __future__ import annotations

import torch.fx as fx

from autotp.passes.insert_collectives import LEAVE, ensure_collective_modules, seq_leave
from autotp.plan.plan import Plan
from autotp.operators.vocab_ops import VocabEmbedding


def vocab_embedding(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    if not plan.vocab.embeddings:
        return gm
    ensure_collective_modules(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, rows in plan.vocab.embeddings:
        node = nodes[name]
        target = f"autotp_vocab_embedding_{name}"
        gm.add_submodule(target, VocabEmbedding(rows))
        node.op, node.target = "call_module", target
        leave = plan.sequence.leave(name) if plan.sequence is not None else None
        if leave is not None:  # sequence parallelism: reduce-scatter along the sequence
            seq_leave(gm, node, leave.dim, name)
            continue
        with gm.graph.inserting_after(node):
            g = gm.graph.call_module(LEAVE, (node,))
        g.meta = {**node.meta, "autotp_collective": ("leave", name)}
        node.replace_all_uses_with(g, delete_user_cb=lambda u: u is not g)
    return gm
