"""Gradients of sharded parameters whose norms are the full parameter's.

A training script written for one device clips gradients with ``torch.nn.utils.clip_grad_norm_`` (nanoGPT
does, by default). On a sharded parameter the local gradient is only this rank's slice, so its norm, and
the clip factor, would differ from the single-device run on every rank — silently. After each backward the
gradient of a sharded parameter is marked as a :class:`ShardedGrad`: the same storage, the same values,
a plain tensor to every op, except that a norm of the whole tensor (``torch.linalg.vector_norm``,
``torch.norm``, ``Tensor.norm``) is the norm of the full gradient, summed over the tensor-parallel group
(one all-reduce of one element; ``torch._foreach_norm``, which clip_grad_norm_ uses on CUDA, sums them all in one).
Blocks held by several ranks (kv heads fewer than tp) are counted once.

A ``torch.amp.GradScaler`` checks the gradients for inf/nan before it steps; with shards, each rank checks only
its own, so the result is made to agree over the group (:func:`_agree_found_inf`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autotp.plan.plan import ParamShard
from autotp.shard_spec import local_runs


@dataclass(frozen=True)
class NormInfo:
    group: dist.ProcessGroup
    dim: int
    pieces: tuple[tuple[int, int, float], ...]  # (start, length, weight) along dim: 1/copies per block


def norm_info(shard: ParamShard, tp: int, group: dist.ProcessGroup) -> NormInfo:
    pieces = () if shard.vocab is not None else local_runs(shard.segments, tp)
    return NormInfo(group, shard.dim, tuple((p.start, p.length, 1 / p.copies) for p in pieces))


class ShardedGrad(torch.Tensor):
    """This rank's slice of a gradient; whole-tensor norms are the full gradient's."""

    _autotp_norm: NormInfo

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NORMS and args and isinstance(args[0], ShardedGrad):
            p, dim = _norm_args(func, args, kwargs)
            if dim is None and not kwargs.get("keepdim", False):
                return _global_norm(args[0], p)
        if func is torch._foreach_norm:  # clip_grad_norm_ on CUDA: one norm per gradient, in one kernel
            return _foreach_global_norms(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func is torch._amp_foreach_non_finite_check_and_unscale_:
            _agree_found_inf(args[0], args[1] if len(args) > 1 else kwargs["found_inf"])
        return out


_NORMS = {torch.linalg.vector_norm, torch.norm, torch.Tensor.norm, torch.linalg.norm}


def _agree_found_inf(grads: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    """GradScaler's inf/nan check over gradients some of which are shards: an overflow in one rank's shard
    must skip the step on every rank holding the model, or the shards diverge. ``found_inf`` (1 where this
    rank found one) is all-reduced (max) over the group, as Megatron all-reduces it over the model-parallel
    group: one element per (device, dtype) the scaler checks."""
    for group in dict.fromkeys(g._autotp_norm.group for g in grads if isinstance(g, ShardedGrad)):
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)


def _foreach_global_norms(tensors, ord=2, dtype=None) -> list[torch.Tensor]:
    """``torch._foreach_norm`` where shards' norms are the full gradients': their local p-th power sums go
    in one all-reduce per group (max for the inf-norm)."""
    p = float(2 if ord is None else ord)
    with torch._C.DisableTorchFunctionSubclass():
        norms = list(torch._foreach_norm(tensors, ord, dtype=dtype))
    by_group: dict[dist.ProcessGroup, list[int]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, ShardedGrad):
            by_group.setdefault(t._autotp_norm.group, []).append(i)
    for group, idx in by_group.items():
        with torch._C.DisableTorchFunctionSubclass():
            local = torch.stack([_local_power(tensors[i], p) for i in idx])
            dist.all_reduce(local, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM, group=group)
            for i, v in zip(idx, local if math.isinf(p) else local ** (1.0 / p)):
                norms[i] = v.to(norms[i].dtype)
    return norms


def _local_power(g: ShardedGrad, p: float) -> torch.Tensor:
    """This rank's part of Σ|g|^p (max |g| for p = inf) in float64, blocks held by several ranks weighted once."""
    info = g._autotp_norm
    x = g.detach().double()
    pieces = info.pieces or ((0, x.shape[info.dim], 1.0),)
    if math.isinf(p):
        return torch.stack([x.narrow(info.dim, s, n).abs().amax() for s, n, _ in pieces]).amax()
    return sum((x.narrow(info.dim, s, n).abs() ** p).sum() * w for s, n, w in pieces)


def _norm_args(func, args: tuple, kwargs: dict) -> tuple[float, object]:
    p = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2))
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if p is None or p == "fro":
        p = 2
    return float(p), dim


def _global_norm(g: ShardedGrad, p: float) -> torch.Tensor:
    info = g._autotp_norm
    with torch._C.DisableTorchFunctionSubclass():
        local = _local_power(g, p)
        if math.isinf(p):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=info.group)
            return local.to(g.dtype)
        dist.all_reduce(local, group=info.group)
        return (local ** (1.0 / p)).to(g.dtype)


def mark_sharded_grad(param: torch.nn.Parameter, info: NormInfo) -> None:
    """After every accumulation, ``param.grad`` is a :class:`ShardedGrad` over the same storage."""

    def hook(p: torch.Tensor) -> None:
        if p.grad is not None and not isinstance(p.grad, ShardedGrad):
            g = torch.Tensor._make_subclass(ShardedGrad, p.grad)
            g._autotp_norm = info
            p.grad = g

    param.register_post_accumulate_grad_hook(hook)
