"""One rank of ``autotp shard``: build the model, parallelize it, check it against the unsharded model, train,
save, and (rank 0) report.

The CLI owns this training loop, so it owns its data: each TP group's rank 0 builds the batch
(``example_batch()``, or :func:`~autotp.capture.modelfile.default_example` when the file has none) and
broadcasts it to its group, as Megatron's ``get_batch_on_this_tp_rank`` does; each DP replica's TP rank 0
builds its own. An ``example_batch()`` that draws without a seed therefore runs as it would on one device.

:func:`shard_worker` is what the launcher runs on every rank; the report (:class:`ShardReport`, plain data) comes
back to the launching process, which renders it (:mod:`autotp.cli.shard`).
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import autotp
from autotp.distributed.data_parallel import FSDPConfig
from autotp.io.checkpoint import tp_local_shape
from autotp.io.ckpt_io import (checkpoint_info, latest_checkpoint, load_training_state, resume_target,
                              save_training_state)
from autotp.parallel.held import held_grads, held_params, held_state
from autotp.parallel.parallelize import parallelize_state
from autotp.parallel.writeback import state_difference
from autotp.reports.sharding import build_report
from autotp.distributed.job import RankJob
from autotp.distributed.launch import RankContext, init_job
from autotp.distributed.rank_grid import RankGrid
from autotp.distributed.restarts import last_failure, note_progress
from autotp.cli.grad_parity import compare_grads
from autotp.cli.progress import Phases
from autotp.cli.run_folder import truncate_metrics
from autotp.cli.stopping import Stops
from autotp.cli.train_log import METRICS_FILE, StepMetrics, TrainLog, mfu, peak_memory, size as _size
from autotp.capture.modelfile import (DEFAULT_BATCH_SHAPE, ModelFile, ModelFileError, default_example,
                                     find_loss, load_model_file, output_tensors, replica_batch, to_device)

PARITY_TOL = 1e-5


@dataclass(frozen=True)
class ShardJob:
    model: str  # absolute path, optionally ":factory"
    steps: int
    lr: float
    out: str
    verify: bool
    resume: bool = False
    save_every: int = 0
    save_minutes: float = 0.0  # also checkpoint once this many minutes have passed since the last save (0: never)
    resume_from: str | None = None  # a checkpoint folder to resume instead of the one `latest` names
    keep: int | None = None  # this run's newest checkpoints kept (None: all)
    run: str | None = None  # this run's id, in each manifest (whose checkpoints --keep thins)
    compile: bool | dict = False  # True, or torch.compile's options ({"backend": "aot_eager"})
    weights: str | None = None  # load from this checkpoint into a model built on meta
    sequence_parallel: bool = False
    expert_parallel: bool = False
    fsdp_param_dtype: str | None = None  # FSDP's mixed precision: gathered in this torch dtype, reduced in fp32
    schedule: str = "1F1B"  # with pp > 1: the pipeline schedule
    microbatches: int = 0  # with pp > 1: micro-batches per step (0: pp)
    started: float = 0.0  # time.time() when the command started: phase lines count from it
    log_every: int = 1  # training metrics every N steps (and the last)
    clip_grad: float = 0.0  # clip the gradients' full norm to this (0: no clipping)
    flops: float | None = None  # a data-parallel replica's FLOPs per training step (3 × the forward's)
    peak_flops: float | None = None  # one device's peak FLOP/s, for MFU (None: not known, MFU left out)
    plans: str | None = None  # the job's own plan cache folder, where the check stored its plan for the ranks


@dataclass(frozen=True)
class Parity:
    loss_diff: float | None  # None when the model returns no loss on the example batch
    # the outputs and the model state the forward wrote (None: not compared, through a pipeline: the loss only)
    output_diff: float | None
    note: str = ""
    grad_diff: float | None = None  # the largest gradient difference (None: not compared, cli/grad_parity.py)
    grad_param: str = ""  # the parameter it is in
    step_diff: float | None = None  # the largest parameter difference after one AdamW step
    step_param: str = ""

    @property
    def grads_ok(self) -> bool:
        return (self.grad_diff is None or self.grad_diff <= PARITY_TOL) and \
            (self.step_diff is None or self.step_diff <= PARITY_TOL)

    @property
    def ok(self) -> bool:
        return self.grads_ok and (self.output_diff is None or self.output_diff <= PARITY_TOL) and \
            (self.loss_diff is None or self.loss_diff <= PARITY_TOL)


@dataclass(frozen=True)
class RankStats:
    rank: int
    tp_rank: int
    dp_rank: int
    param_bytes: int  # this rank's parameters (autotp.parallel.held: local shards, FSDP's included)
    step_s: tuple[float, ...]
    pp_rank: int = 0
    peak_memory: int = 0  # bytes, after training (CUDA: max allocated; CPU: peak resident set)
    cp_rank: int = 0
    grad_bytes: int = 0  # this rank's gradients as the optimizer's last step read them (0: no step)
    state_bytes: int = 0  # this rank's optimizer state after training (the moments; 0: no step)
    plan_cached: str = ""  # the job's cached plan this rank sharded from ("": it planned itself)


@dataclass(frozen=True)
class ShardReport:
    model: str
    tp: int
    dp: int
    backend: str
    unsharded_bytes: int
    ranks: tuple[RankStats, ...]
    collectives: tuple[tuple[str, str, str, int], ...]  # (direction, kind, op, count) per step
    parity: Parity | None
    losses: tuple[float, ...]  # dp replica 0, one per step
    final_loss: float | None  # eval loss on the example batch after training
    plan_path: str
    checkpoint_path: str
    start_step: int = 0  # the step training resumed from (0: from scratch); ``losses`` are steps start_step+1...
    resumed_from: str | None = None
    resharded: str = ""  # what resuming did with the saved layout ("resumed from tp 2 → tp 4: ...")
    restarted: str = ""  # after an elastic restart: which rank failed, how, where, and what was redone
    weights: str = ""  # where the weights came from and what loading them cost (--weights)
    # TP communication of one step against Megatron's formula (README, "What a step costs"):
    # (direction, kind, op, count, formula count, elements, formula elements, bytes) per kind, then the total
    comm: tuple[tuple, ...] = ()
    batch: str = ""  # where the batch came from: the file's example_batch() or the default one
    training_skipped: str = ""  # why no step was trained ("": trained, or nothing left to train)
    fsdp: int = 0  # FSDP replica groups (0: no FSDP)
    fsdp_units: tuple[str, ...] = ()  # the blocks FSDP gathers one at a time
    pp: int = 1
    # with pp > 1: the schedule, micro-batches, stages per rank, and each stage's blocks
    pipeline: str = ""
    stages: tuple[tuple[str, ...], ...] = ()
    tokens_per_step: int = 0  # over every data-parallel replica
    metrics_path: str = ""  # the training log's JSON lines ("" when nothing was trained)
    tensorboard: str = ""  # its TensorBoard folder ("" without the tensorboard package)
    mfu: float | None = None  # the median step's, when the device's peak is known
    cp: int = 1  # context-parallel ranks sharing each sequence
    step_flops: float | None = None  # a data-parallel replica's FLOPs per training step (None: not counted)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["parity"] = None if self.parity is None else {**asdict(self.parity), "ok": self.parity.ok}
        return d


def _param_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds (an FSDP-sharded parameter: its local piece)."""
    return held_params(module).bytes


def _grads_at_step(opt: torch.optim.Optimizer) -> list[int]:
    """A one-item list holding the bytes of gradients this rank holds each time ``opt`` steps (after backward
    and clipping, before zero_grad), kept up to date by a step pre-hook."""
    seen = [0]

    def measure(optimizer, args, kwargs) -> None:
        seen[0] = held_grads(p for g in optimizer.param_groups for p in g["params"]).bytes

    opt.register_step_pre_hook(measure)
    return seen


def _verify(tpm, reference, args: tuple, kwargs: dict, device: torch.device) -> Parity:
    tpm.eval()
    reference.eval()
    with torch.no_grad():
        got, want = tpm(*args, **kwargs), reference(*args, **kwargs)
    tpm.train()
    loss_got, loss_want = find_loss(got), find_loss(want)
    loss_diff = None if loss_got is None or loss_want is None else (loss_got - loss_want).abs().item()
    outs_got, outs_want = output_tensors(got), output_tensors(want)
    shapes_got = [(p, tuple(t.shape)) for p, t in outs_got]
    shapes_want = [(p, tuple(t.shape)) for p, t in outs_want]
    note, out_diff = "", 0.0
    if shapes_got != shapes_want:
        note, out_diff = f"outputs differ in structure: sharded {shapes_got} vs unsharded {shapes_want}", math.inf
    else:
        for (_, g), (_, w) in zip(outs_got, outs_want):
            if g.numel():
                out_diff = max(out_diff, (g.double() - w.double()).abs().max().item())
    # what the forward wrote on the model (``self.last_loss``, a cache) is what a script reads too
    state_diff, state_at = state_difference(tpm, reference, autotp.tp_state(tpm).written)
    if state_diff > PARITY_TOL and not note:
        note = f"the model state the forward writes differs at {state_at}"
    out_diff = max(out_diff, state_diff)
    # the worst rank decides
    worst = torch.tensor([loss_diff or 0.0, out_diff], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    grads = compare_grads(tpm, reference, args, kwargs)  # a wrong backward, named by its parameter
    return Parity(None if loss_diff is None else worst[0].item(), worst[1].item(), note,
                  *((grads.grad_diff, grads.grad_param, grads.step_diff, grads.step_param) if grads else ()))


def _eval_loss(tpm, args: tuple, kwargs: dict) -> float | None:
    tpm.eval()
    with torch.no_grad():
        loss = find_loss(tpm(*args, **kwargs))
    tpm.train()
    return None if loss is None else loss.item()


def data_parallel(tpm: autotp.TPModule, ctx: RankContext) -> torch.nn.Module:
    """``tpm`` under DDP over this rank's DP group when dp > 1 (each TP shard's gradients are averaged
    across the replicas holding the same shard), else (or when FSDP shards it already) ``tpm`` itself."""
    if ctx.grid.dp == 1 or autotp.tp_state(tpm).options.fsdp is not None:
        return tpm
    return torch.nn.parallel.DistributedDataParallel(
        tpm, process_group=ctx.dp_group(), device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)


class Stepped(NamedTuple):
    loss: torch.Tensor
    grad_norm: torch.Tensor | None  # the full model's gradient norm before clipping (None: not asked for)


def grad_norm(params: list[torch.nn.Parameter], clip: float) -> torch.Tensor:
    """The full model's gradient norm (sharded gradients count their whole parameter: autotp.parallel.grads,
    or DTensor under FSDP); gradients clipped to ``clip`` when it is > 0."""
    if clip > 0:
        return torch.nn.utils.clip_grad_norm_(params, clip)
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, args: tuple, kwargs: dict,
               clip: float = 0.0, norm: bool = False) -> Stepped:
    """One optimizer step of ``model`` (a :func:`data_parallel` module) on this replica's batch: the loss, and
    the gradient norm when asked for (``norm``) or needed (``clip`` > 0)."""
    loss = find_loss(model(*args, **kwargs))
    if loss is None:
        raise ModelFileError("the model's output on the example batch carries no loss (looked for "
                             "out.loss, out['loss'], and a 0-dim tensor last in a tuple)",
                             hint="make example_batch() include the targets the forward needs")
    loss.backward()
    total = grad_norm([p for g in opt.param_groups for p in g["params"]], clip) if norm or clip > 0 else None
    opt.step()
    opt.zero_grad(set_to_none=True)
    return Stepped(loss.detach(), total)


def batch_tokens(args: tuple, kwargs: dict) -> int:
    """Tokens in one replica's batch: the first integer tensor of two or more dims (b × s ids), else the
    first tensor's leading two dims, else its batch."""
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0]
    ids = next((t for t in leaves if t.dim() >= 2 and not t.is_floating_point()), None)
    if ids is not None:
        return ids.shape[0] * ids.shape[1]
    first = next(iter(leaves), None)
    if first is None:
        return 0
    return first.shape[0] * (first.shape[1] if first.dim() >= 2 else 1)


def _train(step_fn, args: tuple, kwargs: dict, job: ShardJob, ctx: RankContext, start: int = 0,
           save=None, log: TrainLog | None = None) -> tuple[list, list]:
    """Steps ``start`` ... ``job.steps - 1`` of ``step_fn(args, kwargs, norm) -> Stepped`` (one optimizer step
    on this replica's batch, with the gradient norm when ``norm``); every ``job.log_every`` steps (and the last)
    rank 0 logs their metrics (:mod:`autotp.cli.train_log`); ``save(step)`` after every ``job.save_every``-th
    (not the last) and when ``job.save_minutes`` have passed since the last save; a stop signal (any rank's)
    saves the step finished and exits with 128 + its number (:mod:`autotp.cli.stopping`)."""
    losses, times = [], []
    stops = Stops(job.save_minutes).install()
    stops.training = True
    show = ctx.rank == 0 and job.steps > start
    console = Console()
    # a bar in a terminal; piped, one whole line per logged step: a rank stopped mid-step (a peer failed) leaves
    # no half-drawn bar for the launcher's error line to run into
    live = show and console.is_terminal
    progress = Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]} {task.fields[rate]}"), TimeElapsedColumn(),
                        console=console) if live else contextlib.nullcontext()
    tokens = batch_tokens(args, kwargs) * ctx.grid.dp
    world = ctx.grid.world_size
    per_rank_flops = rank_flops(job.flops, ctx.grid)
    with progress:
        task = progress.add_task("train", total=job.steps, completed=start, loss="-", rate="") if live else None
        for step in range(start, job.steps):
            done = step + 1
            logged = done % max(job.log_every, 1) == 0 or done == job.steps
            a, k = replica_batch(args, kwargs, ctx.coords["dp"], step)
            note_progress(done, f"at step {done}")  # said if this rank dies now
            begin = time.perf_counter()
            stepped = step_fn(a, k, logged)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            took = time.perf_counter() - begin
            times.append(took)
            losses.append(stepped.loss.item())
            if logged and show:
                m = StepMetrics(step=done, loss=losses[-1], step_s=took, tokens=tokens, tokens_per_s=tokens / took,
                                tokens_per_s_per_rank=tokens / took / world,
                                grad_norm=None if stepped.grad_norm is None else float(stepped.grad_norm),
                                peak_memory=peak_memory(ctx.device.type), mfu=mfu(per_rank_flops, took, job.peak_flops),
                                lr=job.lr, elapsed_s=time.time() - job.started if job.started else took)
                if log is not None:
                    log.record(m)
                if task is None:
                    console.print(f"training {m.line()}", highlight=False, soft_wrap=True)
            if task is not None:
                progress.update(task, advance=1, loss=f"{losses[-1]:.4f}", rate=f"{tokens / took:,.0f} tok/s")
            signum, due = stops.check(ctx.device)
            if save is not None and signum:  # the step finished is kept; the launcher says so, in one line
                note_progress(done, f"while saving step {done}")
                save(done)
            elif save is not None and done != job.steps and (due or job.save_every and done % job.save_every == 0):
                saving(save, done, job.started)
                stops.saved()
            if signum:
                if log is not None:
                    log.close()
                raise SystemExit(128 + signum)
    return losses, times


def saving(save, step: int, started: float = 0.0) -> Path:
    """``save(step)``, noted as this rank's progress (a rank dying in a save is said as such); rank 0 says
    that it saves, where, and how long it took (a save can take seconds: no silent wait)."""
    note_progress(step, f"while saving step {step}")
    say = dist.is_initialized() and dist.get_rank() == 0
    phases = Phases(started or None, quiet=not say)
    phases.say("save", f"checkpoint of step {step} …")
    begin = time.perf_counter()
    path = save(step)
    phases.say("save", f"wrote {path} in {time.perf_counter() - begin:.1f} s")
    return path


def _load(model: torch.nn.Module, path: str) -> str:
    """``autotp.load_weights`` into ``model``; what it cost, for the summary (the most any rank read)."""
    loaded = autotp.load_weights(model, path)
    most = torch.tensor([loaded.bytes_read, loaded.seconds], dtype=torch.float64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return f"{path} ({loaded.kind}): {_size(int(most[0]))} read per rank (most), {most[1]:.1f} s"


def _final_checkpoint(job: ShardJob, resumed_from: str | None, start: int, done: int, save) -> Path | None:
    """The run's last checkpoint: the one resumed when nothing was left to train, none when asked for no
    steps at all (``--steps 0``: build, load, check; nothing trained, nothing written), else a new one."""
    if resumed_from is not None and start >= done:
        return Path(resumed_from)
    if job.steps == 0:
        return None
    return saving(save, done, job.started)


class Start(NamedTuple):
    step: int  # the step training starts from (0: from scratch)
    resumed_from: str | None  # the checkpoint resumed, or None
    resharded: str  # what resuming did with the saved layout
    restarted: str  # after an elastic restart: the failure that caused it and what is redone ("" otherwise)


def _start(job: ShardJob, out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, plan,
           ctx: RankContext) -> Start:
    """Resume from the checkpoint asked for (or, restarted by --max-restarts, the last this run published), at
    any layout: weights and optimizer state are saved in the unsharded model's coordinates; then write the plan,
    so a resume that fails leaves the run's files as they were."""
    start, found, resharded = 0, None, ""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if job.resume or restarted:
        # restarted: this run's own newest checkpoint first (a --resume-from one would redo the steps since)
        own = latest_checkpoint(out) if restarted else None
        found = own if own is not None and checkpoint_info(own).get("run") == job.run else \
            resume_target(out, job.resume_from)
        if found is not None:
            resumed = load_training_state(found, model, opt, ctx)
            start, resharded = resumed.step, resumed.describe()
    if ctx.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(plan.to_json())
        if job.resume or restarted:  # the steps after the checkpoint are trained, and logged, again
            truncate_metrics(out / METRICS_FILE, start)
    failure = last_failure() if restarted else None
    return Start(start, None if found is None else str(found), resharded,
                 "" if failure is None else failure.resumed(start))


def shard_worker(ranks: RankJob, job: ShardJob) -> ShardReport | None:
    """One rank of ``autotp shard``: ``ranks`` the sizes (the launcher's one value, handed over as this
    argument), ``job`` what to do; rank 0 returns the report, the others None."""
    Stops().install()  # until training starts, a stop signal ends the rank at once (nothing to keep yet)
    ctx = init_job(ranks)
    report = _shard(job, ctx)
    # on success only: a rank that raises leaves at once, so its error is recorded before a peer that fails
    # with it (or the launcher, stopping the others) can end this process; exiting closes the group anyway
    dist.destroy_process_group()
    return report


def _tp_batch(make, ctx: RankContext) -> tuple[tuple, dict]:
    """The first rank's ``make()`` (an (args, kwargs) batch) of its model replica (its TP group, and with
    context parallelism its CP groups: every rank sharing the sequences) on every rank of it, on this rank's
    device.

    Only one rank of the replica calls ``make``: a batch drawn without a seed (or read from a stream) would
    otherwise differ across it, which the model refuses (``InputMismatchError``)."""
    cp = ctx.grid.cp
    if ctx.grid.tp == 1 and cp == 1:
        return to_device(make(), ctx.device)
    batch = make() if ctx.coords["tp"] == 0 and ctx.coords.get("cp", 0) == 0 else None
    if cp > 1:  # to tp rank 0 of each cp rank first, then over each tp group
        batch = autotp.broadcast_batch(batch, group=ctx.cp_group())
    if ctx.grid.tp > 1:
        batch = autotp.broadcast_batch(batch, group=ctx.tp_group())
    return to_device(batch, ctx.device)


def _token_vocab(tpm: autotp.TPModule) -> int | None:
    """The smallest vocabulary of the embeddings the plan found indexed by the inputs' ids (position tables
    index an ``arange`` and are not among them); None when none is vocab-parallel."""
    sizes = [rows.size for _, rows in autotp.tp_state(tpm).plan.vocab.embeddings]
    return min(sizes) if sizes else None


def _build(mf: ModelFile, job: ShardJob, ctx: RankContext, batch: tuple[tuple, dict] | None):
    """(parallelized model, unsharded reference or None, unsharded bytes, what loading the weights cost, the
    batch to run).

    ``batch`` None (the file has no example_batch()): the model is captured on parallelize's own default, and
    runs on the default batch with ids drawn below its token vocabulary, which only the plan knows."""
    torch.manual_seed(0)
    reference, note = None, ""
    if job.weights is None:
        model = mf.build().to(ctx.device)
        unsharded_bytes = _param_bytes(model)
        reference = copy.deepcopy(model) if job.verify else None
    else:
        with autotp.empty_weights():  # parameters on meta: only this rank's shards are ever allocated
            model = mf.build()
        unsharded_bytes = _param_bytes(model)
        if job.verify:  # the unsharded model, whole on every rank: only for models that fit
            reference = mf.build().to(ctx.device)
            autotp.load_weights(reference, job.weights, device=ctx.device)
    forward = model.forward  # the user's: its keywords shape the default batch, and parallelize replaces it
    fsdp = dict(fsdp=_fsdp_config(job, ctx), mesh=ctx.mesh) if ctx.job.fsdp else \
        dict(fsdp=False, tp_group=ctx.tp_group())
    # autotp.parallelize, with the job's plan cache: the plan the check made before the ranks started
    tpm = parallelize_state(model, example_inputs=batch, compile=job.compile,
                            sequence_parallel=job.sequence_parallel, expert_parallel=job.expert_parallel,
                            device=None if job.weights is None else ctx.device, plan_cache=job.plans,
                            context_parallel=ctx.grid.cp, **fsdp)
    if job.weights is not None:
        note = _load(tpm, job.weights)
    if batch is None:
        vocab = _token_vocab(tpm)
        batch = _tp_batch(lambda: default_example(forward, vocab), ctx)
    return tpm, reference, unsharded_bytes, note, batch


def _describe_batch(mf: ModelFile, tpm: autotp.TPModule, args: tuple, kwargs: dict, tp: int) -> str:
    where = ", built on tp rank 0 and broadcast to its group" if tp > 1 else ""
    if mf.batch_fn is not None:
        shapes = ", ".join(str(tuple(t.shape)) for t in pytree.tree_leaves((args, kwargs))
                           if isinstance(t, torch.Tensor))
        return f"example_batch(): {shapes}{where}"
    vocab = _token_vocab(tpm)
    ids = "zeros" if vocab is None else f"ids < {vocab}, seed 0"
    return (f"default, as autotp.parallelize without example_inputs (the file defines no example_batch()): "
            f"{DEFAULT_BATCH_SHAPE} token ids ({ids}){where}")


def _log(job: ShardJob, ctx: RankContext, mf: ModelFile, start: int, phases: Phases) -> TrainLog:
    """Rank 0's training log (metrics file, TensorBoard, the file's log_metrics); says where it writes."""
    log = TrainLog(Path(job.out), active=ctx.rank == 0 and job.steps > start, hook=mf.log_metrics)
    if log.active:
        where = f"metrics to {log.path}" + (f", TensorBoard to {log.tensorboard}" if log.tensorboard else "")
        hook = ", and to the file's log_metrics()" if log.hook is not None else ""
        phases.say("train", f"steps {start + 1}–{job.steps}, every {max(job.log_every, 1)} logged: {where}{hook}")
    return log


def _shard(job: ShardJob, ctx: RankContext) -> ShardReport | None:
    mf = load_model_file(job.model)
    # the file's example_batch() runs before the seeded build, so whatever it draws from the global generator
    # (on TP rank 0 only) is forgotten: the ranks of a group keep equal generators, which replicated dropout needs
    batch = _tp_batch(mf.example_batch, ctx) if mf.batch_fn is not None else None
    phases = Phases(job.started or None, quiet=ctx.rank != 0)
    if ctx.grid.pp > 1:
        return _shard_pipeline(job, ctx, mf, batch, phases)
    phases.say("parallelize", "building the model on every rank, capturing it and sharding it"
               + (" (with FSDP)" if ctx.job.fsdp else ""))
    tpm, reference, unsharded_bytes, weights, (args, kwargs) = _build(mf, job, ctx, batch)
    if reference is not None:
        phases.say("parity", "comparing outputs and loss with the unsharded model")
    parity = _verify(tpm, reference, args, kwargs, ctx.device) if reference is not None else None
    del reference

    out = Path(job.out)
    plan_path = out / "plan.json"
    opt = torch.optim.AdamW(tpm.parameters(), lr=job.lr)
    grads = _grads_at_step(opt)
    start, resumed_from, resharded, restarted = _start(job, out, tpm, opt, autotp.tp_state(tpm).plan, ctx)

    def save(step: int) -> Path:
        return save_training_state(out, step, tpm, opt, ctx, run=job.run, keep=job.keep)

    # training minimises the output's loss: with none (a batch of inputs only, no targets, as the default batch
    # is) there is nothing to train; the summary says so, and the checkpoint holds the step actually reached
    skipped, log = "", None
    if start < job.steps and _eval_loss(tpm, args, kwargs) is None:
        skipped = ("the default batch holds token ids only, no targets, so the output carries no loss; define "
                   "example_batch() with the targets to train" if mf.batch_fn is None else
                   "the output on example_batch() carries no loss (looked for out.loss, out['loss'] and a 0-dim "
                   "tensor last in a tuple); add the targets the forward needs to train")
    if skipped:
        losses, times, final_loss, done = [], [], None, start
    else:
        model = data_parallel(tpm, ctx)
        log = _log(job, ctx, mf, start, phases)
        losses, times = _train(lambda a, k, norm: train_step(model, opt, a, k, job.clip_grad, norm), args, kwargs,
                               job, ctx, start, save, log)
        log.close()
        final_loss, done = _eval_loss(tpm, args, kwargs), max(start, job.steps)
    ckpt_path = _final_checkpoint(job, resumed_from, start, done, save)

    mine = RankStats(ctx.rank, ctx.coords["tp"], ctx.coords["dp"], _param_bytes(tpm), tuple(times),
                     peak_memory=peak_memory(ctx.device.type), cp_rank=ctx.coords.get("cp", 0),
                     grad_bytes=grads[0], state_bytes=held_state(opt).bytes,
                     plan_cached=autotp.tp_state(tpm).cached_from)
    everyone: list[RankStats | None] = [None] * ctx.grid.world_size
    dist.all_gather_object(everyone, mine)
    if ctx.rank != 0:
        return None
    counts = Counter((c.direction, c.kind, c.op) for c in autotp.tp_state(tpm).plan.collectives)
    report = ShardReport(
        model=job.model, tp=ctx.grid.tp, dp=ctx.grid.dp, cp=ctx.grid.cp, backend=ctx.backend,
        unsharded_bytes=unsharded_bytes,
        ranks=tuple(everyone), collectives=tuple((*key, n) for key, n in sorted(counts.items())),
        parity=parity, losses=tuple(losses), final_loss=final_loss,
        plan_path=str(plan_path), checkpoint_path=str(ckpt_path or ""), start_step=start, resumed_from=resumed_from,
        resharded=resharded, restarted=restarted, weights=weights,
        # the formula is a training step's (with the loss's backward); untrained, there was none
        comm=() if skipped else _comm_vs_formula(tpm, args, kwargs, ctx.grid.cp),
        batch=_describe_batch(mf, tpm, args, kwargs, ctx.grid.tp), training_skipped=skipped,
        fsdp=ctx.job.fsdp or 0, fsdp_units=autotp.tp_state(tpm).units or (), **_throughput(job, ctx, args, kwargs, times, log),
    )
    (out / "summary.json").write_text(json.dumps(report.to_dict(), indent=2))
    return report


def _fsdp_config(job: ShardJob, ctx: RankContext) -> FSDPConfig:
    """The job's FSDP: its replica groups, and with ``--fsdp-param-dtype`` the parameters gathered in that dtype
    and the gradients reduced in float32 (torchtitan's mixed precision)."""
    if job.fsdp_param_dtype is None:
        return FSDPConfig(replicas=ctx.job.fsdp)
    return FSDPConfig(replicas=ctx.job.fsdp, param_dtype=getattr(torch, job.fsdp_param_dtype), reduce_dtype=torch.float32)


def rank_flops(flops: float | None, grid: RankGrid) -> float | None:
    """One rank's share of a data-parallel replica's FLOPs per step (None: not counted). A replica spans
    tp · cp · pp ranks: each holds 1/tp of the heads and widths, 1/cp of the sequence (causal attention's work
    balanced by the chunk pairs), 1/pp of the blocks."""
    return flops / (grid.tp * grid.cp * grid.pp) if flops else None


def _throughput(job: ShardJob, ctx: RankContext, args: tuple, kwargs: dict, times: list[float],
                log: TrainLog | None) -> dict:
    """The report's throughput fields: tokens per step, the metrics files, the median step's MFU."""
    per_rank = rank_flops(job.flops, ctx.grid)
    median = statistics.median(times) if times else 0.0  # the summary's median step
    return dict(tokens_per_step=batch_tokens(args, kwargs) * ctx.grid.dp,
                metrics_path=str(log.path) if log is not None and log.active and log.path else "",
                tensorboard=str(log.tensorboard) if log is not None and log.tensorboard else "",
                mfu=mfu(per_rank, median, job.peak_flops), step_flops=job.flops)


def _comm_vs_formula(tpm: autotp.TPModule, args: tuple, kwargs: dict, cp: int = 1) -> tuple[tuple, ...]:
    """The plan's collectives for this batch against the formula (b, s: the first 2-D+ tensor input); with
    context parallelism each rank's collectives carry its s/cp positions, as ``autotp plan --cp`` says."""
    first = next((x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.dim() >= 2), None)
    if first is None or autotp.tp_state(tpm).tp == 1:
        return ()
    rep = build_report(autotp.tp_state(tpm).plan, _tp_local(tpm.named_parameters(remove_duplicate=False)),
                       first.shape[0], first.shape[1], cp=cp)
    return tuple((c.direction, c.kind, c.op, c.count, c.formula_count, c.elements, c.formula_elements,
                  c.bytes) for c in [*rep.comm, rep.total()])


def _tp_local(named):
    """Each parameter as this rank's TP shard (shape only): an FSDP DTensor's TP placement is its last."""
    made: dict[int, torch.Tensor] = {}
    for name, p in named:
        if isinstance(p, DTensor) and id(p) not in made:
            made[id(p)] = torch.empty(tp_local_shape(p), dtype=p.dtype, device="meta")
        yield name, made.get(id(p), p)


def _shard_pipeline(job: ShardJob, ctx: RankContext, mf: ModelFile, batch: tuple[tuple, dict] | None,
                    phases: Phases) -> ShardReport | None:
    """``_shard`` with pipeline stages: parity of the loss (eval, whole batch), training through the schedule,
    checkpoints of every stage into the one global layout."""
    if batch is None:
        raise ModelFileError("pipeline stages end in the loss, and the file defines no example_batch() to "
                             "compute one from", hint="define example_batch() returning the inputs and targets")
    args, kwargs = batch
    torch.manual_seed(0)
    weights = ""
    if job.weights is None:
        model = mf.build().to(ctx.device)
        reference = copy.deepcopy(model) if job.verify else None
    else:
        with autotp.empty_weights():  # parameters on meta: only this rank's stages' shards are ever allocated
            model = mf.build()
        reference = None
        if job.verify:  # the unsharded model, whole on every rank: only for models that fit
            reference = mf.build().to(ctx.device)
            autotp.load_weights(reference, job.weights, device=ctx.device)
    unsharded_bytes = _param_bytes(model)
    phases.say("parallelize", f"building the model on every rank, capturing it and cutting it into "
               f"{job.schedule} stages over {ctx.grid.pp} pipeline ranks, each stage sharded")
    pipe = autotp.pipeline(model, example_inputs=(args, kwargs), microbatches=job.microbatches or ctx.grid.pp,
                           schedule=job.schedule, virtual_stages=ctx.job.virtual_stages, mesh=ctx.mesh,
                           device=None if job.weights is None else ctx.device, compile=job.compile,
                           sequence_parallel=job.sequence_parallel, expert_parallel=job.expert_parallel,
                           fsdp=_fsdp_config(job, ctx) if ctx.job.fsdp else False)
    if job.weights is not None:
        weights = _load(model, job.weights)
    st = autotp.tp_state(model)
    parity = None
    if reference is not None:
        phases.say("parity", "comparing the loss with the unsharded model's, through the pipeline")
        note = "the loss, on the whole batch through the pipeline (forward only)"
        try:
            got = pipe.eval_step(*args, **kwargs).item()
        except autotp.PipelineError as exc:
            got, note = None, str(exc).splitlines()[0]
        with torch.no_grad():
            want = find_loss(reference.eval()(*args, **kwargs))
        if got is not None and want is not None:
            parity = Parity(abs(got - want.item()), None, note)  # the outputs stay on the last stage: not compared
    del reference
    out = Path(job.out)
    plan_path = out / "plan.json"
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=job.lr)
    grads = _grads_at_step(opt)
    start, resumed_from, resharded, restarted = _start(job, out, model, opt, st.plan, ctx)

    def step(a: tuple, k: dict, norm: bool) -> Stepped:
        loss = pipe.step(*a, **k)
        total = pipe.clip_grad_norm_(job.clip_grad if job.clip_grad > 0 else math.inf) \
            if norm or job.clip_grad > 0 else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        return Stepped(loss, total)

    def save(done: int) -> Path:
        return save_training_state(out, done, model, opt, ctx, run=job.run, keep=job.keep)

    log = _log(job, ctx, mf, start, phases)
    losses, times = _train(step, args, kwargs, job, ctx, start, save, log)
    log.close()
    done = max(start, job.steps)
    final_loss = None
    try:
        final_loss = pipe.eval_step(*args, **kwargs).item()
    except autotp.PipelineError:
        pass
    ckpt_path = _final_checkpoint(job, resumed_from, start, done, save)
    mine = RankStats(ctx.rank, ctx.coords["tp"], ctx.coords["dp"], held_params(pipe.parameters()).bytes,
                     tuple(times), ctx.coords["pp"], peak_memory(ctx.device.type), grad_bytes=grads[0],
                     state_bytes=held_state(opt).bytes)
    everyone: list[RankStats | None] = [None] * ctx.grid.world_size
    dist.all_gather_object(everyone, mine)
    if ctx.rank != 0:
        return None
    counts = Counter((c.direction, c.kind, c.op) for c in st.plan.collectives)
    report = ShardReport(
        model=job.model, tp=ctx.grid.tp, dp=ctx.grid.dp, cp=ctx.grid.cp, backend=ctx.backend,
        unsharded_bytes=unsharded_bytes,
        ranks=tuple(everyone), collectives=tuple((*key, n) for key, n in sorted(counts.items())),
        parity=parity, losses=tuple(losses), final_loss=final_loss, plan_path=str(plan_path),
        checkpoint_path=str(ckpt_path or ""), start_step=start, resumed_from=resumed_from, resharded=resharded,
        restarted=restarted, weights=weights, batch=_describe_batch(mf, model, args, kwargs, ctx.grid.tp), pp=ctx.grid.pp,
        pipeline=f"{pipe.schedule_name}, {pipe.microbatches} micro-batches, {pipe.virtual_stages} stage(s) per rank",
        stages=tuple(s.blocks for s in st.plan.stages), fsdp=(ctx.job.fsdp or 0) if pipe.fsdp else 0,
        fsdp_units=st.units or () if pipe.fsdp else (), **_throughput(job, ctx, args, kwargs, times, log),
    )
    (out / "summary.json").write_text(json.dumps(report.to_dict(), indent=2))
    return report
