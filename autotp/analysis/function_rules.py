"""Whether the model's own autograd Function may run on shards: checked by running it.

A custom ``torch.autograd.Function`` (kept by :mod:`autotp.capture.functions`) runs in the sharded graph
as the model wrote it, ``forward`` and ``backward`` both; its traced forward tells propagation where its
results are sharded, but no rule reads its ``backward``. :func:`check_function` runs the Function on random
whole tensors and on each rank's shards (the example's sizes, ``tp`` parts along the dims propagation gave):
each rank's results must be its shards of the whole results, and the gradients its ``backward`` gives each
rank's arguments must be its shards of the whole gradients. Any difference, or an error, refuses the
sharding with the reason; the Function then runs on whole tensors.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from autotp.errors import own_bug
from autotp.operators.functions import FunctionCall


class FunctionRefused(Exception):
    """The Function does not give each rank its shard of the result or of the gradient; the message says why."""


class Operand(NamedTuple):
    """A tensor argument or result of a call: its example shape and dtype, and the dim sharded (None: whole)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int | None


def _random(o: Operand, gen: torch.Generator) -> torch.Tensor:
    if o.dtype.is_floating_point:
        return torch.randn(o.shape, generator=gen, dtype=o.dtype).requires_grad_()
    if o.dtype == torch.bool:
        return torch.rand(o.shape, generator=gen) < 0.5
    return torch.randint(0, 2, o.shape, generator=gen, dtype=o.dtype)


def _part(t: torch.Tensor, dim: int | None, tp: int, rank: int) -> torch.Tensor:
    return t if dim is None else t.tensor_split(tp, dim)[rank]


def _run(call: FunctionCall, tensors: list[torch.Tensor]) -> list:
    it = iter(tensors)
    args, kwargs = tree_unflatten([next(it) if x is None else x for x in call.flat], call.spec)
    return tree_flatten(call.function.apply(*args, **kwargs))[0]


def _close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6, equal_nan=True)


def check_function(call: FunctionCall, args: list[Operand], outs: list[Operand | None], tp: int) -> None:
    """Raise :class:`FunctionRefused` unless ``call``'s Function, run on each rank's shards of ``args``, gives
    that rank's shards of the results (``outs``, one per flattened result; None: not a tensor) and, from its
    backward, of the gradients."""
    name = f"{call.name()}"
    for o in outs:
        if o is not None and o.dtype.is_floating_point and o.dim is None:
            raise FunctionRefused(f"{name} gives a whole result from sharded arguments")
    gen = torch.Generator().manual_seed(0)
    whole = [_random(a, gen) for a in args]
    try:
        full = _run(call, whole)
        grads = [torch.randn(r.shape, generator=gen, dtype=r.dtype) if isinstance(r, torch.Tensor)
                 and r.requires_grad else None for r in full]
        pairs = [(r, g) for r, g in zip(full, grads) if g is not None]
        wants = torch.autograd.grad([r for r, _ in pairs], [w for w in whole if w.requires_grad],
                                    [g for _, g in pairs], allow_unused=True) if pairs else ()
        for rank in range(tp):
            local = [_part(w.detach(), a.dim, tp, rank).requires_grad_(w.requires_grad) for w, a in zip(whole, args)]
            got = _run(call, local)
            for r, f, o in zip(got, full, outs):
                if isinstance(r, torch.Tensor) and not _close(r, _part(f.detach(), o.dim, tp, rank)):
                    raise FunctionRefused(f"{name} run on a rank's shards does not give that rank's shard of its "
                                          "result (checked on random values)")
            mine = [(r, _part(g, o.dim, tp, rank)) for r, g, o in zip(got, grads, outs) if g is not None]
            needs = [t for t in local if t.requires_grad]
            given = torch.autograd.grad([r for r, _ in mine], needs, [g for _, g in mine], allow_unused=True) \
                if mine else ()
            shard_of = [_part(w, a.dim, tp, rank) if w is not None else None
                        for w, a in zip(wants, [a for a in args if a.dtype.is_floating_point])]
            if not all(_close(g, w) for g, w in zip(given, shard_of)):
                raise FunctionRefused(f"{name}'s backward run on a rank's shards does not give that rank's shard "
                                      "of the gradient (checked on random values)")
    except FunctionRefused:
        raise
    except Exception as e:  # the model's code, run on shapes it was not written for
        if own_bug(e):  # autotp's own bug: shown, never a verdict
            raise
        raise FunctionRefused(f"{name} fails on a rank's shards: {type(e).__name__}: {e}") from None
