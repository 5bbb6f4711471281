"""The model's own activation checkpointing, seen by the capture: which ops ran inside each
``torch.utils.checkpoint.checkpoint`` call.

Export traces through ``checkpoint``: the non-reentrant kind leaves its ops inline with nothing to say they
were recomputed, and the reentrant kind (``CheckpointFunction``, what Hugging Face's
``gradient_checkpointing_enable()`` uses by default) would leave them inside a no-grad region. While capturing,
:func:`marking_checkpoints` runs each checkpointed function plainly (the same ops, gradients flowing) under
``torch.fx.traceback.annotate``, so each node it makes carries ``meta["custom"]["autotp_recompute"]``: a number
per call. The rewritten graph runs each such region under ``torch.utils.checkpoint`` again
(:mod:`autotp.operators.recompute`), so the sharded model keeps only what the user's model kept.
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as torch_checkpoint

from autotp.operators.recompute import KEY


@contextlib.contextmanager
def marking_checkpoints() -> Iterator[None]:
    """Inside: every ``checkpoint(fn, *args)`` runs ``fn(*args)`` directly, its ops tagged with the call's number."""
    calls = itertools.count()
    plain = torch_checkpoint._checkpoint_without_reentrant_generator

    def without_reentrant(fn, preserve_rng_state=True, context_fn=None, determinism_check=None, debug=None,
                          *args, **kwargs):
        with fx_traceback.annotate({KEY: next(calls)}):
            yield  # checkpoint() calls fn(*args, **kwargs) here, as it would have

    def with_reentrant(function, preserve_rng_state, *args):
        with fx_traceback.annotate({KEY: next(calls)}):
            return function(*args)

    own = torch_checkpoint.CheckpointFunction.__dict__.get("apply")  # None: Function's classmethod, inherited
    torch_checkpoint._checkpoint_without_reentrant_generator = without_reentrant
    torch_checkpoint.CheckpointFunction.apply = with_reentrant
    try:
        with fx_traceback.preserve_node_meta():
            yield
    finally:
        torch_checkpoint._checkpoint_without_reentrant_generator = plain
        if own is None:
            del torch_checkpoint.CheckpointFunction.apply
        else:
            torch_checkpoint.CheckpointFunction.apply = own


def renamed_region(meta: dict, block: str) -> dict:
    """A copied block's node meta: its region numbered apart from the block it was copied from."""
    custom = meta.get("custom")
    if isinstance(custom, dict) and KEY in custom:
        return {**meta, "custom": {**custom, KEY: (custom[KEY], block)}}
    return meta
