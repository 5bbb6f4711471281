"""A restarted job shards its model from the plan cache and captures on the first call.

``parallelize`` needs a plan before it returns: the plan says which slice of each parameter this rank keeps,
and :func:`autotp.load_weights` reads exactly those slices. Making it means capturing the forward (the
export of two blocks and the analysis: about 1 s for a 22-layer Llama, more on a shared machine), which a
job that restarts, or every rank of a serving fleet, would pay again for the same model. So parallelize
looks the plan up in the on-disk cache (:mod:`autotp.plan.cache`) under the key of what it depends on (the
ops the forward runs on meta, every tensor's name, shape and dtype, tp and the options, the versions of
torch and autotp). On a hit it shards the parameters from the cached plan and captures nothing; the model's
first call captures its own signature then, as any later call signature is captured, and checks that its
plan cuts every parameter as the cached one did. On a miss it captures as always and stores the plan.

Only plain tensor parallelism at tp > 1 takes this path: FSDP units and pipeline stages are cut from the
graph at parallelize time, and at tp 1 the fused segments are read from the graph. ``AUTOTP_PLAN_CACHE=0``
turns it off; the folder is the plan cache's (``$AUTOTP_CACHE_DIR``, else ``~/.cache/autotp/plans``).
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch.nn as nn

from autotp.parallel.planning import Lookup, lookup as lookup_call, remember
from autotp.state import TPState

__all__ = ["Lookup", "lookup", "remember"]


def _eligible(st: TPState) -> bool:
    return (os.environ.get("AUTOTP_PLAN_CACHE", "1") != "0" and st.tp > 1 and st.options.fsdp is None
            and st.options.pipeline is None)


def lookup(model: nn.Module, st: TPState, forward: Callable, args: tuple, kwargs: dict, training: bool) -> Lookup:
    """The cache key of parallelizing ``model`` for this call, and the plan stored under it if any."""
    if not _eligible(st):
        return Lookup(None)
    options = {"tp": st.tp, **st.options.cache_options(), "training": training, "by": "parallelize"}
    return lookup_call(model, forward, args, kwargs, options)
