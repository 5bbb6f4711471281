"""Rank functions of tests/runtime/test_island_backward.py: what an island's backward communicates, and whether a
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


def fsdp_island_parity(style: str, tp: int = 2, steps: int = 3) -> dict:
    """``style`` under FSDP over dp × autotp over tp (each data-parallel replica on its half of the batch),
    against the unsharded model on the whole batch: losses and parameters after AdamW steps."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_workers import _full, _side_by_side

    ref, (x, y) = build(style)
    dp = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    d = mesh["dp"].get_local_rank()
    xs, ys = x.chunk(dp)[d], y.chunk(dp)[d]
    model = autotp.parallelize(copy.deepcopy(ref), example_inputs=(xs, ys), fsdp=True, mesh=mesh)
    opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (model, ref))
    out = {"loss": 0.0, "units": list(autotp.tp_state(model).units or ())}
    for _ in range(steps):
        loss = model(xs, ys)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())
        rloss = ref(x, y)[1]
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        out["loss"] = max(out["loss"], abs(mean.item() / dp - rloss.item()))
    refs = dict(ref.named_parameters())
    out["param"] = max((_full(p).detach() - _side_by_side(refs[n].detach(), n, model)).abs().max().item()
                       for n, p in model.named_parameters())
    return out


def expert_parallel_islands(style: str) -> dict:
    """``style`` parallelized with ``expert_parallel=True``: what autotp says, and the loss against the
    unsharded model's."""
    import warnings

    ref, (x, y) = build(style)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = autotp.parallelize(build(style)[0], example_inputs=(x, y), expert_parallel=True)
    return {"loss": (model(x, y)[1] - ref(x, y)[1]).abs().item(),
            "said": [str(w.message) for w in caught if "expert_parallel" in str(w.message)]}
