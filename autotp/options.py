"""What :func:`autotp.parallelize` is asked for, as one frozen value validated once.

:class:`Options` holds every choice beyond the process group (vocab padding, compile, input checks,
sequence and expert parallelism, FSDP, pipeline stages); :meth:`Options.validate` refuses a combination that
does not run, in one place, before any rank does work. The model's state (:class:`~autotp.state.TPState`)
keeps it beside this rank's identity and what the calls have cached.
"""
from __future__ import annotations

from dataclasses import dataclass

from autotp.distributed.data_parallel import FSDPConfig
from autotp.errors import ShardingError
from autotp.plan.stages import StageRequest


@dataclass(frozen=True)
class Options:
    """The choices :func:`autotp.parallelize` was given (see its docstring for each)."""

    vocab_multiple: int = 1
    compile: bool | dict = False  # a dict: torch.compile's options
    check_inputs: bool = False
    sequence_parallel: bool = False
    expert_parallel: bool = False
    fsdp: FSDPConfig | None = None  # sharded data parallelism over the mesh's dp dim(s)
    pipeline: StageRequest | None = None  # pipelined: every graph is cut into these stages

    def validate(self) -> Options:
        """``self``, or a :class:`ShardingError` naming what does not run together and the numbers given."""
        if not isinstance(self.vocab_multiple, int) or self.vocab_multiple < 1:
            raise ShardingError(f"vocab_multiple must be a positive integer, got {self.vocab_multiple!r}")
        if self.fsdp is not None and self.compile:
            raise ShardingError("fsdp with compile=True is not supported yet", hint="drop one of them")
        return self

    def cache_options(self) -> dict:
        """The options a plan depends on, for the plan cache's key."""
        return {"vocab_multiple": self.vocab_multiple, "sequence_parallel": self.sequence_parallel,
                "expert_parallel": self.expert_parallel}
