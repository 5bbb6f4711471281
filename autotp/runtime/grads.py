"""Gradients of sharded parameters whose norms are the full parameter's.

A training script written for one device clips gradients with ``torch.nn.utils.clip_grad_norm_`` (nanoGPT
does, by default). On a sharded parameter the local gradient is only this rank's slice, so its norm, and
the clip factor, would differ from the single-device run on every rank — silently. After each backward the
gradient of a sharded parameter is marked as a :class:`ShardedGrad`: the same storage, the same values,
a plain tensor to every op, except that a norm of the whole tensor (``torch.linalg.vector_norm``,
``torch.norm``, ``Tensor.norm``) is the norm of the full gradient, summed over the tensor-parallel group
(one all-reduce of one element). Blocks held by several ranks (kv heads fewer than tp) are counted once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autotp.plan.plan import ParamShard
from autotp.plan.shard_spec import local_pieces


@dataclass(frozen=True)
class NormInfo:
    group: dist.ProcessGroup
    dim: int
    pieces: tuple[tuple[int, int, float], ...]  # (start, length, weight) along dim: 1/copies per block


def norm_info(shard: ParamShard, tp: int, group: dist.ProcessGroup) -> NormInfo:
    pieces = () if shard.vocab is not None else local_pieces(shard.segments, tp)
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
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


_NORMS = {torch.linalg.vector_norm, torch.norm, torch.Tensor.norm, torch.linalg.norm}


def _norm_args(func, args: tuple, kwargs: dict) -> tuple[float, object]:
    p = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2))
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if p is None or p == "fro":
        p = 2
    return float(p), dim


def _global_norm(g: ShardedGrad, p: float) -> torch.Tensor:
    info = g._autotp_norm
    with torch._C.DisableTorchFunctionSubclass():
        x = g.detach().double()
        pieces = info.pieces or ((0, x.shape[info.dim], 1.0),)
        if math.isinf(p):
            local = torch.stack([x.narrow(info.dim, s, n).abs().amax() for s, n, _ in pieces]).amax()
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=info.group)
            return local.to(g.dtype)
        local = sum((x.narrow(info.dim, s, n).abs() ** p).sum() * w for s, n, w in pieces)
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
