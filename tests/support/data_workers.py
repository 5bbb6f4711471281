"""Ranks of one TP group must see the same batch: workers for tests/runtime/test_data.py."""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

import autotp


def _raises(fn) -> str:
    try:
        fn()
    except autotp.InputMismatchError as e:
        return str(e)
    return ""


def mismatch_and_broadcast() -> dict:
    from nanogpt import build_model, example_batch

    rank = dist.get_rank()
    group = dist.group.WORLD
    idx, targets = example_batch()
    batch = {"ids": idx, "extra": (targets.float() / 7, torch.tensor(rank))}
    out = {"same_ok": _raises(lambda: autotp.check_same_inputs((idx,), {"targets": targets}, group)) == ""}
    out["differs"] = _raises(lambda: autotp.check_same_inputs((idx,), {"batch": batch}, group))
    shuffled = idx.flip(0) if rank == 1 else idx  # same values, other order on rank 1
    out["order"] = _raises(lambda: autotp.check_same_inputs((shuffled,), {}, group))
    sent = autotp.broadcast_batch(batch if rank == 0 else None)
    out["broadcast_equal"] = bool(torch.equal(sent["ids"], idx) and torch.equal(sent["extra"][0], targets.float() / 7)
                                  and int(sent["extra"][1]) == 0 and sent["ids"].dtype == torch.long)

    # a model whose TP ranks get different batches refuses before computing with them
    ref = build_model()
    model = autotp.parallelize(copy.deepcopy(ref), example_inputs=(idx, targets))
    g = torch.Generator().manual_seed(100 + rank)  # a per-rank loader: the trap
    mine = (torch.randint(0, 256, idx.shape, generator=g), torch.randint(0, 256, idx.shape, generator=g))
    before = [p.detach().clone() for p in model.parameters()]
    out["model_refuses"] = _raises(lambda: model(*mine))
    out["untouched"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # Megatron's way: tp rank 0's batch for the whole group, then training is exact
    x, y = autotp.broadcast_batch(mine)
    opt, ropt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    diffs = []
    for _ in range(3):
        _, loss = model(x, y)
        _, rloss = ref(x, y)
        diffs.append(abs(loss.item() - rloss.item()))
        for o, l in ((opt, loss), (ropt, rloss)):
            o.zero_grad()
            l.backward()
            o.step()
    out["loss_diff"] = max(diffs)
    return out


def dp_sampling() -> dict:
    """tp 2 × dp 2 under the layout ``autotp run`` sets up."""
    from autotp.distributed.job import RankJob
    from autotp.distributed.rank_grid import RankGrid

    os.environ.update(RankJob(RankGrid.build(4, 2, dp=2)).env())
    from autotp.distributed.launch import current_tp_group

    group = current_tp_group()
    sampler = autotp.dp_sampler(list(range(16)), shuffle=True, seed=3)
    batch = autotp.broadcast_batch({"x": torch.full((2,), float(dist.get_rank()))})
    return {"dp_rank": autotp.dp_rank(), "dp_size": autotp.dp_size(), "indices": list(iter(sampler)),
            "tp_members": dist.get_process_group_ranks(group), "got": batch["x"].tolist()}
