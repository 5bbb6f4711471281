"""autotp: automatic Megatron-style tensor parallelism for unmodified PyTorch GPT models."""
from __future__ import annotations

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
    "parallelize",
]
