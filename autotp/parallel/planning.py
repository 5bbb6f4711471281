"""Capture a model's call and plan it: :func:`capture_and_plan`, written once for everything that plans.

``parallelize`` (each call signature; the first one looked up in the plan cache), ``autotp plan``
(:func:`plan_file`: one size, cached; with ``--cp`` the context plan from the same capture), ``autotp
shard``'s check before any rank starts (its plan stored in the job's own cache, where the ranks find it),
``autotp profile`` (the model's matmuls) and the layout search (several sizes from one capture) all call it.

What a plan depends on besides the graph is one frozen value, :class:`PlanJob` (the sizes and the options
that change the plan), and how the call is captured, :class:`How`. The plan cache
(:mod:`autotp.plan.cache`) keys a plan by the ops the forward runs on meta, every tensor's name, shape and
dtype, the versions of torch and autotp, and :func:`cache_options` of the job: the one key schema. The meta
run that makes the key is also where a capture that misses starts from. A folder that cannot be written (a
read-only home, a full disk) plans without the cache.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.fx as fx
import torch.nn as nn

from autotp.analysis.context import find_context
from autotp.capture.islands import ISLANDS_KEY
from autotp.capture.meta_run import Recorder
from autotp.capture.modelfile import load_model_file, planning_batch
from autotp.capture.repeats import Copies, record_whole
from autotp.capture.structure import Spec
from autotp.capture.tracer import CutGraph, capture_blocks, input_guard, meta_call, stand_ins
from autotp.errors import PlanSizeError
from autotp.options import Options
from autotp.plan import cache as plan_cache
from autotp.plan.context import ContextPlan
from autotp.plan.context_planner import check_chunks, context_plan
from autotp.reports.context import ContextReport, context_report
from autotp.reports.pipeline import PipelineReport, PipelineSpec, check_microbatches, pipeline_report
from autotp.plan.plan import ParamShard, Plan, Stage
from autotp.plan.planner import cut_copies_in_graph, fused_segments, group_seq_grads, make_plan
from autotp.reports.sharding import Report, build_report
from autotp.plan.stages import StageRequest
from autotp.reports.symbols import size_ranges

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PlanJob:
    """What a plan depends on besides the graph: the sizes and the options that change it."""

    tp: int
    cp: int = 1  # context parallelism: the forward on 1/cp of the sequence (with ``context``)
    vocab_multiple: int = 1
    sequence_parallel: bool = False
    expert_parallel: bool = False
    stages: StageRequest | None = None  # cut into pipeline stages (the first call signature of a pipeline)
    stages_of: tuple[Stage, ...] = ()  # a later call signature of a pipeline runs the first one's stages
    # blocks several ranks hold (kv heads fewer than tp) kept whole and cut in the graph (FSDP's DTensors)
    whole_kv_copies: bool = False
    fsdp: bool = False  # FSDP units: sequence-parallel gradients summed per unit, and kv copies cut in the graph
    context: bool = True  # False: with cp > 1, the whole sequence on every cp rank (no context plan)

    @property
    def pipelined(self) -> bool:
        return self.stages is not None or bool(self.stages_of)

    @property
    def reusable(self) -> bool:
        """Whether ranks shard from a cached plan of this job (``parallelize`` at tp > 1 without FSDP or
        pipeline stages: those cut the graph into units or stages when they parallelize, and at tp 1 the
        fused segments are read from the graph)."""
        return self.tp > 1 and not self.fsdp and not self.pipelined


@dataclass(frozen=True)
class How:
    """How the call is captured: ``forward`` in place of the model's own, ``params`` full-size stand-ins for
    named tensors (shards, meta weights), ``device`` where the graph runs, ``static`` every size as given (a
    pipeline's stages), ``writes`` the state the forward writes returned after its outputs (parallelize's),
    ``autocast`` ("bf16", "fp16") under ``torch.autocast`` on the CPU as a training script runs the forward."""

    forward: Callable | None = None
    params: dict[str, torch.Tensor] | None = None
    device: torch.device | None = None
    static: bool = False
    writes: bool = False
    autocast: str | None = None


@dataclass(frozen=True)
class PlanCache:
    """Where plans are looked up and stored: ``folder`` (None: the user's, :func:`autotp.plan.cache.cache_dir`;
    a job's own folder where ``autotp shard``'s check hands its plan to the ranks)."""

    folder: Path | None = None


def cache_options(job: PlanJob, how: How, training: bool) -> dict:
    """The one key schema: everything of the job and of the capture that changes the graph or the plan."""
    return {**dataclasses.asdict(job), "static": how.static, "writes": how.writes, "autocast": how.autocast,
            "training": training}


@dataclass(frozen=True)
class Lookup:
    """The cache key of one call (None: not cached: its forward does not run on meta, or no cache), the
    plan stored under it if any, and the meta run of the call, which a capture that misses starts from."""

    key: str | None
    cache: PlanCache | None = None
    plan: Plan | None = None
    path: Path | None = None  # the cached plan's file
    extra: dict = field(default_factory=dict)  # what was stored beside the plan
    recorded: Recorder | None = None


def _lookup(model: nn.Module, forward: Callable, args: tuple, kwargs: dict, options: dict,
            cache: PlanCache) -> Lookup:
    run = meta_call(forward, args, kwargs)
    rec = record_whole(model, run)
    key = plan_cache.plan_key(model, run, options, rec)
    if key is None:
        return Lookup(None)
    hit = plan_cache.load(key, cache.folder)
    if hit is not None:
        return Lookup(key, cache, hit.plan, hit.path, dict(hit.extra))
    return Lookup(key, cache, recorded=rec)


def _store(found: Lookup, plan: Plan, extra: dict | None) -> Path | None:
    """Store the plan a miss made; its file, or None where nothing was stored."""
    if found.key is None or found.cache is None or found.plan is not None:
        return None
    try:
        return plan_cache.store(found.key, plan, extra, found.cache.folder)
    except OSError:  # a read-only home, a full disk: plan without the cache
        return None


@dataclass(frozen=True)
class Planned:
    """The plans of one call: ``plans[tp]`` for each size asked (a size the planner refuses is missing when
    ``skip_refused``); the graph they are of and its output structure (None: the plan came from the cache);
    where the plan is cached. ``copies``: the plan is of the exported blocks only, and the caller copies
    the rewritten blocks in (:class:`~autotp.capture.repeats.Copies`); where they cannot be (the rewritten
    blocks are not wired one after another), ``whole()`` is the whole model exported and planned for the same
    job. ``accepts``: the graph's input guard, taken as captured; ``segments``: the fused projections'
    segments, asked for at tp 1."""

    plans: dict[int, Plan]
    gm: fx.GraphModule | None
    spec: Spec | None
    found: Lookup
    path: Path | None = None
    copies: Copies | None = None
    accepts: Callable | None = None
    segments: dict[str, ParamShard] | None = None
    whole: Callable[[], Planned] | None = None

    @property
    def cached(self) -> bool:
        return self.gm is None

    @property
    def plan(self) -> Plan:
        """The plan of the smallest size asked (of the one size, mostly)."""
        return self.plans[min(self.plans)]


def capture(model: nn.Module, args: tuple, kwargs: dict, how: How, recorded: Recorder | None) -> CutGraph:
    """The call exported (:func:`~autotp.capture.tracer.capture_blocks`), its repeated blocks not copied yet."""
    amp = torch.autocast("cpu", dtype=AUTOCAST[how.autocast]) if how.autocast else contextlib.nullcontext()
    with amp:  # the key's meta run does not see autocast's casts: such a capture records its own
        return capture_blocks(model, args, kwargs, forward=how.forward, params=how.params, device=how.device,
                              static=how.static, recorded=None if how.autocast else recorded, writes=how.writes)


def capture_and_plan(model: nn.Module, args: tuple, kwargs: dict, job: PlanJob, cache: PlanCache | None = None, *,
                     how: How = How(), tps: Iterable[int] | None = None, skip_refused: bool = False,
                     blocks: bool = False, segments: bool = False,
                     extra: Callable[[fx.GraphModule], dict] | None = None) -> Planned:
    """Capture ``model`` on ``(args, kwargs)`` once and plan it for ``job`` (at each size in ``tps``, default
    ``job.tp``).

    ``cache``: look the plan up under the key of the call and the job (one size only; a graph with eager
    islands is not stored: their cuts are made when the model is parallelized), and store it on a miss with
    ``extra(gm)`` beside it. ``blocks``: where the job lets the rewritten blocks be copied (no sequence
    parallelism, stages, FSDP or context parallelism), plan the exported blocks alone (a later call
    signature of a sharded model: its cuts are checked against the first one's). ``segments``: read the fused
    projections' segments off the whole graph as captured (before any pass wraps its parameters)."""
    sizes = sorted(set(tps) if tps is not None else {job.tp})
    forward = how.forward or type(model).forward.__get__(model)
    found = Lookup(None)
    if cache is not None:
        if len(sizes) != 1:
            raise ValueError(f"plans are cached one size at a time, not for tp in {sizes}")
        found = _lookup(model, forward, args, kwargs, cache_options(job, how, model.training), cache)
        if found.plan is not None:
            return Planned({sizes[0]: found.plan}, None, None, found, found.path)
    cg = capture(model, args, kwargs, how, found.recorded)
    accepts = input_guard(cg.gm)  # before the caller's passes give sharded inputs their local shapes
    if blocks and cg.copies is not None and not (job.sequence_parallel or job.pipelined or job.fsdp or job.cp > 1):
        # sequence parallelism groups several blocks' values in one node: the blocks are copied first then

        def whole() -> Planned:  # the cut graph is rewritten by then: the whole model exported afresh
            gm, spec = cg.export_whole()
            return Planned({job.tp: plan_graph(gm, job)}, gm, spec, found, accepts=accepts)

        return Planned({job.tp: plan_graph(cg.gm, job)}, cg.gm, cg.spec, found, copies=cg.copies, accepts=accepts,
                       whole=whole)
    gm, spec = cg.whole()
    found_segments = fused_segments(gm) if segments else None
    plans = {}
    for tp in sizes:
        try:
            plans[tp] = plan_graph(gm, dataclasses.replace(job, tp=tp))
        except ValueError:
            if not skip_refused:
                raise
    path = None
    if cache is not None and not gm.meta.get(ISLANDS_KEY):
        path = _store(found, plans[sizes[0]], extra(gm) if extra is not None else None)
    return Planned(plans, gm, spec, found, path, accepts=accepts, segments=found_segments)


def job_of(tp: int, options: Options, *, sequence_parallel: bool | None = None, context: bool = True,
           stages_of: tuple[Stage, ...] = ()) -> PlanJob:
    """The job of parallelizing with ``options`` at ``tp``: ``parallelize``'s, and ``autotp shard``'s check's,
    whose cached plan the ranks then find under the same key. ``sequence_parallel``: in place of the
    options' (a call whose length tp does not divide runs without it); ``context`` False: the whole sequence
    on every cp rank; ``stages_of``: a later call signature of a pipeline runs the first one's stages."""
    return PlanJob(tp, options.context_parallel, options.vocab_multiple,
                   options.sequence_parallel if sequence_parallel is None else sequence_parallel,
                   options.expert_parallel, None if stages_of else options.pipeline, tuple(stages_of),
                   options.whole_kv_copies, options.fsdp is not None, context)


def plan_graph(gm: fx.GraphModule, job: PlanJob) -> Plan:
    """The plan of ``gm`` for ``job``: the tensor-parallel plan (with its stages), then what each dimension
    adds to it, in this order: kv copies cut in the graph (FSDP's DTensors are sharded or replicated over tp,
    never a block on some ranks), the context plan (refused here, naming the ops, where the forward cannot
    run on a chunk; FSDP's reduce-scatter over the dp and cp ranks sums the chunks' gradients, and a
    pipeline's step sums its stages', so only plain data parallelism sums them itself), and FSDP's sequence-
    parallel gradient sums, one per unit."""
    plan = make_plan(gm, job.tp, job.vocab_multiple, sequence_parallel=job.sequence_parallel,
                     expert_parallel=job.expert_parallel, stages=job.stages)
    if job.stages_of:  # a later call signature runs the first one's stages
        plan = group_seq_grads(gm, dataclasses.replace(plan, stages=job.stages_of), "stage")
    if job.whole_kv_copies or job.fsdp:
        plan = cut_copies_in_graph(gm, plan)
    if job.cp > 1 and job.context:
        plan = dataclasses.replace(plan, context=context_of(gm, job.cp, sum_grads=not job.fsdp and not job.pipelined))
    if job.fsdp:
        plan = group_seq_grads(gm, plan, "unit")
    return plan


def context_of(gm: fx.GraphModule, cp: int, sum_grads: bool = True) -> ContextPlan:
    """The context plan of ``gm`` at ``cp`` (:func:`~autotp.plan.context_planner.context_plan`); raises the
    refusal naming each op that stops it."""
    return context_plan(gm, find_context(gm, cp), cp, sum_grads=sum_grads)


class FilePlan(NamedTuple):
    """What planning a model file gives ``autotp plan``: the plan, its numbers, and what the report shows."""

    plan: Plan
    report: Report
    names: list[str]  # every parameter name of the model, in its order
    batch_note: str  # says when the default batch was used ("" otherwise)
    pipeline: PipelineReport | None = None  # with --pp > 1
    cached: Path | None = None  # the plan cache entry read or written
    context: ContextReport | None = None  # with cp > 1


def plan_file(model: str, tp: int, batch: int | None = None, seq: int | None = None,
              vocab_multiple: int = 1, sequence_parallel: bool = False, autocast: str | None = None,
              expert_parallel: bool = False, pipeline: PipelineSpec | None = None, cache: bool = True,
              fsdp: bool = False, dp: int = 1, cp: int = 1) -> FilePlan:
    """Load the model file ``model``, build on meta, capture, plan, and compute the report; no printing.
    ``autocast`` ("bf16" or "fp16"): capture under ``torch.autocast`` as a training script runs the forward, so
    the collectives are counted in the dtypes that travel then (the parameters are CPU stand-ins for that
    capture: address space, never written). ``pipeline``: cut the blocks into its pp × v stages and report
    them; its micro-batches must divide the batch, which is checked before the capture. ``fsdp``: as FSDP runs
    it (over ``dp`` ranks: a pipeline rank's training state is split over them). ``cp`` > 1: the context plan
    from the same capture and its report; raises the refusal a rank would raise, naming each op that stops
    it, or a length 2·cp does not divide.
    """
    mf = load_model_file(model)
    with torch.device("meta"):
        net = mf.build()
    args, kwargs, b, s, batch_note = planning_batch(mf, net, batch, seq)
    if pipeline is not None:
        check_microbatches(pipeline.microbatches, b)  # the rest of the spec was checked when it was made
    # a pipeline's report and a context report read the graph itself: it is captured every time
    cached = PlanCache() if cache and pipeline is None and cp == 1 else None
    # a module-level instance was built before the meta context: capture reads it without computing
    cpu, swap = torch.device("cpu"), None
    if autocast is not None:  # autocast acts on CPU tensors, not on meta ones
        swap = stand_ins({**dict(net.named_parameters(remove_duplicate=False)),
                          **dict(net.named_buffers(remove_duplicate=False))}, cpu)
    stages = None if pipeline is None else StageRequest(len(pipeline.ranks), pipeline.split_points)
    job = PlanJob(tp, cp, vocab_multiple, sequence_parallel, expert_parallel, stages, fsdp=fsdp)
    planned = capture_and_plan(net, args, kwargs, job, cached, how=How(params=swap, device=cpu, autocast=autocast),
                               extra=lambda gm: {"ranges": size_ranges(gm)})
    plan, gm = planned.plan, planned.gm
    report = build_report(plan, net.named_parameters(remove_duplicate=False), b, s)
    ranges = {k: tuple(v) for k, v in planned.found.extra.get("ranges", {}).items()} if gm is None \
        else size_ranges(gm)
    check_sizes(report, ranges)
    names = [n for n, _ in net.named_parameters(remove_duplicate=False)]
    # under autocast the blocks' activations are 16-bit, as Korthikanti et al.'s formula counts them
    pipe = None if pipeline is None else pipeline_report(gm, plan, report, pipeline,
                                                         2 if autocast is not None else None, dp if fsdp else 1)
    context = None
    if plan.context is not None:
        if plan.context.length:
            check_chunks(plan.context.length, cp)
        context = context_report(gm, plan.context)
    return FilePlan(plan, report, names, batch_note, pipe, planned.path, context)


def check_sizes(report: Report, ranges: dict[str, tuple[int, int | None]]) -> None:
    """The numbers are for --batch / --seq; refuse sizes the model's forward would reject.

    Export's lower bound of 2 is its own (it specialises 0 and 1), not the model's, so only a larger one counts.
    """
    for sym, role in report.symbols.items():
        lo, hi = ranges.get(sym, (0, None))
        value, what, flag = (report.batch, "batch", "--batch") if role == "b" else (report.seq, "sequence", "--seq")
        if (hi is not None and value > hi) or (lo > 2 and value < lo):
            bounds = f"{lo}..{hi if hi is not None else '∞'}"
            raise PlanSizeError(f"{what} size {value} is outside what the model's forward accepts ({bounds}, "
                                "found when capturing it)", hint=f"pass a {flag} in {bounds}")
