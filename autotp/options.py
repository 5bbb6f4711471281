"""What :func:`autotp.parallelize` and :func:`autotp.pipeline` are asked for, as one frozen value validated once.

:class:`Options` holds every choice beyond the process group (vocab padding, compile, input checks,
sequence and expert parallelism, FSDP with its mixed precision, DDP's options, pipeline stages with their
schedule, micro-batches and virtual stages: :class:`PipelineOptions`); :meth:`Options.validate` refuses a combination
that does not run, in one place, before any rank does work. The command line and the layout search ask the
same rules (:func:`refused`, :meth:`PipelineOptions.validate`) without torch. The model's state
(:class:`~autotp.state.TPState`) keeps it beside this rank's identity and what the calls have cached.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

from autotp.errors import PipelineError, ShardingError

if TYPE_CHECKING:  # the layout search asks refused() without torch
    from autotp.distributed.data_parallel import FSDPConfig
    from autotp.plan.stages import StageRequest


# torch.distributed.pipelining's schedules by name, and how each places its stages: "single" one stage per
# rank, "loop" stage s on rank s mod pp, "v" two per rank folded back (the classes: autotp.parallel.pipeline)
PLACEMENTS: dict[str, str] = {"GPipe": "single", "1F1B": "single", "Interleaved1F1B": "loop", "LoopedBFS": "loop",
                              "InterleavedZeroBubble": "loop", "ZBVZeroBubble": "v"}
# schedules that run a micro-batch's backward while others' forwards are in flight: m >= pp
_STEADY = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")


@dataclass(frozen=True)
class PipelineOptions:
    """Pipeline stages as asked for: ``pp`` pipeline ranks, the schedule by name (any case), micro-batches per
    step (None: pp), stages per rank (None: 1, or 2 for the interleaved and V schedules) and the blocks that
    start stages 1, 2, ... (empty: balanced by FLOPs)."""

    pp: int
    schedule: str = "1F1B"
    microbatches: int | None = None
    virtual_stages: int | None = None
    split_points: tuple[str, ...] = ()

    @property
    def placement(self) -> str:
        return PLACEMENTS[self.schedule]

    @property
    def count(self) -> int:
        """Stages in all (pp × virtual stages); of a validated value."""
        return self.pp * (self.virtual_stages or 1)

    def validate(self, batch: int | None = None) -> PipelineOptions:
        """The same request with the schedule's own spelling and every default filled in, or a
        :class:`PipelineError` naming the numbers given; ``batch``: the step's batch, which the micro-batches
        must divide."""
        name = {k.lower(): k for k in PLACEMENTS}.get(str(self.schedule).lower())
        if name is None:
            raise PipelineError(f"unknown pipeline schedule {self.schedule!r}", hint=f"use one of {', '.join(PLACEMENTS)}")
        placement = PLACEMENTS[name]
        v = self.virtual_stages if self.virtual_stages is not None else (1 if placement == "single" else 2)
        m = self.microbatches if self.microbatches is not None else self.pp
        for what, value in (("pp", self.pp), ("microbatches", m), ("virtual_stages", v)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PipelineError(f"{what} must be an integer >= 1, got {value!r}")
        if placement == "single" and v != 1:
            raise PipelineError(f"schedule {name} runs one stage per rank, and virtual_stages is {v}",
                                hint="use Interleaved1F1B, LoopedBFS or InterleavedZeroBubble for several stages "
                                     "per rank, or virtual_stages 1")
        if placement == "loop" and v < 2:
            raise PipelineError(f"schedule {name} interleaves several stages per rank, and virtual_stages is {v}",
                                hint="use virtual_stages >= 2, or GPipe / 1F1B for one stage per rank")
        if placement == "v" and v != 2:
            raise PipelineError(f"schedule {name} places exactly 2 stages per rank (a V), and virtual_stages is {v}",
                                hint="use virtual_stages 2")
        if name in _STEADY and m < self.pp:
            raise PipelineError(f"schedule {name} needs at least as many micro-batches as pipeline ranks: "
                                f"microbatches {m} < pp {self.pp}", hint=f"use microbatches >= {self.pp}")
        if batch is not None and batch % m:
            raise PipelineError(f"{m} micro-batches do not divide the batch of {batch}",
                                hint=f"use a number of micro-batches that divides {batch}")
        return PipelineOptions(self.pp, name, m, v, tuple(self.split_points))


class Refusal(NamedTuple):
    message: str
    hint: str


# schedules whose backward is split into an input pass and a weight pass (torch's zero-bubble schedules)
_SPLIT_BACKWARD = ("interleavedzerobubble", "zbvzerobubble")


def refused(*, pipeline: int = 1, schedule: str | None = None, fsdp: bool = False, sequence_parallel: bool = False,
            expert_parallel: bool = False, compile: bool = False, context_parallel: int = 1) -> Refusal | None:
    """Why these dimensions do not run together yet (None: they do). The one rule :meth:`Options.validate`,
    :func:`autotp.pipeline`, the command line and the layout search all ask."""
    if context_parallel > 1:
        if pipeline > 1 and fsdp:  # the stages' FSDP shards summed over cp after the step: not measured yet
            return Refusal(f"context parallelism (cp {context_parallel}) with pipeline stages does not run with "
                           "fsdp over the stages yet", "drop fsdp (DDP over the data-parallel ranks), or drop cp")
    if pipeline > 1 and fsdp and schedule is not None and schedule.lower() in _SPLIT_BACKWARD:
        # measured: the weight pass runs outside FSDP's gradient hooks, and the gradients come out wrong
        return Refusal(f"fsdp with the {schedule} schedule is not supported yet: its weight-gradient pass runs "
                       "apart from the backward FSDP reduces after", "use 1F1B, GPipe, Interleaved1F1B or "
                       "LoopedBFS with fsdp, or drop fsdp (DDP over the data-parallel ranks)")
    return None


# DistributedDataParallel's arguments autotp sets itself (the layout's or mesh's data-parallel group, the device)
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
                            "group of the layout or mesh, and the device)",
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
        if isinstance(self.data_parallel, dict) and (self.fsdp is not None or self.stage_fsdp):
            raise ShardingError("data_parallel options (DistributedDataParallel's) were given with fsdp, whose "
                                "reduce-scatter averages the gradients over the data-parallel ranks instead",
                                hint="drop data_parallel, or drop fsdp to average with DDP")
        schedule = self.schedule.validate() if self.schedule is not None else None
        if schedule is not None and self.pipeline is not None and schedule.count != self.pipeline.count:
            raise PipelineError(f"{self.pipeline.count} stages asked for, and the schedule {schedule.schedule} "
                                f"places pp {schedule.pp} × virtual stages {schedule.virtual_stages}")
        stages = self.pipeline.count if self.pipeline is not None else 1
        reason = refused(pipeline=stages, schedule=None if schedule is None else schedule.schedule,
                         fsdp=self.fsdp is not None or self.stage_fsdp, sequence_parallel=self.sequence_parallel,
                         expert_parallel=self.expert_parallel, compile=bool(self.compile), context_parallel=cp)
        if reason is not None:
            raise (PipelineError if stages > 1 else ShardingError)(reason.message, hint=reason.hint)
        return self if schedule is None else replace(self, schedule=schedule)

    def cache_options(self) -> dict:
        """The options a plan depends on, for the plan cache's key."""
        return {"vocab_multiple": self.vocab_multiple, "sequence_parallel": self.sequence_parallel,
                "expert_parallel": self.expert_parallel, "whole_kv_copies": self.whole_kv_copies,
                "context_parallel": self.context_parallel}
