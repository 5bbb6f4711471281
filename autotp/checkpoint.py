"""Consolidated checkpoints: the unsharded model's state dict from a parallelized one, and back.

``full_state_dict`` gathers every sharded parameter over the tensor-parallel group (one all-gather per
parameter, on every rank) and returns it with the original names and un-padded shapes, so the unsharded
model's ``load_state_dict`` accepts it. ``load_full_state_dict`` cuts each rank's slice out of such a dict.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from autotp.plan import ParamShard
from autotp.runtime import TPModule


def _shards_by_name(module: TPModule) -> dict[str, ParamShard]:
    """Every state-dict name of a sharded parameter -> its shard (tied names share one)."""
    by_id: dict[int, ParamShard] = {}
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, shard in module._autotp["shards"].items():
        by_id[id(params[name])] = shard
    return {name: by_id[id(p)] for name, p in params.items() if id(p) in by_id}


def full_state_dict(module: TPModule) -> dict[str, torch.Tensor]:
    """The unsharded state dict (CPU tensors) of ``module``; a collective: call it on every TP rank."""
    shards = _shards_by_name(module)
    st = module._autotp
    gathered: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        shard = shards.get(name)
        if shard is None or st["tp"] == 1:
            out[name] = tensor.detach().cpu().clone()
            continue
        if id(tensor) not in gathered:
            local = tensor.detach().contiguous()
            buf = local.new_empty(st["tp"] * local.numel())
            dist.all_gather_into_tensor(buf, local.flatten(), group=st["group"])
            gathered[id(tensor)] = shard.unshard(list(buf.view(st["tp"], *local.shape).unbind(0)), st["tp"]).cpu()
        out[name] = gathered[id(tensor)]
    return out


def load_full_state_dict(module: TPModule, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Copy each rank's slice of an unsharded ``state_dict`` into ``module`` (no communication)."""
    shards = _shards_by_name(module)
    st = module._autotp
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise KeyError(f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, tensor in own.items():
            if name not in state_dict:
                continue
            full = state_dict[name].to(device=tensor.device, dtype=tensor.dtype)
            shard = shards.get(name)
            local = full if shard is None else shard.shard(full, st["tp"], st["rank"])
            if local.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(full.shape)} gives a local shard "
                                 f"{tuple(local.shape)}, the model holds {tuple(tensor.shape)} (tp={st['tp']})")
            tensor.copy_(local)
