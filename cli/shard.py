"""``autotp shard MODEL_PY --tp N``: shard a model file, check it against the unsharded model, train a few
steps, and write the plan and a sharded checkpoint.

Every rank builds the model with the same seed, keeps an unsharded reference (unless ``--no-verify``),
parallelizes over its TP group, compares loss and outputs on the example batch, then trains ``--steps``
AdamW steps (DDP over the DP group when dp > 1; with ``--fsdp`` FSDP2 instead, each TP shard sharded over
the DP group block by block) and saves ``plan.json``, ``summary.json`` and a sharded
checkpoint (torch.distributed.checkpoint) to ``--out``. The launching process prints the summary.

The batch is built on TP rank 0 and broadcast to its group (:mod:`autotp.cli.shard_worker`). A file without
``example_batch()`` runs on ``autotp.parallelize``'s default (2, 8) batch of token ids; an output without a
loss (no targets) has nothing to train, so training is skipped, and the summary says so.

Checkpoints are atomic (:mod:`autotp.io.ckpt_io`): ``--out/checkpoints/step-N`` folders published by renaming a
finished temporary folder and replacing the ``checkpoints/latest`` pointer, with ``--out/checkpoint`` a symlink
to the newest. They hold the model, the optimizer state and the step in the unsharded model's coordinates, so
``--resume`` (and a restart under ``--max-restarts``) continues where the last complete checkpoint left off, at
any ``--tp`` and ``--dp`` the model's sizes allow (the summary says what was resharded); ``--steps`` is the
total step count.
A checkpoint is checked before any rank starts, and loading it unpickles nothing (:mod:`autotp.io.ckpt_io`).

Before any rank starts, the launching process imports the model file, builds the model on the meta device,
captures the example batch and plans the sharding, so a broken file, a batch the model rejects or a size the
tp degree does not divide fails at once with exit code 2. The job plans once: with plain tensor parallelism
that plan is stored in a plan cache folder of the job's own, where every rank's ``parallelize`` finds it
and shards from it instead of capturing and planning again (the summary's ``plan_cached`` per rank).

``--weights PATH`` is for models that do not fit one device: every rank calls ``build_model()`` inside
``autotp.empty_weights()`` (parameters on meta, buffers computed by the model's own code), ``parallelize``
allocates only its shards, and ``autotp.load_weights`` reads only its slices of PATH (a Hugging Face
safetensors folder or file, an autotp/DCP checkpoint, a torch state-dict file). Names and shapes are checked
against the model before any rank starts. No unsharded reference is built unless ``--verify`` is given.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape

from autotp.cli.common import (EXPERT_PARALLEL, FSDP_PARAM_DTYPE, MICROBATCHES, SEQUENCE_PARALLEL, USAGE_ERROR,
                               VIRTUAL_STAGES, check_layout_options, fsdp_param_dtype, staged_flags, warm_ranks)
from autotp.cli.run import DEBUG, PP, Launcher, abort, launch_spec, say_restart, with_launcher
from autotp.capture.model_spec import model_path
from autotp.cli.run_folder import checkpoint_step, interrupted_line, traces
from autotp.errors import (AutotpError, CaptureError, LaunchInterrupted, ModelFileError, PipelineError, RankFailedError,
                           own_bug)

# torch and the capture stack are imported where they are used, so that `autotp shard --help` imports neither
if TYPE_CHECKING:
    import torch

    from autotp.capture.modelfile import ModelFile
    from autotp.cli.shard_worker import ShardReport


# -- the command ---------------------------------------------------------------------------------------
# autotp run's --dp counts one node's replicas; autotp shard's does too unless --world-size gives the world
DP = typer.Option(1, "--dp", help="Data-parallel replicas: per node (world = tp × cp × dp × pp × nnodes), or with "
                  "--world-size in all (world = tp × cp × dp × pp, world / nnodes ranks per node in Megatron's "
                  "order, tp fastest then cp, dp, pp: a pipeline's stages may sit on different nodes).")


def _eager_on_meta(mf: ModelFile, skeleton: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Run the meta-device ``skeleton`` on meta copies of the batch; a ModelFileError carrying the forward's
    own exception."""
    import traceback as tb

    import torch

    from autotp.capture.modelfile import DEFAULT_BATCH_SHAPE, to_device

    meta = to_device((args, kwargs), torch.device("meta"))
    try:
        with torch.no_grad():
            skeleton(*meta[0], **meta[1])
    except Exception as exc:  # noqa: BLE001 - the model's own message is the point
        if own_bug(exc):  # autotp's own bug: shown, never a verdict
            raise
        if "meta" in str(exc):  # the forward needs real values (export's own error says why): not this
            return
        torch_dir = os.path.dirname(torch.__file__)
        frames = [f for f in tb.extract_tb(exc.__traceback__)
                  if not f.filename.startswith(torch_dir) and "site-packages" not in f.filename]
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        if mf.batch_fn is None:
            what, hint = (f"the default batch ({DEFAULT_BATCH_SHAPE} token ids; the file defines no example_batch())",
                          "define example_batch() returning what the model's forward takes")
        else:
            what, hint = "example_batch()", ("make example_batch() match what the model accepts (e.g. sequence "
                                             "length <= its block size)")
        raise ModelFileError(f"the model's forward rejects {what}{where}: {type(exc).__name__}: {exc}",
                             hint=hint) from exc


def _check_batch(mf: ModelFile, args: tuple, kwargs: dict, microbatches: int) -> None:
    """Pipeline stages end in the loss: the batch must carry the targets and divide into the micro-batches."""
    import torch
    import torch.utils._pytree as pytree

    if mf.batch_fn is None:
        raise ModelFileError("--pp: pipeline stages end in the loss, and the file defines no example_batch() to "
                             "compute one from", hint="define example_batch() returning the inputs and the targets")
    first = next((t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if first is not None and first.shape[0] % microbatches:
        raise PipelineError(f"--microbatches {microbatches} does not divide example_batch()'s batch of "
                            f"{first.shape[0]}", hint=f"use a number of micro-batches that divides {first.shape[0]}")


def preflight(mf: ModelFile, tp: int, weights: Path | None = None, sequence_parallel: bool = False,
              expert_parallel: bool = False, stages: tuple[int, int] | None = None, cp: int = 1, *,
              plans: Path | None = None) -> float | None:
    """Build the model on the meta device, capture the example batch and plan for ``tp``, in this process, as
    every rank's ``parallelize`` would (the same job, the same capture); the FLOPs of one training step on the
    batch (three times the forward's matmuls and attention, from the captured graph's shapes), or None when
    the graph could not be captured or planned here. ``plans``: the job's own plan cache folder: where the
    ranks look the plan up (plain tensor parallelism at tp > 1), it is stored there for them.

    Raises the :class:`AutotpError` a rank would raise (the factory's or forward's own message, a size ``tp``
    does not divide, ``weights`` whose names or shapes do not fit the model), before any rank starts. Failures that are not autotp's (a model that cannot be built or
    traced on the meta device for reasons of its own) are left for the ranks to report. ``stages``: (pipeline
    stages, micro-batches): the batch must divide into the micro-batches and the blocks into the stages.
    """
    import torch

    from autotp.capture.modelfile import default_example
    from autotp.options import Options
    from autotp.parallel.planning import How, capture_and_plan, job_of
    from autotp.parallel.reuse import plan_cache_for
    from autotp.plan.context_planner import check_chunks
    from autotp.plan.stages import StageRequest

    try:
        with torch.device("meta"):
            model = mf.build()
    except ModelFileError:
        model = mf.build()  # the factory may need real tensors; if it fails here too, that is its message
    if not any(True for _ in model.parameters()):
        raise ModelFileError(f"{mf.path}: {type(model).__name__} has no parameters: there is nothing to shard or "
                             "train (the optimizer needs at least one)")
    if weights is not None:
        from autotp.io.weights import check_weights

        check_weights(model, weights)  # headers and metadata only
    # only shapes matter to capture: the default batch's zeros stand for the ids the ranks will draw
    args, kwargs = mf.example_batch() if mf.batch_fn is not None else default_example(model.forward)
    if stages is not None:
        _check_batch(mf, args, kwargs, stages[1])
    # the ranks' job (FSDP takes every plan, kv heads held by several ranks included: nothing more to check
    # for it here) and the ranks' capture: the same key, so the plan stored here is the one they look up
    job = job_of(tp, Options(sequence_parallel=sequence_parallel, expert_parallel=expert_parallel,
                             pipeline=None if stages is None else StageRequest(stages[0]), context_parallel=cp))
    try:
        planned = capture_and_plan(model, args, kwargs, job, None if plans is None else plan_cache_for(job, plans),
                                   how=How(device=torch.device("cpu"), writes=True))  # export computes nothing
    except CaptureError:
        # export reports a model's own check on symbolic sizes ("length s75"); the plain forward on meta
        # tensors reports it with the real ones
        if all(t.is_meta for t in model.parameters()):
            _eager_on_meta(mf, model, args, kwargs)
        raise
    except (AutotpError, ValueError):  # a ValueError of the plan names the sizes (experts tp does not divide)
        raise  # (with cp > 1 the context plan's refusal names each op that stops it)
    except Exception as exc:  # noqa: BLE001 - not a user error autotp can explain; the ranks will show it in full
        if own_bug(exc):  # autotp's own bug: shown, never a verdict
            raise
        return None
    context = planned.plan.context
    if context is not None and context.length:  # the batch's length: 2·cp must divide it
        check_chunks(context.length, cp)
    if planned.gm is None:  # a plan this job stored already: its graph's FLOPs are not counted again
        return None
    from autotp.analysis.flops import node_flops

    flops = 3.0 * sum(node_flops(n) for n in planned.gm.graph.nodes)  # backward: twice the forward's matmul work
    return flops or None


def _spread(report: ShardReport) -> str:
    """Why the step times look as they do, when the layout alone does not say ('' when nothing needs saying):
    ranks sharing CPU cores, FSDP's collectives on a small model, a spread between ranks."""
    medians = [statistics.median(r.step_s) for r in report.ranks if r.step_s]
    if not medians:
        return ""
    parts = []
    cores = os.cpu_count() or 1
    if report.backend == "gloo" and len(report.ranks) > cores:
        parts.append(f"{len(report.ranks)} ranks share this machine's {cores} CPU cores, so ranks take turns on a "
                     "core within every step: the times measure the machine more than the layout")
    if report.fsdp_units or report.fsdp:
        parts.append("FSDP2 adds an all-gather per unit forward and backward and a reduce-scatter per unit to each "
                     "step (see DP sharding); on gloo each is a separate small message, so a model this small "
                     "steps slower than under DDP (one bucketed all-reduce): FSDP buys memory, not speed, here")
    lo, hi = min(medians), max(medians)
    if parts and hi > 1.15 * lo:
        parts.append(f"medians range {lo * 1e3:.1f}–{hi * 1e3:.1f} ms across ranks")
    return "; ".join(parts)


def _ms(seconds: tuple[float, ...]) -> str:
    return f"{statistics.median(seconds) * 1e3:.1f} ms" if seconds else "-"


def render(report: ShardReport, console: Console) -> None:
    from autotp.cli.shard_worker import PARITY_TOL, _size
    from autotp.cli.fit import FitTable
    from autotp.cli.plan_format import data_parallel_name

    pp = f" × pp {report.pp}" if report.pp > 1 else ""
    cp = f" × cp {report.cp}" if report.cp > 1 else ""
    # FSDP shards over the dp × cp ranks together (a cp rank holds its group's parameters): named over them
    kind = data_parallel_name(report.dp * report.cp if report.fsdp else report.dp, report.fsdp)
    sharded = f"{report.dp * report.cp} ranks (dp {report.dp} × cp {report.cp})" if report.cp > 1 else \
        f"{report.dp} ranks"
    ranks = FitTable(title=f"{escape(report.model)}: tp {report.tp}{cp} × dp {report.dp}{pp}"
                     + (f" · {kind}" if kind else "") + f" ({report.backend})")
    # what each rank holds (autotp.parallel.held: its local shards); gradients as the last step read them
    cols = (("rank", "right"), ("tp", "right"), *((("cp", "right"),) if cp else ()), ("dp", "right"),
            *((("pp", "right"),) if pp else ()), ("parameters", "right"), ("of unsharded", "right"),
            ("gradients", "right"), ("optimizer state", "right"), ("step (median)", "right"),
            ("peak memory", "right"))
    for col, justify in cols:
        ranks.add_column(col, justify=justify, no_wrap=True)
    for r in report.ranks:
        share = f"{100 * r.param_bytes / report.unsharded_bytes:.0f}%" if report.unsharded_bytes else "-"
        ranks.add_row(str(r.rank), str(r.tp_rank), *((str(r.cp_rank),) if cp else ()), str(r.dp_rank),
                      *((str(r.pp_rank),) if pp else ()), _size(r.param_bytes), share,
                      _size(r.grad_bytes) if r.grad_bytes else "-", _size(r.state_bytes) if r.state_bytes else "-",
                      _ms(r.step_s), _size(r.peak_memory) if r.peak_memory else "-")
    console.print(ranks)

    summary = FitTable(show_header=False, title="summary")
    summary.add_column(style="bold")
    summary.add_column()
    if report.pp > 1:
        cuts = " | ".join(f"{b[0]} … {b[-1]}" if len(b) > 1 else b[0] for b in report.stages)
        summary.add_row("pipeline", f"{escape(report.pipeline)}; stages: {escape(cuts)}")
    for direction in ("forward", "backward"):
        items = [f"{n} × {kind}" + (f"({op})" if op else "")
                 for d, kind, op, n in report.collectives if d == direction]
        summary.add_row(f"TP collectives / step, {direction}", ", ".join(items) or "none")
    if report.fsdp_units and report.pp > 1:
        summary.add_row("DP sharding", f"FSDP2 over {sharded}: each of a rank's pipeline stages one unit; "
                        "kept gathered through the step (as torchtitan pipelines): per step one all-gather per "
                        "stage before its first micro-batch, one reduce-scatter after the last")
    elif report.fsdp_units:
        groups = f", HSDP: {report.fsdp} replica groups" if report.fsdp > 1 else ""
        summary.add_row("DP sharding", f"FSDP2 over {sharded}{groups}: {len(report.fsdp_units)} units "
                        f"({report.fsdp_units[0]} … {report.fsdp_units[-1]}) and the root; per step one all-gather "
                        "per unit forward, one per unit backward but the last, one reduce-scatter per unit")
    elif report.fsdp:
        summary.add_row("DP sharding", f"FSDP2 over {sharded}, the whole model one unit (no repeated blocks)")
    else:
        summary.add_row("DP gradient sync", f"DDP all-reduce over {report.dp} replicas" if report.dp > 1 else "none (dp 1)")
    if report.ranks and all(r.plan_cached for r in report.ranks):
        summary.add_row("plan", f"made once, by the check before the ranks started: all {len(report.ranks)} ranks "
                        "sharded by it from the job's plan cache, none planned again (a first call checks its cuts)")
    p = report.parity
    if p is None:
        why = "--weights: no whole copy of the model per rank unless --verify" if report.weights else "--no-verify"
        summary.add_row("parity vs unsharded", f"skipped ({why})")
    else:
        loss = "n/a (no loss)" if p.loss_diff is None else f"{p.loss_diff:.2e}"
        verdict = "[green]pass[/green]" if p.ok else "[red]FAIL[/red]"
        # through a pipeline only the loss is compared: no output difference is claimed
        output = "" if p.output_diff is None else f", max |Δoutput| {p.output_diff:.2e}"
        summary.add_row("parity vs unsharded", f"{verdict} max |Δloss| {loss}{output} (tol {PARITY_TOL:g})"
                        + (f"; compared: {escape(p.note)}" if p.output_diff is None and p.note else
                           f" {escape(p.note)}" if p.note else ""))
    if p is not None and p.grad_diff is not None:
        verdict = "[green]pass[/green]" if p.grads_ok else "[red]FAIL[/red]"
        summary.add_row("gradient parity", f"{verdict} max |Δgrad| {p.grad_diff:.2e} ({escape(p.grad_param)}), "
                        f"after one AdamW step max |Δparam| {p.step_diff:.2e} ({escape(p.step_param)})")
    if report.restarted:
        summary.add_row("restarted", escape(report.restarted))
    if report.resumed_from is not None:
        summary.add_row("resumed", f"from step {report.start_step} ({escape(report.resumed_from)})")
        if report.resharded:
            summary.add_row("layout", escape(report.resharded))
    if report.weights:
        summary.add_row("weights", escape(report.weights))
    if report.batch:
        summary.add_row("batch", escape(report.batch))
    if report.training_skipped:
        summary.add_row("training", f"[yellow]skipped[/yellow]: {escape(report.training_skipped)}; the checkpoint "
                        f"holds the weights at step {report.start_step}")
    if report.losses:
        summary.add_row("loss (dp replica 0)", " → ".join(f"{x:.4f}" for x in report.losses))
    if report.losses and report.tokens_per_step and report.ranks[0].step_s:
        rate = report.tokens_per_step / statistics.median(report.ranks[0].step_s)
        world = len(report.ranks)
        if report.step_flops is None:
            mfu = "MFU: FLOPs not counted (the graph could not be captured before the ranks started)"
        elif report.mfu is None:
            mfu = f"{report.step_flops:.3g} FLOPs per replica step; MFU: no device peak (give --gpu, or run " \
                  "`autotp profile`)"
        else:
            pct = 100 * report.mfu  # a small model on CPU ranks against a GPU's peak: far below 0.01%
            mfu = f"{report.step_flops:.3g} FLOPs per replica step; MFU " + \
                (f"{pct:.2f}%" if pct >= 0.01 else f"{pct:.1e}%")
        summary.add_row("throughput (median step)", f"{rate:,.0f} tokens/s, {rate / world:,.0f} per rank "
                        f"({report.tokens_per_step:,} tokens per step); {mfu}")
        if note := _spread(report):
            summary.add_row("step time", note)
    console.print(summary)
    # below the table, each on a line of its own however wide: a path is copied whole, not read folded
    console.print(f"[bold]plan:[/bold] {escape(report.plan_path)}", soft_wrap=True)
    console.print(f"[bold]checkpoint:[/bold] {escape(report.checkpoint_path) or 'none (--steps 0: nothing trained, nothing saved)'}",
                  soft_wrap=True)
    if report.metrics_path:
        console.print(f"[bold]metrics:[/bold] {escape(report.metrics_path)}"
                      + (f" (TensorBoard: {escape(report.tensorboard)})" if report.tensorboard else ""), soft_wrap=True)
    if report.comm:
        positions = f", each rank's 1/{report.cp} of the sequence (cp {report.cp})" if report.cp > 1 else ""
        comm = FitTable(title=f"TP communication per training step, per rank{positions}, vs Megatron's formula "
                        "(README: 'What a step costs')", keys=2, breaks=(5,))
        for col in ("pass", "collective", "count", "formula", "ratio", "elements", "formula", "ratio", "bytes"):
            number = col not in ("pass", "collective")
            comm.add_column(col, justify="right" if number else "left", no_wrap=number)

        def ratio(a, b):
            return "-" if a is None or not b else f"{a / b:.2f}"

        for d, kind, op, n, fn, el, fel, nbytes in report.comm:
            name = "all" if kind == "all" else kind.replace("_", "-") + (f"({op})" if op else "")
            comm.add_row({"forward": "fwd", "backward": "bwd"}.get(d, d), name, str(n), str(fn), ratio(n, fn),
                         "-" if el is None else f"{el:,}", "-" if fel is None else f"{fel:,}", ratio(el, fel),
                         "-" if nbytes is None else _size(nbytes))
        console.print(comm)


@with_launcher
def shard(
    ctx: typer.Context,
    model: str = typer.Argument(..., metavar="MODEL_PY", help="Model file defining build_model() and "
                                "optionally example_batch(); path.py:NAME names another factory."),
    tp: int | None = typer.Option(None, "--tp", help="Tensor-parallel size: ranks that share one model replica "
                                  "(required unless --auto)."),
    dp: int = DP,
    pp: int = PP,
    auto: bool = typer.Option(False, "--auto", help="Choose tp, dp, pp, FSDP and micro-batches for --world-size "
                              "ranks by predicted throughput (as `autotp plan --auto` shows), then run that."),
    world_size: int | None = typer.Option(None, "--world-size", "-w", help="Ranks in all: with --auto, those to "
                                          "lay out; with --tp, --dp then counts every node's replicas (world = "
                                          "tp × cp × dp × pp, world / nnodes ranks per node), as `autotp plan` "
                                          "and `autotp plan --auto`'s commands read it."),
    gpu: str | None = typer.Option(None, "--gpu", help="a100, h100 or a profile written by `autotp profile` "
                                   "(default ./autotp-profile.json): the device --auto plans for, and whose "
                                   "peak FLOP/s the training log's MFU is measured against."),
    schedule: str | None = typer.Option(None, "--schedule", help="With --pp: the pipeline schedule (GPipe, 1F1B, "
                                        "Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble; "
                                        "default 1F1B)."),
    microbatches: int | None = MICROBATCHES,
    virtual_stages: int | None = VIRTUAL_STAGES,
    steps: int = typer.Option(3, "--steps", help="AdamW training steps after the parity check."),
    lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate."),
    clip_grad: float = typer.Option(0.0, "--clip-grad", help="Clip the gradients' full-model norm to this "
                                    "(0: no clipping; the norm is logged either way)."),
    log_every: int = typer.Option(1, "--log-every", help="Log training metrics (loss, tokens/s, MFU, memory, "
                                  "grad norm) every N steps, and the last, to the console and OUT/metrics.jsonl."),
    out: Path = typer.Option(Path("autotp-out"), "--out", help="Folder for plan.json, summary.json, checkpoints."),
    verify: bool | None = typer.Option(None, "--verify/--no-verify", help="Compare with the unsharded model "
                                       "first (default: yes, except with --weights)."),
    weights: Path | None = typer.Option(None, "--weights", metavar="PATH", help="Build the model on the meta "
                                        "device and load each rank's slices from PATH: a Hugging Face "
                                        "safetensors folder or file, an autotp/DCP checkpoint, a torch file."),
    compile_: bool = typer.Option(False, "--compile", help="torch.compile the rewritten graphs."),
    compile_backend: str | None = typer.Option(None, "--compile-backend", metavar="NAME", help="torch.compile's "
                                               "backend for --compile (default inductor; aot_eager runs "
                                               "AOTAutograd's graphs without generating code); implies --compile."),
    sequence_parallel: bool = SEQUENCE_PARALLEL,
    expert_parallel: bool = EXPERT_PARALLEL,
    fsdp_dtype: str | None = FSDP_PARAM_DTYPE,
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest complete checkpoint in --out "
                                "(model, optimizer, step) up to --steps in total."),
    resume_from: str | None = typer.Option(None, "--resume-from", metavar="NAME", help="Resume this checkpoint "
                                           "(a step folder under --out/checkpoints, or a path) instead of the "
                                           "one `latest` names; implies --resume."),
    save_every: int = typer.Option(0, "--save-every", help="Also checkpoint every N steps (0: by time only)."),
    save_minutes: float = typer.Option(30.0, "--save-minutes", metavar="M", help="Also checkpoint once M "
                                       "minutes have passed since the last checkpoint (0: never by time). A "
                                       "run also saves at the end and when interrupted (Ctrl-C, SIGTERM)."),
    keep: int | None = typer.Option(None, "--keep", min=1, help="Keep this run's newest N checkpoints, removing "
                                    "its older ones (default: keep every checkpoint; never another run's)."),
    debug: bool = DEBUG,
    launcher: Launcher = Launcher(),
) -> None:
    """Shard MODEL_PY over tp × cp × dp × pp ranks, verify, train a few steps, save plan and checkpoint."""
    started = time.time()
    fsdp, nnodes, node_rank, timeout = launcher.fsdp, launcher.nnodes, launcher.node_rank, launcher.timeout
    from autotp.cli.progress import Phases

    phases = Phases(started, quiet=node_rank != 0)
    if tp is not None or auto:  # said before torch is imported (a second or more): the command is alive at once
        phases.say("check", f"{model}: importing it, capturing it on the meta device and planning it"
                   + (f" at tp {tp}" if tp else "") + ", before any rank starts")
    # what needs no torch first (options, paths, the output folder): a mistake is said in a moment, not after
    # the imports and the capture
    if auto:
        _check_auto(tp, dp, pp, fsdp, microbatches, virtual_stages, world_size, nnodes, debug, launcher.cp, schedule)
    elif tp is None:
        abort("give --tp N, or --auto --world-size N to choose the layout", debug, code=USAGE_ERROR)
    elif world_size is not None and world_size < 1:
        abort(f"--world-size must be >= 1, got {world_size}", debug, code=USAGE_ERROR)
    compile_ = compile_ or compile_backend is not None  # a backend named asks for compilation
    for bad, flag, value, rule in ((steps < 0, "--steps", steps, ">= 0"), (not lr > 0, "--lr", lr, "> 0"),
                                   (log_every < 1, "--log-every", log_every, ">= 1"),
                                   (clip_grad < 0, "--clip-grad", clip_grad, ">= 0"),
                                   (save_every < 0, "--save-every", save_every, ">= 0"),
                                   (not save_minutes >= 0, "--save-minutes", save_minutes, ">= 0")):
        if bad:
            abort(f"{flag} must be {rule}, got {value}", debug, code=USAGE_ERROR)
    try:
        param_dtype = fsdp_param_dtype(fsdp_dtype)
    except ValueError as exc:
        abort(str(exc), debug, code=USAGE_ERROR)
    if not auto:  # --auto chooses pp, FSDP and cp: their rules are checked once it has
        # the rule autotp plan, the launcher and the library ask; dp: the whole job's data-parallel size
        check_layout_options(pp=pp, fsdp=fsdp, sequence_parallel=sequence_parallel, expert_parallel=expert_parallel,
                             compile_=compile_, schedule=schedule, cp=launcher.cp,
                             dp=dp if world_size is not None else dp * nnodes, hsdp=launcher.hsdp,
                             staged=staged_flags(schedule=schedule, virtual_stages=virtual_stages,
                                                 microbatches=microbatches),
                             fsdp_dtype=fsdp_dtype, verify=verify is True)
    resume = resume or resume_from is not None
    try:
        path, factory = model_path(model)
    except ModelFileError as exc:
        abort(str(exc), debug, code=USAGE_ERROR)
    if weights is not None and not weights.exists():
        abort(f"--weights {weights} does not exist", debug, code=USAGE_ERROR)
    if out.exists() and not out.is_dir():
        abort(f"--out {out} exists and is not a folder", debug, code=USAGE_ERROR)
    if not resume and (earlier := _earlier_run(out)):
        abort(f"--out {out} already holds a run's files ({earlier}): continue that run with --resume, or "
              "write this one elsewhere with --out; nothing there was changed", debug, code=USAGE_ERROR)
    warm_ranks(ctx)
    from autotp.capture.modelfile import load_model_file
    from autotp.cli.shard_worker import PARITY_TOL, ShardJob, shard_worker  # the ranks' code: only when sharding
    from autotp.distributed.launch import launch
    from autotp.io.ckpt_io import check_resumable

    if auto:
        tp, dp, pp, fsdp, microbatches, virtual_stages, schedule, cp = _choose(model, world_size, nnodes, gpu, debug)
        launcher = launcher._replace(cp=cp)
        check_layout_options(pp=pp, fsdp=fsdp, sequence_parallel=sequence_parallel, expert_parallel=expert_parallel,
                             compile_=compile_, schedule=schedule, cp=launcher.cp, dp=dp, hsdp=launcher.hsdp,
                             fsdp_dtype=fsdp_dtype, verify=verify is True)
    # --auto may have chosen FSDP; with --world-size (--auto's too) --dp counts every node's replicas
    spec = launch_spec(tp, dp, pp, launcher._replace(fsdp=fsdp), debug, world=world_size)
    stages = None
    if pp > 1:
        from autotp.options import PipelineOptions  # the rules autotp.pipeline validates with (no torch)

        try:
            asked = PipelineOptions(pp, schedule or "1F1B", microbatches, virtual_stages).validate()
        except AutotpError as exc:
            abort(str(exc), debug, code=USAGE_ERROR)
        schedule, stages = asked.schedule, (asked.count, asked.microbatches)
        spec = dataclasses.replace(spec, virtual_stages=virtual_stages)  # valid now: what the ranks are told
    # the checkpoint next: one that cannot be resumed is said in a moment, not after the capture
    try:
        resumable = check_resumable(out, resume_from) if resume else None
    except AutotpError as exc:
        abort(str(exc), debug, code=USAGE_ERROR)
    # the job's own plan cache: the check stores its plan there and the ranks shard from it (FSDP cuts its
    # units from the graph when it parallelizes: its ranks plan themselves); removed when the command ends
    plans = None if fsdp else Path(tempfile.mkdtemp(prefix="autotp-job-plans-"))
    if plans is not None:
        ctx.call_on_close(lambda: shutil.rmtree(plans, ignore_errors=True))
    try:
        # before any rank starts
        flops = preflight(load_model_file(model), tp, weights, sequence_parallel, expert_parallel, stages,
                          launcher.cp, plans=plans)
        peak = _peak_flops(gpu)
        _check_backend(compile_backend)
    except (AutotpError, ValueError) as exc:
        abort(str(exc), debug, code=USAGE_ERROR)
    if node_rank == 0 and (why := _unwritable(out)):  # makes the folder: only for a model that will run
        abort(f"--out {out} cannot be written: {why}", debug, code=USAGE_ERROR)
    if resume and node_rank == 0 and resumable is None:
        left = traces(out)
        why = (f"{escape(str(out))} holds a run's {', '.join(left)} but no checkpoint (it ended before its "
               "first)" if left else f"no checkpoint in {escape(str(out))} yet")
        Console(stderr=True).print(f"[yellow]note:[/yellow] --resume: {why}; starting from step 0", soft_wrap=True)
    if resumable is not None and isinstance(at := checkpoint_step(resumable), int) and at >= steps:
        Console().print(f"already at step {at} of {steps} ({escape(str(resumable))}): give --steps N to train "
                        "further", soft_wrap=True)
        return
    Console().print(f"output: {escape(str(out.resolve()))}" + (f" (resuming {escape(resumable.name)})"
                                                               if resumable else ""), soft_wrap=True)
    job = ShardJob(model=f"{path.resolve()}:{factory}" if factory else str(path.resolve()),
                   steps=steps, lr=lr, out=str(out.resolve()), verify=weights is None and param_dtype is None if verify is None else verify,
                   resume=resume, resume_from=resume_from, keep=keep, run=uuid.uuid4().hex,
                   save_every=save_every, save_minutes=save_minutes, compile={"backend": compile_backend} if compile_backend else compile_,
                   sequence_parallel=sequence_parallel,
                   expert_parallel=expert_parallel, fsdp_param_dtype=param_dtype,
                   schedule=schedule or "1F1B", microbatches=microbatches or pp,
                   weights=None if weights is None else str(weights.resolve()), started=started,
                   log_every=log_every, clip_grad=clip_grad, flops=flops, peak_flops=peak,
                   plans=None if plans is None else str(plans))
    node = f" on node {node_rank} of {nnodes}" if nnodes > 1 else ""
    phases.say("launch", f"starting {spec.nproc_per_node} ranks{node}: tp {spec.tp}"
               + (f" × cp {spec.cp}" if spec.cp > 1 else "") + f" × dp {spec.data_parallel}"
               + (f" × pp {spec.pp}" if spec.pp > 1 else "") + (" (FSDP)" if spec.fsdp else ""))
    try:
        # the sizes as one value, the function's argument: the ranks read no environment for them
        results = launch(spec, shard_worker, spec.job(), job, quiet=not debug, on_restart=say_restart)
    except LaunchInterrupted as exc:
        Console(stderr=True).print(f"[yellow]{escape(interrupted_line(exc, out, job.run))}[/yellow]",
                                   soft_wrap=True)
        raise typer.Exit(code=exc.code) from None
    except RankFailedError as exc:
        why = ""
        if timeout is not None and "timed out" in exc.message.lower():
            why = f" (no peer answered within --timeout {timeout:g} s: another rank is hung or dead)"
        abort(f"{exc.said()}{why}", debug, trace=exc.traceback)
    except AutotpError as exc:
        abort(str(exc), debug)
    report = results.get(0)
    console = Console()
    if report is None:
        console.print(f"node {node_rank}: {spec.nproc_per_node} ranks finished; the node running rank 0 "
                      "prints the summary")
        return
    render(report, console)
    console.print(f"output: {escape(str(out.resolve()))}", soft_wrap=True)
    if report.parity is not None and not report.parity.grads_ok:
        p = report.parity
        abort(f"sharded model's gradients differ from the unsharded one's: max |Δgrad| {p.grad_diff} in "
              f"{p.grad_param}, max |Δparam| after one AdamW step {p.step_diff} in {p.step_param} "
              f"(tol {PARITY_TOL:g})", debug, trace="")
    if report.parity is not None and not report.parity.ok:
        p = report.parity
        output = "" if p.output_diff is None else f", max |Δoutput| {p.output_diff}"
        abort(f"sharded model differs from the unsharded one: max |Δloss| {p.loss_diff}{output} exceed "
              f"{PARITY_TOL:g}", debug, trace="")


def _check_backend(name: str | None) -> None:
    """A --compile-backend torch.compile knows (its own registry), said before any rank starts."""
    if name is None:
        return
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise ValueError(f"--compile-backend {name!r} is not a torch.compile backend; known: {', '.join(known)}")


def _peak_flops(gpu: str | None) -> float | None:
    """One device's peak FLOP/s for MFU: ``--gpu`` (a preset or a profile), else ./autotp-profile.json when
    ``autotp profile`` wrote one; None otherwise (MFU is then left out, not guessed)."""
    from autotp.cli.plan_auto import DEFAULT_PROFILE, hardware

    return hardware(gpu).peak_flops if gpu is not None or DEFAULT_PROFILE.exists() else None


def _unwritable(out: Path) -> str:
    """Why the run folder cannot hold the run's files ('' when it can): made if missing, probed with a file."""
    from autotp.io.ckpt_safety import cause

    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".autotp-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return cause(exc)
    return ""


def _earlier_run(out: Path) -> str:
    """What a new run (no --resume) in ``out`` would sit beside: the step folders and pointer of an earlier
    run, or without them its plan and metrics ('' when there are none)."""
    root = out / "checkpoints"
    found = sorted(p.name for p in root.iterdir() if p.name.startswith("step-") or p.name == "latest") \
        if root.is_dir() else []
    return ", ".join(found or traces(out))  # a run interrupted before its first checkpoint left these


def _check_auto(tp: int | None, dp: int, pp: int, fsdp: bool, microbatches: int | None, virtual_stages: int | None,
                world_size: int | None, nnodes: int, debug: bool, cp: int, schedule: str | None = None) -> None:
    """--auto's flags, before torch is imported: it chooses the layout, so none of its sizes may be given, and it
    needs the ranks to lay out, a multiple of the nodes."""
    given = [f for f, v in (("--tp", tp), ("--dp", None if dp == 1 else dp), ("--pp", None if pp == 1 else pp),
                            ("--fsdp", fsdp or None), ("--microbatches", microbatches),
                            ("--virtual-stages", virtual_stages), ("--cp", None if cp == 1 else cp),
                            ("--schedule", schedule))
             if v is not None]
    if given:
        abort(f"--auto chooses the layout: drop {', '.join(given)}", debug, code=USAGE_ERROR)
    if world_size is None or world_size < 1 or world_size % nnodes:
        abort(f"--auto needs --world-size N, a multiple of --nnodes {nnodes} (got {world_size})", debug,
              code=USAGE_ERROR)


def _choose(model: str, world_size: int, nnodes: int, gpu: str | None,
            debug: bool) -> tuple[int, int, int, bool, int | None, int | None, str, int]:
    """--auto: the fastest layout ``autotp shard`` runs, for ``world_size`` ranks on ``nnodes`` nodes, each data-
    parallel replica training on the example batch; printed before any rank starts (its flags checked by
    :func:`_check_auto`). Its dp is the whole data-parallel size (``--world-size`` given), so a pipeline's
    stages may sit on different nodes."""
    from autotp.cli import plan_auto  # the cost model: only when asked for

    try:
        hw = plan_auto.hardware(gpu)
        found = plan_auto.run_search(model, world_size, world_size // nnodes, hw, None, None, None, None,
                                     runnable=True, per_replica=True)
    except (AutotpError, ValueError) as exc:
        abort(str(exc), debug, code=USAGE_ERROR)
    best = found.result.best
    if best is None:
        why = "; ".join(plan_auto.explain(found.result)) or "no layout the sizes allow"
        abort(f"--auto found no layout autotp shard runs on {world_size} ranks: {why}", debug, code=USAGE_ERROR)
    lay = best.candidate
    Console(stderr=True).print(f"[bold]--auto:[/bold] {lay.label()} on {escape(hw.name)}: predicted "
                               f"{best.step * 1e3:.1f} ms per step, {best.tokens_per_device:,.0f} tokens/s per "
                               f"rank (`autotp plan --auto` shows the others)", soft_wrap=True)
    schedule = lay.schedule or "1F1B"
    return (lay.tp, lay.dp, lay.pp, lay.fsdp, lay.microbatches if lay.pp > 1 else None,
            lay.v if lay.pp > 1 else None, schedule, lay.cp)


def register(app: typer.Typer) -> None:
    app.command("shard", short_help="Shard a model file, check it, train it and checkpoint it.")(shard)
