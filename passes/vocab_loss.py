"""Pass: cross-entropy over vocab-parallel logits, without gathering them.

Before::

    loss = aten.cross_entropy_loss(logits, targets, None, 1, -1)    # logits: (n, V)
    # or
    lp = aten.log_softmax(logits, -1); lp2 = aten.flatten(lp, 0, 1)
    loss = aten.nll_loss_nd(lp2, targets, None, 1, -100)

After::

    loss = autotp_vocab_ce_loss(logits, targets)                    # logits: (n, V/t); 3 all-reduces of n
    # or
    lp2 = aten.flatten(logits, 0, 1)                                # log_softmax folded into the loss
    loss = autotp_vocab_ce_loss(lp2, targets)

N-d logits with the classes on dim 1 (``cross_entropy(logits.transpose(1, 2), targets)``: (b, V/t, s) here) go
to the same loss, which reads them as (b·s, V/t) rows and gives ``reduction="none"`` the targets' shape.

Logits of a padded head cropped in the model (``lm_head(x)[..., :V]``): the loss's rows know the V classes and
leaves each rank's columns at class ids >= V out of the row max, the exp-sum and the target term.
"""
from __future__ import annotations

import torch.fx as fx

from autotp.plan.plan import Plan
from autotp.operators.vocab_ops import VocabCrossEntropy


def vocab_loss(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    nodes = {n.name: n for n in gm.graph.nodes}
    for loss in plan.vocab.losses:
        node = nodes[loss.node]
        if loss.log_softmax is not None:
            lsm = nodes[loss.log_softmax]
            lsm.replace_all_uses_with(lsm.args[0])
            gm.graph.erase_node(lsm)
        target = f"autotp_vocab_ce_{loss.node}"
        gm.add_submodule(target, VocabCrossEntropy(loss.rows, loss.reduction, loss.ignore_index,
                                                   loss.label_smoothing))
        node.op, node.target = "call_module", target
        node.args, node.kwargs = node.args[:2], {}
    return gm
