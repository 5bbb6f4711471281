"""Ranks of the data-parallel tests (tests/runtime/test_replicas.py): tp 2 × dp 2 on a (dp, tp) mesh, each replica on
its own half of every global batch, against the unsharded model trained on the whole batch."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# BATCH per replica. eps 1e-6: Adam's first steps divide each gradient by its own size plus eps, so with
# torch's 1e-8 the fp32 rounding of the smallest gradients (summed in another order) moves parameters by ~lr
BATCH, STEPS, LR, EPS = 2, 3, 1e-3, 1e-6


class GroupLog(TorchDispatchMode):
    """Every eager all-reduce (``c10d::allreduce_``: autotp's and DDP's reducer's buckets alike) as (global
    ranks of its group, elements); functional all-reduces (a compiled graph's) as ("functional", elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[int, ...] | str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d" and name == "allreduce_":
            ranks = tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(args[1])))
            self.calls.append((ranks, sum(t.numel() for t in args[0])))
        elif func.namespace == "_c10d_functional" and name == "all_reduce":
            self.calls.append(("functional", args[0].numel()))
        return func(*args, **(kwargs or {}))


def _batches(config) -> tuple[torch.Tensor, torch.Tensor]:
    """(steps, 2·BATCH, block) ids and targets: every rank draws the same global batches."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, config.vocab_size, (STEPS, 2 * BATCH, config.block_size + 1), generator=g)
    return ids[..., :-1].contiguous(), ids[..., 1:].contiguous()


def train(mode: str, tp: int = 2) -> dict:
    """``mode``: "default" (parallelize on a (dp 2, tp) mesh, nothing else), "compile" (the same with
    ``compile=True``: DDP's hooks around the compiled graph), "script" (the script wraps it in its
    own DDP over the mesh's dp group), "off" (``data_parallel=False``), "context" (a (dp, cp) mesh, each
    replica's sequences in two chunks: gradients summed over cp in the backward, then averaged over dp),
    "context, no mesh" (the same on the groups ``context_parallel=2`` alone makes).
    Per rank: each step's all-reduces over the dp group and over other groups (elements), the largest
    difference of each gradient (last step) and each parameter (after the steps) from the unsharded model's
    on the whole batch, and whether the parameters are bit-identical across the dp replicas."""
    from nanogpt_model import GPT, GPTConfig
    from torch.distributed.device_mesh import init_device_mesh

    import autotp

    context = mode.startswith("context")
    mesh = None if mode == "context, no mesh" else \
        init_device_mesh("cpu", (2, 2 if context else tp), mesh_dim_names=("dp", "cp" if context else "tp"))
    config = GPTConfig()
    torch.manual_seed(0)
    model = GPT(config)
    ref = copy.deepcopy(model)
    ids, targets = _batches(config)
    autotp.parallelize(model, mesh=mesh, data_parallel=mode != "off", context_parallel=2 if context else 1,
                       compile=mode == "compile",
                       example_inputs=(ids[0, :BATCH], targets[0, :BATCH]))  # the one signature trained
    st = autotp.tp_state(model)
    # without a mesh: the world cut into cp groups of consecutive ranks, replicas the rest (ranks 0, 2 / 1, 3)
    dp_group = mesh["dp"].get_group() if mesh is not None else st.replicas.group
    dp_rank = dist.get_rank(dp_group)
    call = model
    if mode == "script":
        call = torch.nn.parallel.DistributedDataParallel(model, process_group=dp_group)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR, eps=EPS) for m in (model, ref))
    mine = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)
    logs = []
    for step in range(STEPS):
        with GroupLog() as log:
            _, loss = call(ids[step, mine].contiguous(), targets[step, mine].contiguous())
            loss.backward()
        logs.append(log.calls)
        _, ref_loss = ref(ids[step], targets[step])  # the mean over the whole batch: the replicas' means' mean
        ref_loss.backward()
        if step == STEPS - 1:
            grads = _differences(model, ref, st, lambda p: p.grad)
        opt.step(), ref_opt.step()
        opt.zero_grad(set_to_none=True), ref_opt.zero_grad(set_to_none=True)
    params = _differences(model, ref, st, lambda p: p.detach())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat, group=dp_group)
    trained = {id(p): p for p in model.parameters() if p.requires_grad}
    dp_ranks = tuple(dist.get_process_group_ranks(dp_group))
    return {
        "kind": st.replicas.kind, "dp_ranks": dp_ranks, "tp_ranks": tuple(dist.get_process_group_ranks(st.group)),
        "grad_elements": sum(p.numel() for p in trained.values()), "params": len(trained),
        "dp_calls": [[n for ranks, n in calls if ranks == dp_ranks] for calls in logs],
        "tp_calls": [[(ranks, n) for ranks, n in calls if ranks != dp_ranks] for calls in logs],
        "grads": grads, "diffs": params,
        "identical": bool(torch.equal(gathered[0], gathered[1])),
        "differing": sum(not torch.equal(a, b) for a, b in zip(*(g.split([p.numel() for p in model.parameters()])
                                                                 for g in gathered))),
    }


def _differences(model, ref, st, value) -> dict[str, float]:
    """Per parameter: max |this rank's value - the matching slice of the unsharded model's|."""
    out = {}
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        full = value(theirs[name])
        shard = st.shards.get(name)
        want = full if shard is None else shard.shard(full, st.tp, st.rank)
        out[name] = (value(p) - want).abs().max().item()
    return out


def refused_over_the_world() -> str:
    """The script wraps the model in a DDP over every rank (its default group): refused at its first call."""
    from nanogpt_model import GPT, GPTConfig
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    from autotp.errors import ProcessGroupError

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    config = GPTConfig()
    torch.manual_seed(0)
    ids, targets = _batches(config)
    model = autotp.parallelize(GPT(config), mesh=mesh, example_inputs=(ids[0, :BATCH], targets[0, :BATCH]))
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    try:
        wrapped(ids[0, :BATCH], targets[0, :BATCH])
    except ProcessGroupError as e:
        return str(e)
    return ""
