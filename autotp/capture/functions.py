"""The model's own ``torch.autograd.Function`` subclasses, seen by the capture: which ops each call's forward ran.

Export traces through a custom Function's ``forward`` and keeps only its ops: the sharded graph would
differentiate those ops and never call the model's ``backward`` (a straight-through estimator's gradient
would become zero). While capturing, :func:`marking_functions` runs each call of a Function defined outside
torch under ``torch.fx.traceback.annotate``: every node its forward makes carries
``meta["custom"]["autotp_function"]`` (a :class:`FunctionCall`: the class and the call's non-tensor
arguments), each tensor argument enters through an ``aten.alias`` marked with its position and each tensor
result leaves through one marked with its position. The runtime outlines each region into a call of the
Function itself (:mod:`autotp.operators.functions`), so its backward is the model's again.

Before (what export gives)::

    mul = aten.mul.Tensor(linear, 4)
    round = aten.round.default(mul)           # RoundSTE.forward: differentiated as round (zero gradient)

After (captured here)::

    alias = aten.alias.default(mul)           # custom: {autotp_function: FunctionCall(RoundSTE, ..), arg: 0}
    round = aten.round.default(alias)         # custom: {autotp_function: FunctionCall(RoundSTE, ..)}
    alias_1 = aten.alias.default(round)       # custom: {autotp_function: ..., out: Out(0, spec)}
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
import torch.fx.traceback as fx_traceback
from torch.utils._pytree import tree_flatten, tree_unflatten

from autotp.operators.functions import ARG, KEY, OUT, FunctionCall, Out

def is_models_own(function: type) -> bool:
    """A Function the model defines (torch's own, such as checkpointing's, are traced as torch means them)."""
    return not function.__module__.startswith("torch.")


@contextlib.contextmanager
def marking_functions() -> Iterator[None]:
    """Inside: each call of a custom Function defined outside torch has its ops tagged (see the module).

    The hook sits one class below ``Function``: ``Function.apply`` ends in ``super().apply(...)``, which finds
    it on ``_SingleLevelFunction`` before torch's C ``_FunctionBase.apply``. So every spelling of the call is
    seen, ``Scan.apply(a, x)`` as much as ``scan(a, x)`` with ``scan = Scan.apply`` bound at import (a bound
    method of the original classmethod, which a patch of ``Function.apply`` itself would miss),
    ``functools.partial(Scan.apply, ...)``, ``staticmethod(Scan.apply)`` on a class, or a class passed
    through ``torch.compiler.allow_in_graph`` (a no-op outside dynamo)."""
    calls = itertools.count()
    below = torch.autograd.function._SingleLevelFunction  # Function's base: where super().apply looks first
    assert "apply" not in below.__dict__, "torch's Function.apply chain changed"

    def apply(cls, *args, **kwargs):
        base = super(below, cls).apply  # torch._C._FunctionBase.apply, bound to cls
        if not is_models_own(cls):
            return base(*args, **kwargs)
        flat, spec = tree_flatten((args, kwargs))
        call = FunctionCall(cls, tuple(None if isinstance(x, torch.Tensor) else x for x in flat), spec, next(calls))
        alias = torch.ops.aten.alias.default
        with fx_traceback.annotate({KEY: call}):
            marked, k = [], itertools.count()
            for x in flat:
                if isinstance(x, torch.Tensor):
                    with fx_traceback.annotate({ARG: next(k)}):
                        x = alias(x)
                marked.append(x)
            a, kw = tree_unflatten(marked, spec)
            out = base(*a, **kw)
            results, out_spec = tree_flatten(out)
            for j, r in enumerate(results):
                if isinstance(r, torch.Tensor):
                    with fx_traceback.annotate({OUT: Out(j, len(results), out_spec)}):
                        results[j] = alias(r)
        return tree_unflatten(results, out_spec)

    below.apply = classmethod(apply)
    try:
        with fx_traceback.preserve_node_meta():
            yield
    finally:
        del below.apply


def renamed_region(meta: dict, block: str) -> dict:
    """A copied block's node meta: its Function call numbered apart from the block it was copied from."""
    custom = meta.get("custom")
    if isinstance(custom, dict) and isinstance(custom.get(KEY), FunctionCall):
        return {**meta, "custom": {**custom, KEY: custom[KEY].renamed(block)}}
    return meta
