"""Which combinations of sizes and options autotp runs: the one rule every caller asks, without torch.

:func:`refused` answers for the dimensions together (pipeline stages, FSDP and HSDP over the data-parallel and
context-parallel ranks, context and sequence parallelism, DDP's options, FSDP's mixed precision, the shard
command's parity check); :meth:`PipelineOptions.validate` for the pipeline's own options (schedule, stages per
rank, micro-batches). :class:`autotp.options.Options` (so :func:`autotp.parallelize` and :func:`autotp.pipeline`),
the launcher (:class:`~autotp.distributed.launch.LaunchSpec`, :class:`~autotp.distributed.job.RankJob`), the
FSDP meshes, ``autotp plan``, ``autotp shard`` and the layout search all ask these, so they never disagree. A
caller passes what it knows; a size it does not know is None and its rules are not checked. A refusal's
message names every number it was given; its ``fields`` name the settings it speaks of, as the message spells
them, so that a command line can spell them as its flags.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from autotp.errors import PipelineError

__all__ = ["PLACEMENTS", "PipelineOptions", "Refusal", "refused"]

# torch.distributed.pipelining's schedules by name, and how each places its stages: "single" one stage per
# rank, "loop" stage s on rank s mod pp, "v" two per rank folded back (the classes: autotp.parallel.pipeline)
PLACEMENTS: dict[str, str] = {"GPipe": "single", "1F1B": "single", "Interleaved1F1B": "loop", "LoopedBFS": "loop",
                              "InterleavedZeroBubble": "loop", "ZBVZeroBubble": "v"}
# schedules that run a micro-batch's backward while others' forwards are in flight: m >= pp
_STEADY = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
# schedules whose backward is split into an input pass and a weight pass (torch's zero-bubble schedules)
_SPLIT_BACKWARD = ("interleavedzerobubble", "zbvzerobubble")


class Refusal(NamedTuple):
    """Why a combination does not run: the message (every number given), what to do instead, and the
    settings it names (``fsdp``, ``dp``, ``cp``, ...) as the message spells them."""

    message: str
    hint: str
    fields: tuple[str, ...] = ()


def refused(*, pipeline: int = 1, schedule: str | None = None, fsdp: bool = False, sequence_parallel: bool = False,
            expert_parallel: bool = False, compile: bool = False, context_parallel: int = 1,
            dp: int | None = None, hsdp: int | None = None, staged: tuple[str, ...] = (),
            ddp_options: bool = False, fsdp_param_dtype: str | None = None, parity_check: bool = False,
            placed: tuple[int, int] | None = None, trainer: bool = False) -> Refusal | None:
    """Why these dimensions do not run together (None: they do).

    ``pipeline``: pipeline stages in all (pp × stages per rank; 1: none); ``schedule``: its name (any case);
    ``fsdp``: FSDP2 shards the parameters; ``context_parallel``: cp; ``dp``: the whole job's data-parallel size
    (every node's replicas; None: not known here); ``hsdp``: FSDP's replica groups (None or 1: plain FSDP);
    ``staged``: the pipeline's own options given (``schedule``, ``virtual_stages``, ``microbatches``,
    ``split_points``), which need stages; ``ddp_options``: DistributedDataParallel's keyword arguments given;
    ``fsdp_param_dtype``: FSDP's mixed-precision dtype asked for; ``parity_check``: the result is compared
    with the unsharded model in its own dtype to 1e-5; ``placed``: (pp, stages per rank) of the schedule
    validated, whose product must be ``pipeline``; ``trainer``: the Hugging Face Trainer integration drives the
    steps."""
    cp = context_parallel
    if staged and pipeline <= 1:  # they would be dropped without a word
        names = ", ".join(staged)
        return Refusal(f"{names} {'applies' if len(staged) == 1 else 'apply'} to pipeline stages, and pp is "
                       f"{pipeline}", "give pp 2 or more", (*staged, "pp"))
    if placed is not None and placed[0] * placed[1] != pipeline:
        return Refusal(f"{pipeline} stages asked for, and the schedule {schedule} places pp {placed[0]} × virtual "
                       f"stages {placed[1]} = {placed[0] * placed[1]}",
                       "ask for pp × virtual_stages stages", ("pp", "virtual_stages"))
    if hsdp is not None and hsdp > 1 and not fsdp:
        return Refusal(f"hsdp {hsdp} shards within replica groups: it needs fsdp", "add fsdp, or drop hsdp",
                       ("hsdp", "fsdp"))
    if fsdp_param_dtype is not None and not fsdp:
        return Refusal(f"fsdp_param_dtype {fsdp_param_dtype} sets FSDP's mixed precision: it goes with fsdp",
                       "add fsdp, or drop fsdp_param_dtype", ("fsdp_param_dtype", "fsdp"))
    if ddp_options and fsdp:
        return Refusal("data_parallel options (DistributedDataParallel's) were given with fsdp, whose "
                       "reduce-scatter averages the gradients over the data-parallel ranks instead",
                       "drop data_parallel, or drop fsdp to average with DDP", ("data_parallel", "fsdp"))
    if fsdp and dp is not None and dp * cp == 1:  # FSDP shards over dp × cp ranks (torchtitan's dp_shard·cp)
        return Refusal(f"fsdp shards the parameters over the data-parallel and context-parallel ranks, and "
                       f"there is one: dp {dp} × cp {cp} = 1", "give dp 2 or more (or cp 2 or more), or drop fsdp",
                       ("fsdp", "dp", "cp"))
    if fsdp and dp is not None and hsdp is not None and dp % hsdp:  # the replicas split dp; cp stays in a shard
        within = f" (the cp {cp} ranks shard within each group)" if cp > 1 else ""
        return Refusal(f"hsdp {hsdp} replica groups do not divide the dp {dp} data-parallel ranks{within}",
                       f"give hsdp a divisor of {dp}", ("hsdp", "dp", "cp") if cp > 1 else ("hsdp", "dp"))
    if cp > 1 and pipeline > 1 and fsdp:  # the stages' FSDP shards summed over cp after the step: not measured yet
        return Refusal(f"context parallelism (cp {cp}) with pipeline stages does not run with fsdp over the "
                       f"stages yet ({pipeline} stages)", "drop fsdp (DDP over the data-parallel ranks), or drop cp",
                       ("cp", "fsdp"))
    if pipeline > 1 and fsdp and schedule is not None and schedule.lower() in _SPLIT_BACKWARD:
        # measured: the weight pass runs outside FSDP's gradient hooks, and the gradients come out wrong
        return Refusal(f"fsdp with the {schedule} schedule is not supported yet: its weight-gradient pass runs "
                       "apart from the backward FSDP reduces after", "use 1F1B, GPipe, Interleaved1F1B or "
                       "LoopedBFS with fsdp, or drop fsdp (DDP over the data-parallel ranks)", ("fsdp",))
    if trainer and pipeline > 1:  # its loop calls the model's forward and backward: no schedule runs the stages
        return Refusal(f"the Trainer integration runs no pipeline stages; this job has pp {pipeline}",
                       "run the stages with autotp.pipeline and a loop of your own, or drop pp", ("pp",))
    if parity_check and fsdp_param_dtype is not None:  # 16-bit compute is not the fp32 model's to 1e-5
        return Refusal(f"fsdp_param_dtype {fsdp_param_dtype} computes in 16 bits: the parity check against the "
                       "unsharded model in its own dtype cannot hold to 1e-5",
                       "drop verify (it is off by default with fsdp_param_dtype)", ("fsdp_param_dtype", "verify"))
    return None


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
