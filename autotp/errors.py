"""The error catalog: every failure a user can cause, each a typed error with a one-line cause that names
the culprit (module path, sizes, tp, file, rank) and a fix hint. The CLI prints ``error: <cause>`` and the
hint, without a traceback unless ``--debug``; all are raised before any rank communicates, except
:class:`RankFailedError`, which reports a rank that failed while running.
"""
from __future__ import annotations


class AutotpError(Exception):
    """Base of every error autotp raises on purpose."""

    hint: str = ""

    def __init__(self, message: str, hint: str = ""):
        self.hint = hint
        super().__init__(f"{message}\n  hint: {hint}" if hint else message)


class ShardingError(AutotpError, ValueError):
    """The model cannot be sharded as asked: a size tp does not divide (heads, vocab, experts), a later call
    signature that would cut a parameter differently from the first, a model parallelized twice, or one
    built on meta whose tensors have no values yet."""


class CaptureError(AutotpError, RuntimeError):
    """torch.export could not capture the model's forward."""


class ProcessGroupError(AutotpError, RuntimeError):
    """No usable process group for tensor parallelism."""


class ModelFileError(AutotpError, ValueError):
    """The model file is missing, fails to import, or defines nothing autotp can build a model from."""


class LaunchError(AutotpError, ValueError):
    """Sizes or rendezvous settings that cannot start a job (tp·dp·pp vs world, devices per node, ...).

    ``fields`` names the settings at fault as the message spells them (``LaunchSpec``'s field names), so that
    a front end can name them its own way (the CLI as its flags)."""

    def __init__(self, message: str, hint: str = "", fields: tuple[str, ...] = ()):
        self.fields = fields
        super().__init__(message, hint)


class PlanSizeError(AutotpError, ValueError):
    """A batch or sequence size outside the sizes the captured forward accepts."""


class CheckpointError(AutotpError, RuntimeError):
    """No checkpoint to resume from, or one that does not fit the job."""


class InputMismatchError(AutotpError, RuntimeError):
    """The ranks of one tensor-parallel group were called with different inputs (checked before any step)."""


class RankFailedError(AutotpError, RuntimeError):
    """A worker process failed; ``message`` is its exception, ``traceback`` its stack when it recorded one."""

    def __init__(self, rank: int, exitcode: int, message: str, traceback: str = ""):
        self.rank, self.exitcode, self.message, self.traceback = rank, exitcode, message, traceback
        super().__init__(f"rank {rank} failed (exit code {exitcode}): {message}")

    def said(self) -> str:
        """One line: ``rank 1: RuntimeError: ...``, or ``rank 1 (pid 4242) was killed by SIGKILL at step 3``."""
        name, sep, rest = self.message.partition(": ")
        own = sep and isinstance(known := globals().get(name), type) and issubclass(known, AutotpError)
        message = rest if own else self.message  # autotp's own errors say what they are without their class
        return f"rank {self.rank}{' ' if message.startswith('(pid ') else ': '}{message}"


class LaunchInterrupted(AutotpError, RuntimeError):
    """The launcher was stopped by a signal (Ctrl-C's SIGINT, a scheduler's SIGTERM); the ranks were sent it and
    have ended. ``code`` is the shell's exit status for it (128 + the signal's number)."""

    def __init__(self, signum: int, forced: bool = False):
        import signal

        self.signum, self.forced = signum, forced
        self.name = signal.Signals(signum).name
        super().__init__(f"interrupted by {self.name}" + (" twice: the ranks were killed" if forced else ""))

    @property
    def code(self) -> int:
        return 128 + self.signum


class PipelineError(AutotpError, ValueError):
    """The pipeline cannot be arranged as asked: more stages than blocks, a split point that is no block,
    micro-batches that do not divide the batch, a schedule that needs another number of stages per rank."""


class PlanCacheError(AutotpError, ValueError):
    """A plan cache file that is not what autotp wrote: edited, truncated, or of another format."""


# Python's errors that mean the code itself is wrong (a removed function imported, a misspelt name or
# attribute), not that an input is: a broad ``except`` in autotp re-raises these when autotp's code raised them
_CODE_ERRORS = (ImportError, NameError, AttributeError)


def own_bug(exc: BaseException) -> bool:
    """Whether ``exc`` is autotp's own bug: an ImportError, NameError or AttributeError raised in autotp's code.

    The frame deciding is the innermost one but for module-level ``__getattr__`` hooks (``torch.gone`` raises in
    torch's, on autotp's behalf) and import machinery. An error of the user's model or of torch's own logic
    (raised in their frames) is not autotp's, and a broad ``except`` may turn it into a verdict; autotp's own
    must surface as they are (``if own_bug(exc): raise``)."""
    if not isinstance(exc, _CODE_ERRORS):
        return False
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        if frame.f_code.co_name == "__getattr__" or frame.f_code.co_filename.startswith("<frozen importlib"):
            continue
        name = frame.f_globals.get("__name__") or ""
        return name == "autotp" or name.startswith("autotp.")
    return False
