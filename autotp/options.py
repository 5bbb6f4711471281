"""What :func:`autotp.parallelize` and :func:`autotp.pipeline` are asked for, as one frozen value validated once.

:class:`Options` holds every choice beyond the process group (vocab padding, compile, input checks,
sequence and expert parallelism, FSDP with its mixed precision, DDP's options, pipeline stages with their
schedule, micro-batches and virtual stages: :class:`PipelineOptions`); :meth:`Options.validate` refuses a combination
that does not run before any rank does work, by the one rule of :mod:`autotp.combinations` (:func:`refused`,
:meth:`PipelineOptions.validate`), which the launcher, the command line and the layout search ask too. The model's state
(:class:`~autotp.state.TPState`) keeps it beside this rank's identity and what the calls have cached.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

# the one rule of combinations lives below the launcher (autotp.combinations); re-exported for its callers here
from autotp.combinations import PLACEMENTS, PipelineOptions, Refusal, refused
from autotp.errors import PipelineError, ShardingError

__all__ = ["PLACEMENTS", "Options", "PipelineOptions", "Refusal", "refused"]

if TYPE_CHECKING:  # torch-free: the command line imports this module before torch
    from autotp.distributed.data_parallel import FSDPConfig
    from autotp.plan.stages import StageRequest


# DistributedDataParallel's arguments autotp sets itself (the rank grid's or mesh's data-parallel group, the device)
_DDP_OWN = ("module", "process_group", "device_mesh", "device_ids", "output_device")


def _check_data_parallel(value: object) -> None:
    """``data_parallel``: True, False, or a dict of DistributedDataParallel's keyword arguments
    (``bucket_cap_mb``, ``find_unused_parameters``, ...) other than those autotp sets."""
    if isinstance(value, bool):
        return
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ShardingError(f"data_parallel must be True, False or a dict of DistributedDataParallel's keyword "
                            f"arguments, got {value!r}")
    own = [k for k in value if k in _DDP_OWN]
    if own:
        raise ShardingError(f"data_parallel sets {', '.join(own)}, which autotp sets itself (the data-parallel "
                            "group of the rank grid or mesh, and the device)",
                            hint="pass a mesh with a 'dp' dim, or run under `autotp run --dp D`")


@dataclass(frozen=True)
class Options:
    """The choices :func:`autotp.parallelize` was given (see its docstring for each)."""

    vocab_multiple: int = 1
    compile: bool | dict = False  # a dict: torch.compile's options
    check_inputs: bool = False
    sequence_parallel: bool = False
    expert_parallel: bool = False
    fsdp: FSDPConfig | None = None  # sharded data parallelism over the mesh's dp dim(s); its mixed precision
    pipeline: StageRequest | None = None  # pipelined: every graph is cut into these stages
    schedule: PipelineOptions | None = None  # pipelined: the stages' schedule, micro-batches and stages per rank
    # blocks several ranks hold (kv heads fewer than tp) kept whole and cut in the graph: set where FSDP shards
    # the parameters (its DTensors over tp are sharded or replicated, never a block on some of the ranks)
    whole_kv_copies: bool = False
    stage_fsdp: bool = False  # pipelined: each stage is made one FSDP unit after parallelize
    context_parallel: int = 1  # ranks each running 1/cp of the sequence (ring attention between them)
    # gradients averaged over the data-parallel group by DDP where no FSDP or pipeline does it (a dict:
    # DistributedDataParallel's keyword arguments); False: the script averages them itself
    data_parallel: bool | dict = True

    def validate(self) -> Options:
        """``self``, or a :class:`ShardingError` naming what does not run together and the numbers given.
        The one place a combination of dimensions is refused: the command line and the layout search ask it
        too."""
        if not isinstance(self.vocab_multiple, int) or self.vocab_multiple < 1:
            raise ShardingError(f"vocab_multiple must be a positive integer, got {self.vocab_multiple!r}")
        cp = self.context_parallel
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
            raise ShardingError(f"context_parallel must be a positive integer, got {cp!r}")
        _check_data_parallel(self.data_parallel)
        schedule = self.schedule.validate() if self.schedule is not None else None
        stages = self.pipeline.count if self.pipeline is not None else 1
        # the data-parallel size is the mesh's, known once the groups are: FSDP's meshes ask the rule for it
        reason = refused(pipeline=stages, schedule=None if schedule is None else schedule.schedule,
                         fsdp=self.fsdp is not None or self.stage_fsdp, sequence_parallel=self.sequence_parallel,
                         expert_parallel=self.expert_parallel, compile=bool(self.compile), context_parallel=cp,
                         ddp_options=isinstance(self.data_parallel, dict),
                         hsdp=None if self.fsdp is None else self.fsdp.replicas,
                         placed=None if schedule is None or self.pipeline is None else
                         (schedule.pp, schedule.virtual_stages))
        if reason is not None:
            raise (PipelineError if stages > 1 else ShardingError)(reason.message, hint=reason.hint)
        return self if schedule is None else replace(self, schedule=schedule)

    def cache_options(self) -> dict:
        """The options a plan depends on, for the plan cache's key."""
        return {"vocab_multiple": self.vocab_multiple, "sequence_parallel": self.sequence_parallel,
                "expert_parallel": self.expert_parallel, "whole_kv_copies": self.whole_kv_copies,
                "context_parallel": self.context_parallel}
