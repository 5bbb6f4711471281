"""This rank's tensors, as a plan cuts them: each sharded parameter and buffer replaced in place by its slice
(ties kept: one Parameter per original Parameter, under every name), other pipeline stages' parameters
dropped to meta, whatever is still on meta allocated for a load to fill."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from autotp.io.empty import allocate_meta, empty_shard, swap_tensors
from autotp.parallel.grads import mark_sharded_grad, norm_info
from autotp.plan.plan import ParamShard, Plan
from autotp.operators.collectives import all_reduce
from autotp.shard_spec import local_indices, local_runs
from autotp.state import TPState


def hold(model: nn.Module, st: TPState, plan: Plan, fresh: list[str]) -> None:
    """Give the model this rank's tensors as ``plan`` cuts them: its shards (once; a later signature's plan
    is only checked against them), other stages' parameters dropped, whatever is still on meta allocated.
    ``fresh``: the names that were on meta before, unloaded with those until a load fills them."""
    if not st.shards and (plan.params or plan.buffers):
        _shard_in_place(model, st, plan)
        _shard_buffers_in_place(model, st, plan)
    if st.dropped:
        _drop(model, st.dropped)
    # a model built on meta holds uninitialised memory until a load fills it: every name it had on meta
    st.unloaded = tuple(dict.fromkeys([*st.unloaded, *fresh, *allocate_meta(model, st.device, keep=st.dropped)]))


def other_stages(model: nn.Module, read: set[str]) -> frozenset[str]:
    """Every name of a parameter none of ``read`` (this rank's stages' names for it) refers to."""
    mine = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in read}
    return frozenset(n for n, p in model.named_parameters(remove_duplicate=False) if id(p) not in mine)


def _drop(model: nn.Module, names: frozenset[str]) -> None:
    """The parameters named in ``names`` (other ranks' pipeline stages) go to the meta device, shape kept."""
    ids = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in names}

    def meta(p: torch.Tensor) -> nn.Parameter | None:
        if id(p) not in ids or p.is_meta:
            return None
        return nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)

    swap_tensors(model, "parameters", meta)


def _by_id(named, own: dict[str, ParamShard]) -> tuple[dict[int, ParamShard], dict[int, list[str]]]:
    """Each tensor's shard and all its names (tied tensors appear under several)."""
    by_id: dict[int, ParamShard] = {}
    names: dict[int, list[str]] = {}
    for name, t in named:
        names.setdefault(id(t), []).append(name)
        if name in own:
            by_id[id(t)] = own[name]
    return by_id, names


def _swap_shards(model: nn.Module, st: TPState, kind: str, own: dict[str, ParamShard],
                 local_of: Callable[[torch.Tensor, ParamShard, list[str]], torch.Tensor]) -> None:
    """Replace every tensor of ``kind`` ("parameters" or "buffers") that ``own`` cuts, in every module that
    holds it (tied ones under each name), by ``local_of(tensor, its shard, its names)``; each name's shard and
    full shape (a meta tensor) are recorded in ``st``."""
    named = model.named_parameters(remove_duplicate=False) if kind == "parameters" else \
        model.named_buffers(remove_duplicate=False)
    by_id, names = _by_id(named, own)

    def local(t: torch.Tensor) -> torch.Tensor | None:
        shard = by_id.get(id(t))
        if shard is None:
            return None
        full = torch.empty(t.shape, dtype=t.dtype, device="meta")
        if kind == "parameters":
            full = nn.Parameter(full, requires_grad=t.requires_grad)
        for name in names[id(t)]:
            st.shards[name] = shard
            st.full[name] = full
        return local_of(t, shard, names[id(t)])

    swap_tensors(model, kind, local)


def _shard_in_place(model: nn.Module, st: TPState, plan: Plan) -> None:
    """Replace every sharded Parameter, in every module that holds it, by this rank's slice."""

    def local(p: torch.Tensor, shard: ParamShard, names: list[str]) -> nn.Parameter:
        with torch.no_grad():
            if any(n in st.dropped for n in names):  # another rank's pipeline stage: shape only
                data = torch.empty(shard.local_shape, dtype=p.dtype, device="meta")
            elif p.is_meta:  # a model built on meta: this rank's shard, allocated, not initialised
                data = empty_shard(shard, p.dtype, st.device, st.rank)
            else:
                data = shard.shard(p.detach(), st.tp, st.rank)
                if data.untyped_storage().data_ptr() == p.untyped_storage().data_ptr():
                    data = data.clone()
        new = nn.Parameter(data, requires_grad=p.requires_grad)
        if data.is_meta:
            return new
        if shard.replicated_blocks(st.tp) and p.requires_grad:
            _sum_replicated_grads(st, new, shard)
        if p.requires_grad:  # clip_grad_norm_ in the user's script sees the full gradient's norm
            mark_sharded_grad(new, norm_info(shard, st.tp, st.group))
        return new

    _swap_shards(model, st, "parameters", dict(plan.params), local)


def _shard_buffers_in_place(model: nn.Module, st: TPState, plan: Plan) -> None:
    """Replace every sharded buffer (a KV cache written with sharded keys) by this rank's slice."""

    def local(b: torch.Tensor, shard: ParamShard, names: list[str]) -> torch.Tensor:
        return shard.shard(b, st.tp, st.rank) if not b.is_meta else \
            torch.empty(shard.local_shape, dtype=b.dtype, device="meta")

    _swap_shards(model, st, "buffers", dict(plan.buffers), local)


def _sum_replicated_grads(st: TPState, param: nn.Parameter, shard: ParamShard) -> None:
    """Blocks held by several ranks (kv heads < tp) get partial gradients there: sum them over those ranks."""
    ranks = dist.get_process_group_ranks(st.group)
    first = [local_indices(shard.segments, st.tp, r) for r in range(st.tp)]  # global index of each local element
    pieces = []
    for p in local_runs(shard.segments, st.tp):
        if p.copies > 1:
            members = [ranks[r] for r in range(st.tp) if first[r][p.start] == first[st.rank][p.start]]
            pieces.append((p.start, p.length, dist.new_group(members, use_local_synchronization=True)))
    dim = shard.dim

    def hook(grad: torch.Tensor | None) -> torch.Tensor | None:
        if grad is None:  # no gradient reached the weight on any rank (its output unread): nothing to sum
            return None
        grad = grad.clone()
        for start, length, sub in pieces:
            part = grad.narrow(dim, start, length)
            part.copy_(all_reduce(part.contiguous(), sub))
        return grad

    param.register_hook(hook)
