"""autotp: automatic Megatron-style tensor parallelism for unmodified PyTorch GPT models.

The public names are imported when first used (PEP 562): ``autotp.parallelize`` pulls in the parallel
runtime, ``autotp.save_weights`` the checkpoint engine, and a command such as ``autotp plan`` neither.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autotp.distributed.cpu_binding import bind_cpu_cores
    from autotp.errors import (AutotpError, CaptureError, InputMismatchError, PipelineError, ProcessGroupError,
                               ShardingError)
    from autotp.io.checkpoint import full_state_dict, load_full_state_dict
    from autotp.io.empty import empty_weights
    from autotp.io.export import save_weights
    from autotp.io.weights import load_weights
    from autotp.parallel.data import broadcast_batch, check_same_inputs, dp_rank, dp_sampler, dp_size
    from autotp.parallel.parallelize import TPModule, parallelize
    from autotp.parallel.pipeline import Pipeline, pipeline
    from autotp.plan.plan import Plan
    from autotp.operators.gathered import GatheredOnUse
    from autotp.state import TPState, tp_state

# public name -> the module that defines it
_WHERE = {
    "AutotpError": "autotp.errors", "CaptureError": "autotp.errors", "InputMismatchError": "autotp.errors",
    "PipelineError": "autotp.errors", "ProcessGroupError": "autotp.errors", "ShardingError": "autotp.errors",
    "GatheredOnUse": "autotp.operators.gathered", "Pipeline": "autotp.parallel.pipeline",
    "pipeline": "autotp.parallel.pipeline", "Plan": "autotp.plan.plan", "TPModule": "autotp.parallel.parallelize",
    "parallelize": "autotp.parallel.parallelize", "TPState": "autotp.state", "tp_state": "autotp.state",
    "bind_cpu_cores": "autotp.distributed.cpu_binding", "broadcast_batch": "autotp.parallel.data",
    "check_same_inputs": "autotp.parallel.data", "dp_rank": "autotp.parallel.data",
    "dp_sampler": "autotp.parallel.data", "dp_size": "autotp.parallel.data", "empty_weights": "autotp.io.empty",
    "full_state_dict": "autotp.io.checkpoint", "load_full_state_dict": "autotp.io.checkpoint",
    "load_weights": "autotp.io.weights", "save_weights": "autotp.io.export",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> object:
    if name not in _WHERE:
        raise AttributeError(f"module 'autotp' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
