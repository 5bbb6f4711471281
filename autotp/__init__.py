"""autotp: automatic Megatron-style tensor parallelism for unmodified PyTorch GPT models."""
from __future__ import annotations

from autotp.io.checkpoint import full_state_dict, load_full_state_dict
from autotp.io.empty import empty_weights
from autotp.distributed.cpu_binding import bind_cpu_cores
from autotp.parallel.data import broadcast_batch, check_same_inputs, dp_rank, dp_sampler, dp_size
from autotp.io.export import save_weights
from autotp.errors import (AutotpError, CaptureError, InputMismatchError, PipelineError, ProcessGroupError,
                           ShardingError)
from autotp.plan.plan import Plan
from autotp.runtime.gathered import GatheredOnUse
from autotp.parallel.parallelize import TPModule, parallelize
from autotp.parallel.pipeline import Pipeline, pipeline
from autotp.state import TPState, tp_state
from autotp.io.weights import load_weights

__all__ = [
    "AutotpError",
    "CaptureError",
    "GatheredOnUse",
    "InputMismatchError",
    "Pipeline",
    "PipelineError",
    "Plan",
    "ProcessGroupError",
    "ShardingError",
    "TPModule",
    "TPState",
    "bind_cpu_cores",
    "broadcast_batch",
    "check_same_inputs",
    "dp_rank",
    "dp_sampler",
    "dp_size",
    "empty_weights",
    "full_state_dict",
    "load_full_state_dict",
    "load_weights",
    "parallelize",
    "pipeline",
    "save_weights",
    "tp_state",
]
