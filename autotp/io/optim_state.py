"""The optimizer's state in the weights' global coordinates, so that it reshards like them.

torch's ``get_optimizer_state_dict`` gives the state keyed by parameter name (and initialises it when the
optimizer has not stepped yet), but autotp's parameters are plain local shards, so each tensor is only this
rank's slice. :func:`optimizer_state` gives every state tensor of a parameter's shape (AdamW's ``exp_avg``
and ``exp_avg_sq``, any other optimizer's per-element moments) the parameter's own views
(:func:`autotp.io.checkpoint.global_views`): a DTensor per segment, padding rows of a vocab-parallel weight
left out, kv blocks replicated like the weight's. torch.distributed.checkpoint then saves and loads it at
any tp and dp, exactly as the weights. Scalar tensors (AdamW's ``step``) and the state of replicated
parameters stay plain tensors (DCP writes one copy).

What is not a tensor — the param groups' hyper-parameters, non-tensor per-parameter values — becomes plain
JSON data (:func:`plain_data`) for the checkpoint's manifest, and :func:`restore` hands it back to torch's
``set_optimizer_state_dict`` together with the loaded tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from autotp.io.checkpoint import WriteBack, checkpoint_shards, global_views, reshard
from autotp.errors import CheckpointError
from autotp.distributed.launch import RankContext

__all__ = ["OptimizerState", "optimizer_state", "plain_data", "restore"]


@dataclass(frozen=True)
class OptimizerState:
    """One optimizer's state, keyed by parameter name. ``tensors`` is the DCP tree; its views share memory
    with ``live`` (the optimizer's own tensors), so a DCP load writes into the optimizer."""

    tensors: dict[str, dict[str, torch.Tensor]]
    live: dict[str, dict[str, Any]]
    groups: list[dict[str, Any]]  # torch's param groups: hyper-parameters, "params" as parameter names
    kind: str  # the optimizer's class, module-qualified


def _kind(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def optimizer_state(tpm: torch.nn.Module, optimizer: torch.optim.Optimizer, ctx: RankContext,
                    copies: WriteBack | None = None) -> OptimizerState:
    """The state of ``optimizer`` (over ``tpm``'s parameters) in global coordinates; a fresh optimizer's
    state is initialised first (torch's helper takes a zero-learning-rate step), so there is something to
    load into. Under FSDP each moment is this rank's TP shard gathered over dp (``copies`` writes a load
    back into the optimizer's own shards)."""
    copies = WriteBack() if copies is None else copies
    reshard(tpm)  # the module's parameters must be the optimizer's (FSDP's shards)
    osd = get_optimizer_state_dict(tpm, optimizer)
    shards = checkpoint_shards(tpm)
    params = {name: copies.local(p) for name, p in tpm.named_parameters()}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name, entries in osd["state"].items():
        param, shard = params[name], shards.get(name)
        views: dict[str, torch.Tensor] = {}
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor):
                continue  # plain data: the manifest carries it
            value = copies.local(value)
            if shard is None or value.dim() == 0:
                views[key] = value.detach()
            elif value.shape == param.shape:
                views.update(global_views(key, value.detach(), shard, ctx))
            else:
                raise CheckpointError(
                    f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}, neither the parameter's "
                    f"{tuple(param.shape)} nor a scalar: autotp cannot place it in the unsharded model's coordinates",
                    hint="use an optimizer whose state is per element (AdamW, Adam, SGD with momentum)")
        tensors[name] = views
    return OptimizerState(tensors, osd["state"], osd["param_groups"], _kind(optimizer))


# -- plain data --------------------------------------------------------------------------------------------
_SKIP = object()


def _encode(value: Any) -> Any:
    """``value`` as JSON data, or _SKIP (a callable, an object: left as the running optimizer has it)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (tuple, list)):
        items = [_encode(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else {"tuple": items} if isinstance(value, tuple) else items
    if isinstance(value, torch.Tensor) and value.numel() <= 64:  # a tensor learning rate, betas
        return {"tensor": value.detach().cpu().tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    return _SKIP


def _decode(value: Any, where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, where) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {"tuple"} and isinstance(value["tuple"], list):
        return tuple(_decode(v, where) for v in value["tuple"])
    if set(value) == {"float"} and value["float"] in ("inf", "-inf", "nan"):
        return float(value["float"])
    dtype = getattr(torch, str(value.get("dtype")), None)
    if set(value) == {"tensor", "dtype"} and isinstance(dtype, torch.dtype):
        try:
            return torch.tensor(value["tensor"], dtype=dtype)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise CheckpointError(f"{where}: the optimizer entry {value!r} is not data autotp writes",
                          hint="the manifest was edited or damaged: resume from another checkpoint")


def plain_data(state: OptimizerState) -> dict[str, Any]:
    """What the manifest keeps of ``state``: the optimizer's class, its param groups, non-tensor values."""
    groups = [{k: e for k, v in g.items() if (e := _encode(v)) is not _SKIP} for g in state.groups]
    values = {name: {k: e for k, v in entries.items() if not isinstance(v, torch.Tensor)
                     and (e := _encode(v)) is not _SKIP}
              for name, entries in state.live.items()}
    return {"class": state.kind, "param_groups": groups, "values": {n: v for n, v in values.items() if v}}


def merge_plain_data(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The plain data of one optimizer split over pipeline stages (each rank's over its own parameters) as
    one: every group's parameter names joined, the values of all of them."""
    first = parts[0]
    groups = [{**g, "params": sorted({n for part in parts for n in part["param_groups"][i]["params"]})}
              for i, g in enumerate(first["param_groups"])]
    values = {n: v for part in parts for n, v in part["values"].items()}
    return {**first, "param_groups": groups, "values": values}


def restore(tpm: torch.nn.Module, optimizer: torch.optim.Optimizer, state: OptimizerState, saved: Any,
            where: str, stage: bool = False) -> None:
    """Hand the loaded tensors (already in ``state.live``) and the manifest's plain data ``saved`` to torch's
    ``set_optimizer_state_dict``. ``where`` names the manifest in errors. ``stage``: the optimizer holds one
    pipeline stage's parameters, a part of each saved group's."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        raise CheckpointError(f"{where} holds no optimizer state",
                              hint="the checkpoint was saved without an optimizer; resume without one, or start afresh")
    if saved.get("class") != state.kind:
        raise CheckpointError(f"{where}: the checkpoint holds {saved.get('class')}'s state, this job's optimizer "
                              f"is {state.kind}", hint="resume with the optimizer that saved it")
    groups = saved["param_groups"]
    ours = [sorted(g["params"]) for g in state.groups]
    theirs = [sorted(g.get("params", [])) if isinstance(g, dict) else None for g in groups]
    if stage and len(ours) == len(theirs) and all(t is not None and set(o) <= set(t) for o, t in zip(ours, theirs)):
        theirs = ours
    if ours != theirs:
        raise CheckpointError(f"{where}: the optimizer's param groups differ from the checkpoint's "
                              f"({len(theirs)} groups of {[len(t or ()) for t in theirs]} parameters there, "
                              f"{len(ours)} of {[len(o) for o in ours]} here)",
                              hint="build the optimizer over the same parameters and groups as the saving run")
    param_groups = [{**current, **{k: _decode(v, where) for k, v in g.items() if k != "params"},
                     "params": current["params"]} for g, current in zip(groups, state.groups)]
    values = saved.get("values") or {}
    if not isinstance(values, dict):
        raise CheckpointError(f"{where}: optimizer values are not a mapping")
    merged = {name: {**entries, **{k: _decode(v, where) for k, v in (values.get(name) or {}).items()}}
              for name, entries in state.live.items()}
    set_optimizer_state_dict(tpm, optimizer, {"state": merged, "param_groups": param_groups})
