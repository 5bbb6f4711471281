"""autotp: automatic Megatron-style tensor parallelism for unmodified PyTorch GPT models."""
from __future__ import annotations

from autotp.checkpoint import full_state_dict, load_full_state_dict
from autotp.errors import AutotpError, CaptureError, ProcessGroupError, ShardingError
from autotp.plan import Plan
from autotp.runtime import TPModule, parallelize

__all__ = [
    "AutotpError",
    "CaptureError",
    "Plan",
    "ProcessGroupError",
    "ShardingError",
    "TPModule",
    "full_state_dict",
    "load_full_state_dict",
    "parallelize",
]
