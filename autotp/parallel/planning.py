"""Plan a model: capture its call, plan it at one or more tensor-parallel sizes, and keep the plan in the
on-disk cache (:mod:`autotp.plan.cache`) under the key of what it depends on. Written once for everything
that plans: ``parallelize`` (which looks up and stores, and captures its own way), ``autotp plan`` (one size,
cached: :func:`plan_file` loads the model file and adds the report's numbers) and the layout search (several
sizes from one capture).

The key is the ops the forward runs on meta, every tensor's name, shape and dtype, the options and the
versions of torch and autotp (:func:`autotp.plan.cache.plan_key`); the meta run that makes it is also where
a capture that misses starts from. A folder that cannot be written (a read-only home, a full disk) plans
without the cache.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.fx as fx
import torch.nn as nn

from autotp.analysis.context import find_context
from autotp.capture.meta_run import Recorder
from autotp.capture.modelfile import load_model_file, planning_batch
from autotp.capture.repeats import record_whole
from autotp.capture.tracer import capture, meta_call, stand_ins
from autotp.errors import PlanSizeError
from autotp.plan import cache as plan_cache
from autotp.plan.context_planner import check_chunks, context_plan
from autotp.plan.context_report import ContextReport, context_report
from autotp.plan.pipeline_report import PipelineReport, PipelineSpec, check_microbatches, pipeline_report
from autotp.plan.plan import Plan
from autotp.plan.planner import cut_copies_in_graph, group_seq_grads, make_plan
from autotp.plan.report import Report, build_report
from autotp.plan.stages import StageRequest
from autotp.plan.symbols import size_ranges


@dataclass(frozen=True)
class Lookup:
    """The cache key of one call (None: not cached: its forward does not run on meta, or caching is off), the
    plan stored under it if any, and the meta run of the call, which a capture that misses starts from."""

    key: str | None
    plan: Plan | None = None
    path: Path | None = None  # the cached plan's file
    extra: dict = field(default_factory=dict)  # what was stored beside the plan
    recorded: Recorder | None = None


def lookup(model: nn.Module, forward: Callable, args: tuple, kwargs: dict, options: dict) -> Lookup:
    """The key of planning ``model`` for this call with ``options``, and the plan stored under it if any."""
    run = meta_call(forward, args, kwargs)
    rec = record_whole(model, run)
    key = plan_cache.plan_key(model, run, options, rec)
    if key is None:
        return Lookup(None)
    hit = plan_cache.load(key)
    if hit is not None:
        return Lookup(key, hit.plan, hit.path, dict(hit.extra))
    return Lookup(key, recorded=rec)


def remember(found: Lookup, plan: Plan, extra: dict | None = None) -> Path | None:
    """Store the plan a miss made; its file, or None where nothing was stored."""
    if found.key is None or found.plan is not None:
        return None
    try:
        return plan_cache.store(found.key, plan, extra)
    except OSError:  # a read-only home, a full disk: plan without the cache
        return None


@dataclass(frozen=True)
class Planned:
    """The plans of one call: ``plans[tp]`` for each size asked (a size the planner refuses is missing when
    ``skip_refused``), the captured graph (None when the plan came from the cache), and where it is cached."""

    plans: dict[int, Plan]
    gm: fx.GraphModule | None
    found: Lookup
    path: Path | None = None

    @property
    def cached(self) -> bool:
        return self.gm is None


def plan_model(model: nn.Module, args: tuple, kwargs: dict, tps: Iterable[int], *, cache: bool = False,
               options: dict | None = None, vocab_multiple: int = 1, sequence_parallel: bool = False,
               expert_parallel: bool = False, stages: StageRequest | None = None,
               params: dict[str, torch.Tensor] | None = None, device: torch.device | None = None,
               amp: contextlib.AbstractContextManager | None = None, skip_refused: bool = False,
               extra: Callable[[fx.GraphModule], dict] | None = None, fsdp: bool = False) -> Planned:
    """Capture ``model`` on ``(args, kwargs)`` once and plan it at each size in ``tps``.

    ``cache`` (one size only): look the plan up under the key of the call and ``options`` (what else the
    plan depends on), and store it on a miss with ``extra(gm)`` beside it. ``params``/``device``: stand-ins
    for the model's tensors and the device to capture on; ``amp``: a context (``torch.autocast``) to capture
    under, whose ops the key's meta run does not see, so that capture records its own. ``fsdp``: plan for
    FSDP over the data-parallel ranks (sequence-parallel gradients summed per unit)."""
    sizes = sorted(set(tps))
    found = Lookup(None)
    if cache:
        if len(sizes) != 1:
            raise ValueError(f"plans are cached one size at a time, not for tp in {sizes}")
        found = lookup(model, model.forward, args, kwargs, {**(options or {}), "tp": sizes[0]})
        if found.plan is not None:
            return Planned({sizes[0]: found.plan}, None, found, found.path)
    with amp or contextlib.nullcontext():
        gm, _ = capture(model, args, kwargs, params=params, device=device,
                        recorded=found.recorded if amp is None else None)
    plans = {}
    for tp in sizes:
        try:
            plans[tp] = make_plan(gm, tp, vocab_multiple, sequence_parallel=sequence_parallel,
                                  expert_parallel=expert_parallel, stages=stages)
            if fsdp:  # as FSDP runs it: kv blocks several ranks hold cut in the graph, a gradient sum per unit
                plans[tp] = group_seq_grads(gm, cut_copies_in_graph(gm, plans[tp]), "unit")
        except ValueError:
            if not skip_refused:
                raise
    path = remember(found, plans[sizes[0]], extra(gm) if extra is not None else None) if cache else None
    return Planned(plans, gm, found, path)


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class FilePlan(NamedTuple):
    """What planning a model file gives ``autotp plan``: the plan, its numbers, and what the report shows."""

    plan: Plan
    report: Report
    names: list[str]  # every parameter name of the model, in its order
    batch_note: str  # says when the default batch was used ("" otherwise)
    pipeline: PipelineReport | None = None  # with --pp > 1
    cached: Path | None = None  # the plan cache entry read or written


def plan_file(model: str, tp: int, batch: int | None = None, seq: int | None = None,
                vocab_multiple: int = 1, sequence_parallel: bool = False, autocast: str | None = None,
                expert_parallel: bool = False, pipeline: PipelineSpec | None = None, cache: bool = True,
                fsdp: bool = False, dp: int = 1) -> FilePlan:
    """Load the model file ``model``, build on meta, capture, plan, and compute the report; no printing. ``autocast`` ("bf16" or
    "fp16"): capture under ``torch.autocast`` as a training script runs the forward, so the collectives are
    counted in the dtypes that travel then (the parameters are CPU stand-ins for that capture: address
    space, never written). ``pipeline``: cut the blocks into its pp × v stages and report them; its
    micro-batches must divide the batch, which is checked before the capture. ``fsdp``: as FSDP runs it (over
    ``dp`` ranks: a pipeline rank's training state is split over them).
    """
    mf = load_model_file(model)
    with torch.device("meta"):
        net = mf.build()
    args, kwargs, b, s, batch_note = planning_batch(mf, net, batch, seq)
    if pipeline is not None:
        check_microbatches(pipeline.microbatches, b)  # the rest of the spec was checked when it was made
    # a pipeline's report reads the graph itself: it is captured every time
    cached = cache and pipeline is None
    # a module-level instance was built before the meta context: capture reads it without computing
    cpu, swap, amp = torch.device("cpu"), None, None
    if autocast is not None:  # autocast acts on CPU tensors, not on meta ones
        swap = stand_ins({**dict(net.named_parameters(remove_duplicate=False)),
                          **dict(net.named_buffers(remove_duplicate=False))}, cpu)
        amp = torch.autocast("cpu", dtype=AUTOCAST[autocast])
    stages = None if pipeline is None else StageRequest(len(pipeline.ranks), pipeline.split_points)
    planned = plan_model(net, args, kwargs, [tp], cache=cached,
                         options={"vocab_multiple": vocab_multiple, "sequence_parallel": sequence_parallel,
                                  "expert_parallel": expert_parallel, "autocast": autocast, "fsdp": fsdp},
                         vocab_multiple=vocab_multiple, sequence_parallel=sequence_parallel,
                         expert_parallel=expert_parallel, stages=stages, params=swap, device=cpu, amp=amp,
                         extra=lambda gm: {"ranges": size_ranges(gm)}, fsdp=fsdp)
    plan, gm = planned.plans[tp], planned.gm
    report = build_report(plan, net.named_parameters(remove_duplicate=False), b, s)
    ranges = {k: tuple(v) for k, v in planned.found.extra.get("ranges", {}).items()} if gm is None \
        else size_ranges(gm)
    check_sizes(report, ranges)
    stored = planned.path
    names = [n for n, _ in net.named_parameters(remove_duplicate=False)]
    # under autocast the blocks' activations are 16-bit, as Korthikanti et al.'s formula counts them
    pipe = None if pipeline is None else pipeline_report(gm, plan, report, pipeline,
                                                         2 if autocast is not None else None, dp if fsdp else 1)
    return FilePlan(plan, report, names, batch_note, pipe, stored)


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


def context_file(model: str, batch: int | None, seq: int | None, cp: int) -> ContextReport:
    """The context-parallel report of the model file at ``cp`` (captured on meta as :func:`plan_file` does);
    raises the refusal a rank would raise, naming each op that stops it, or a length 2·cp does not divide."""
    mf = load_model_file(model)
    with torch.device("meta"):
        net = mf.build()
    args, kwargs, _, _, _ = planning_batch(mf, net, batch, seq)
    gm, _ = capture(net, args, kwargs, device=torch.device("cpu"))
    plan = context_plan(gm, find_context(gm, cp), cp)
    if plan.length:
        check_chunks(plan.length, cp)
    return context_report(gm, plan)
