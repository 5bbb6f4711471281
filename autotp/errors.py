"""Errors a user can cause, each naming the culprit and how to fix it."""
from __future__ import annotations


class AutotpError(Exception):
    """Base of every error autotp raises on purpose."""

    hint: str = ""

    def __init__(self, message: str, hint: str = ""):
        self.hint = hint
        super().__init__(f"{message}\n  hint: {hint}" if hint else message)


class ShardingError(AutotpError, ValueError):
    """A dimension the plan must split is not divisible by the tensor-parallel size."""


class CaptureError(AutotpError, RuntimeError):
    """torch.export could not capture the model's forward."""


class ProcessGroupError(AutotpError, RuntimeError):
    """No usable process group for tensor parallelism."""
