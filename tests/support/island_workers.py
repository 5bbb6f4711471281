"""Rank functions of tests/test_island_backward.py: what an island's backward communicates, and whether a
mixture-of-experts loop trains exactly with dropout inside its experts."""
from __future__ import annotations

import torch

import autotp
from moe_island_models import build
from parity_workers import _local, _max_diff
from ranks import CollectiveLog


def backward_collectives(style: str) -> dict:
    """The all-reduces of one training step's backward of ``style`` (tests/support/moe_island_models.py),
    parallelized over the group: (reduce op, elements) each, in order; the islands' whole parameters; and the
    largest difference of a gradient from the unsharded model's."""
    ref, (x, y) = build(style)
    model = autotp.parallelize(build(style)[0], example_inputs=(x, y))
    model(x, y)[1].backward()  # the first call: captured, its inputs checked
    model.zero_grad(set_to_none=True)
    loss = model(x, y)[1]
    log = CollectiveLog()
    with log:
        loss.backward()
    st = autotp.tp_state(model)
    ref(x, y)[1].backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    return {"backward": [(op, n) for name, op, n in log.calls if name == "all_reduce"],
            "islands": {p: list(plan.whole_params) for p, plan in st.islands.items()},
            "grad": max(_max_diff(p.grad, _local(grads[n], n, model)) for n, p in model.named_parameters()),
            "cut": sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in ref.parameters())}
