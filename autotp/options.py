"""What :func:`autotp.parallelize` is asked for, as one frozen value validated once.

:class:`Options` holds every choice beyond the process group (vocab padding, compile, input checks,
sequence and expert parallelism, FSDP, pipeline stages); :meth:`Options.validate` refuses a combination that
does not run, in one place, before any rank does work. The model's state (:class:`~autotp.state.TPState`)
keeps it beside this rank's identity and what the calls have cached.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from autotp.errors import ShardingError

if TYPE_CHECKING:  # the layout search asks refused() without torch
    from autotp.distributed.data_parallel import FSDPConfig
    from autotp.plan.stages import StageRequest


class Refusal(NamedTuple):
    message: str
    hint: str


# schedules whose backward is split into an input pass and a weight pass (torch's zero-bubble schedules)
_SPLIT_BACKWARD = ("interleavedzerobubble", "zbvzerobubble")


def refused(*, pipeline: int = 1, schedule: str | None = None, fsdp: bool = False, sequence_parallel: bool = False,
            expert_parallel: bool = False, compile: bool = False) -> Refusal | None:
    """Why these dimensions do not run together yet (None: they do). The one rule :meth:`Options.validate`,
    :func:`autotp.pipeline`, the command line and the layout search all ask."""
    if pipeline > 1 and fsdp and schedule is not None and schedule.lower() in _SPLIT_BACKWARD:
        # measured: the weight pass runs outside FSDP's gradient hooks, and the gradients come out wrong
        return Refusal(f"fsdp with the {schedule} schedule is not supported yet: its weight-gradient pass runs "
                       "apart from the backward FSDP reduces after", "use 1F1B, GPipe, Interleaved1F1B or "
                       "LoopedBFS with fsdp, or drop fsdp (DDP over the data-parallel ranks)")
    return None


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
    # blocks several ranks hold (kv heads fewer than tp) kept whole and cut in the graph: set where FSDP shards
    # the parameters (its DTensors over tp are sharded or replicated, never a block on some of the ranks)
    whole_kv_copies: bool = False

    def validate(self) -> Options:
        """``self``, or a :class:`ShardingError` naming what does not run together and the numbers given.
        The one place a combination of dimensions is refused: the command line and the layout search ask it
        too."""
        if not isinstance(self.vocab_multiple, int) or self.vocab_multiple < 1:
            raise ShardingError(f"vocab_multiple must be a positive integer, got {self.vocab_multiple!r}")
        reason = refused(pipeline=self.pipeline.count if self.pipeline is not None else 1, fsdp=self.fsdp is not None,
                         sequence_parallel=self.sequence_parallel, expert_parallel=self.expert_parallel,
                         compile=bool(self.compile))
        if reason is not None:
            raise ShardingError(reason.message, hint=reason.hint)
        return self

    def cache_options(self) -> dict:
        """The options a plan depends on, for the plan cache's key."""
        return {"vocab_multiple": self.vocab_multiple, "sequence_parallel": self.sequence_parallel,
                "expert_parallel": self.expert_parallel, "whole_kv_copies": self.whole_kv_copies}
