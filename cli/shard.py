"""``autotp shard MODEL_PY --tp N``: shard a model file, check it against the unsharded model, train a few
steps, and write the plan and a sharded checkpoint.

Every rank builds the model with the same seed, keeps an unsharded reference (unless ``--no-verify``),
parallelizes over its TP group, compares loss and outputs on the example batch, then trains ``--steps``
AdamW steps (DDP over the DP group when dp > 1) and saves ``plan.json``, ``summary.json`` and a sharded
checkpoint (torch.distributed.checkpoint) to ``--out``. The launching process prints the summary.

Checkpoints are atomic (:mod:`autotp.io.ckpt_io`): ``--out/checkpoints/step-N`` folders published by renaming a
finished temporary folder and replacing the ``checkpoints/latest`` pointer, with ``--out/checkpoint`` a symlink
to the newest. They hold the model, the optimizer state and the step in the unsharded model's coordinates, so
``--resume`` (and a restart under ``--max-restarts``) continues where the last complete checkpoint left off, at
any ``--tp`` and ``--dp`` the model's sizes allow (the summary says what was resharded); ``--steps`` is the
total step count.
A checkpoint is checked before any rank starts, and loading it unpickles nothing (:mod:`autotp.io.ckpt_io`).

Before any rank starts, the launching process imports the model file, builds the model on the meta device,
captures the example batch and plans the sharding, so a broken file, a batch the model rejects or a size the
tp degree does not divide fails at once with exit code 2.

``--weights PATH`` is for models that do not fit one device: every rank calls ``build_model()`` inside
``autotp.empty_weights()`` (parameters on meta, buffers computed by the model's own code), ``parallelize``
allocates only its shards, and ``autotp.load_weights`` reads only its slices of PATH (a Hugging Face
safetensors folder or file, an autotp/DCP checkpoint, a torch state-dict file). Names and shapes are checked
against the model before any rank starts. No unsharded reference is built unless ``--verify`` is given.
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

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import autotp
from autotp.cli.run import (DEBUG, DEVICE, DP, MASTER_ADDR, MASTER_PORT, MAX_RESTARTS, NNODES, NODE_RANK, TIMEOUT,
                            TP, abort, launch_spec)
from autotp.io.ckpt_io import check_resumable, latest_checkpoint, load_training_state, save_training_state
from autotp.errors import AutotpError, CaptureError
from autotp.plan.report import build_report
from autotp.distributed.launch import RankContext, RankFailedError, init_from_env, launch
from autotp.capture.modelfile import (ModelFile, ModelFileError, find_loss, load_model_file, output_tensors, parse_spec,
                              replica_batch, to_device)

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
    compile: bool = False
    weights: str | None = None  # load from this checkpoint into a model built on meta
    sequence_parallel: bool = False


@dataclass(frozen=True)
class Parity:
    loss_diff: float | None  # None when the model returns no loss on the example batch
    output_diff: float
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.output_diff <= PARITY_TOL and (self.loss_diff is None or self.loss_diff <= PARITY_TOL)


@dataclass(frozen=True)
class RankStats:
    rank: int
    tp_rank: int
    dp_rank: int
    param_bytes: int
    step_s: tuple[float, ...]


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
    weights: str = ""  # where the weights came from and what loading them cost (--weights)
    # TP communication of one step against Megatron's formula (README, "What a step costs"):
    # (direction, kind, op, count, formula count, elements, formula elements, bytes) per kind, then the total
    comm: tuple[tuple, ...] = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["parity"] = None if self.parity is None else {**asdict(self.parity), "ok": self.parity.ok}
        return d


# -- the worker ----------------------------------------------------------------------------------------
def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


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
    # the worst rank decides
    worst = torch.tensor([loss_diff or 0.0, out_diff], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return Parity(None if loss_diff is None else worst[0].item(), worst[1].item(), note)


def _eval_loss(tpm, args: tuple, kwargs: dict) -> float | None:
    tpm.eval()
    with torch.no_grad():
        loss = find_loss(tpm(*args, **kwargs))
    tpm.train()
    return None if loss is None else loss.item()


def data_parallel(tpm: autotp.TPModule, ctx: RankContext) -> torch.nn.Module:
    """``tpm`` under DDP over this rank's DP group when dp > 1 (each TP shard's gradients are averaged
    across the replicas holding the same shard), else ``tpm`` itself."""
    if ctx.layout.dp == 1:
        return tpm
    return torch.nn.parallel.DistributedDataParallel(
        tpm, process_group=ctx.dp_group(), device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> torch.Tensor:
    """One optimizer step of ``model`` (a :func:`data_parallel` module) on this replica's batch; the loss."""
    loss = find_loss(model(*args, **kwargs))
    if loss is None:
        raise ModelFileError("the model's output on the example batch carries no loss (looked for "
                             "out.loss, out['loss'], and a 0-dim tensor last in a tuple)",
                             hint="make example_batch() include the targets the forward needs")
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _train(model, opt, args: tuple, kwargs: dict, job: ShardJob, ctx: RankContext, start: int = 0,
           save=None) -> tuple[list, list]:
    """Steps ``start`` ... ``job.steps - 1``; ``save(step)`` after every ``job.save_every``-th (not the last)."""
    losses, times = [], []
    show = ctx.rank == 0 and job.steps > start
    progress = Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn()) \
        if show else contextlib.nullcontext()
    with progress:
        task = progress.add_task("train", total=job.steps, completed=start, loss="-") if show else None
        for step in range(start, job.steps):
            a, k = replica_batch(args, kwargs, ctx.coords["dp"], step)
            start = time.perf_counter()
            loss = train_step(model, opt, a, k)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
            if task is not None:
                progress.update(task, advance=1, loss=f"{losses[-1]:.4f}")
            done = step + 1
            if save is not None and job.save_every and done % job.save_every == 0 and done != job.steps:
                save(done)
    return losses, times


def shard_worker(job: ShardJob) -> ShardReport | None:
    """One rank of ``autotp shard``; rank 0 returns the report, the others None."""
    ctx = init_from_env()
    try:
        return _shard(job, ctx)
    finally:
        dist.destroy_process_group()


def _build(mf: ModelFile, job: ShardJob, ctx: RankContext, args: tuple, kwargs: dict):
    """(parallelized model, unsharded reference or None, unsharded bytes, what loading the weights cost)."""
    torch.manual_seed(0)
    if job.weights is None:
        model = mf.build().to(ctx.device)
        unsharded_bytes = _param_bytes(model)
        reference = copy.deepcopy(model) if job.verify else None
        tpm = autotp.parallelize(model, tp_group=ctx.tp_group(), example_inputs=(args, kwargs), compile=job.compile,
                                 sequence_parallel=job.sequence_parallel)
        return tpm, reference, unsharded_bytes, ""
    with autotp.empty_weights():  # parameters on meta: only this rank's shards are ever allocated
        model = mf.build()
    unsharded_bytes = _param_bytes(model)
    reference = None
    if job.verify:  # the unsharded model, whole on every rank: only for models that fit
        reference = mf.build().to(ctx.device)
        autotp.load_weights(reference, job.weights, device=ctx.device)
    tpm = autotp.parallelize(model, tp_group=ctx.tp_group(), example_inputs=(args, kwargs), compile=job.compile,
                             sequence_parallel=job.sequence_parallel, device=ctx.device)
    loaded = autotp.load_weights(tpm, job.weights)
    most = torch.tensor([loaded.bytes_read, loaded.seconds], dtype=torch.float64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    note = f"{job.weights} ({loaded.kind}): {_size(int(most[0]))} read per rank (most), {most[1]:.1f} s"
    return tpm, reference, unsharded_bytes, note


def _shard(job: ShardJob, ctx: RankContext) -> ShardReport | None:
    mf = load_model_file(job.model)
    args, kwargs = to_device(mf.example_batch(), ctx.device)
    tpm, reference, unsharded_bytes, weights = _build(mf, job, ctx, args, kwargs)
    parity = _verify(tpm, reference, args, kwargs, ctx.device) if reference is not None else None
    del reference

    out = Path(job.out)
    plan_path = out / "plan.json"
    if ctx.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        plan_path.write_text(autotp.tp_state(tpm).plan.to_json())
    opt = torch.optim.AdamW(tpm.parameters(), lr=job.lr)
    start, resumed_from, resharded = 0, None, ""
    # a job restarted by --max-restarts resumes from the last complete checkpoint, as --resume does; at any tp
    # and dp: weights and optimizer state are saved in the unsharded model's coordinates
    if job.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        found = latest_checkpoint(out)
        if found is not None:
            resumed = load_training_state(found, tpm, opt, ctx)
            start, resumed_from, resharded = resumed.step, str(found), resumed.describe()

    def save(step: int) -> Path:
        return save_training_state(out, step, tpm, opt, ctx)

    losses, times = _train(data_parallel(tpm, ctx), opt, args, kwargs, job, ctx, start, save)
    final_loss = _eval_loss(tpm, args, kwargs)
    ckpt_path = Path(resumed_from) if resumed_from is not None and start >= job.steps else save(max(start, job.steps))

    mine = RankStats(ctx.rank, ctx.coords["tp"], ctx.coords["dp"], _param_bytes(tpm), tuple(times))
    everyone: list[RankStats | None] = [None] * ctx.layout.world_size
    dist.all_gather_object(everyone, mine)
    if ctx.rank != 0:
        return None
    counts = Counter((c.direction, c.kind, c.op) for c in autotp.tp_state(tpm).plan.collectives)
    report = ShardReport(
        model=job.model, tp=ctx.layout.tp, dp=ctx.layout.dp, backend=ctx.backend, unsharded_bytes=unsharded_bytes,
        ranks=tuple(everyone), collectives=tuple((*key, n) for key, n in sorted(counts.items())),
        parity=parity, losses=tuple(losses), final_loss=final_loss,
        plan_path=str(plan_path), checkpoint_path=str(ckpt_path), start_step=start, resumed_from=resumed_from,
        resharded=resharded, weights=weights,
        comm=_comm_vs_formula(tpm, args, kwargs),
    )
    (out / "summary.json").write_text(json.dumps(report.to_dict(), indent=2))
    return report


def _comm_vs_formula(tpm: autotp.TPModule, args: tuple, kwargs: dict) -> tuple[tuple, ...]:
    """The plan's collectives for this batch against the formula (b, s: the first 2-D+ tensor input)."""
    first = next((x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.dim() >= 2), None)
    if first is None or autotp.tp_state(tpm).tp == 1:
        return ()
    rep = build_report(autotp.tp_state(tpm).plan, tpm.named_parameters(remove_duplicate=False), first.shape[0], first.shape[1])
    return tuple((c.direction, c.kind, c.op, c.count, c.formula_count, c.elements, c.formula_elements,
                  None if c.elements is None else c.elements * rep.act_bytes) for c in [*rep.comm, rep.total()])


# -- the command ---------------------------------------------------------------------------------------
def _eager_on_meta(mf: ModelFile, skeleton: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Run the meta-device ``skeleton`` on meta copies of the batch; a ModelFileError carrying the forward's
    own exception."""
    import traceback as tb

    meta = to_device((args, kwargs), torch.device("meta"))
    try:
        with torch.no_grad():
            skeleton(*meta[0], **meta[1])
    except Exception as exc:  # noqa: BLE001 - the model's own message is the point
        if "meta" in str(exc):  # the forward needs real values (export's own error says why): not this
            return
        torch_dir = os.path.dirname(torch.__file__)
        frames = [f for f in tb.extract_tb(exc.__traceback__)
                  if not f.filename.startswith(torch_dir) and "site-packages" not in f.filename]
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        raise ModelFileError(f"the model's forward rejects example_batch(){where}: {type(exc).__name__}: {exc}",
                             hint="make example_batch() match what the model accepts (e.g. sequence length "
                                  "<= its block size)") from exc


def preflight(mf: ModelFile, tp: int, weights: Path | None = None, sequence_parallel: bool = False) -> None:
    """Build the model on the meta device, capture the example batch and plan for ``tp``, in this process.

    Raises the :class:`AutotpError` a rank would raise (the factory's or forward's own message, a size ``tp``
    does not divide, ``weights`` whose names or shapes do not fit the model), before any rank starts. Failures that are not autotp's (a model that cannot be built or
    traced on the meta device for reasons of its own) are left for the ranks to report.
    """
    from autotp.capture.tracer import capture
    from autotp.plan.planner import make_plan

    try:
        with torch.device("meta"):
            model = mf.build()
    except ModelFileError:
        model = mf.build()  # the factory may need real tensors; if it fails here too, that is its message
    if weights is not None:
        from autotp.io.weights import check_weights

        check_weights(model, weights)  # headers and metadata only
    args, kwargs = mf.example_batch()
    try:
        gm, _ = capture(model, args, kwargs, device=torch.device("cpu"))  # export computes nothing
    except CaptureError:
        # export reports a model's own check on symbolic sizes ("length s75"); the plain forward on meta
        # tensors reports it with the real ones
        if all(t.is_meta for t in model.parameters()):
            _eager_on_meta(mf, model, args, kwargs)
        raise
    except Exception:  # noqa: BLE001
        return
    try:
        make_plan(gm, tp, sequence_parallel=sequence_parallel)
    except AutotpError:
        raise
    except Exception:  # noqa: BLE001 - not a user error autotp can explain; the ranks will show it in full
        return


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ms(seconds: tuple[float, ...]) -> str:
    return f"{statistics.median(seconds) * 1e3:.1f} ms" if seconds else "-"


def render(report: ShardReport, console: Console) -> None:
    ranks = Table(title=f"{escape(report.model)}: tp {report.tp} × dp {report.dp} ({report.backend})")
    for col, justify in (("rank", "right"), ("tp", "right"), ("dp", "right"), ("parameters", "right"),
                         ("of unsharded", "right"), ("step (median)", "right")):
        ranks.add_column(col, justify=justify)
    for r in report.ranks:
        share = f"{100 * r.param_bytes / report.unsharded_bytes:.0f}%" if report.unsharded_bytes else "-"
        ranks.add_row(str(r.rank), str(r.tp_rank), str(r.dp_rank), _size(r.param_bytes), share, _ms(r.step_s))
    console.print(ranks)

    summary = Table(show_header=False, title="summary")
    summary.add_column(style="bold")
    summary.add_column()
    for direction in ("forward", "backward"):
        items = [f"{n} × {kind}" + (f"({op})" if op else "")
                 for d, kind, op, n in report.collectives if d == direction]
        summary.add_row(f"TP collectives / step, {direction}", ", ".join(items) or "none")
    summary.add_row("DP gradient sync", f"DDP all-reduce over {report.dp} replicas" if report.dp > 1 else "none (dp 1)")
    p = report.parity
    if p is None:
        why = "--weights: no whole copy of the model per rank unless --verify" if report.weights else "--no-verify"
        summary.add_row("parity vs unsharded", f"skipped ({why})")
    else:
        loss = "n/a (no loss)" if p.loss_diff is None else f"{p.loss_diff:.2e}"
        verdict = "[green]pass[/green]" if p.ok else "[red]FAIL[/red]"
        summary.add_row("parity vs unsharded",
                        f"{verdict} max |Δloss| {loss}, max |Δoutput| {p.output_diff:.2e} (tol {PARITY_TOL:g})"
                        + (f" {escape(p.note)}" if p.note else ""))
    if report.resumed_from is not None:
        summary.add_row("resumed", f"from step {report.start_step} ({escape(report.resumed_from)})")
        if report.resharded:
            summary.add_row("layout", escape(report.resharded))
    if report.weights:
        summary.add_row("weights", escape(report.weights))
    if report.losses:
        summary.add_row("loss (dp replica 0)", " → ".join(f"{x:.4f}" for x in report.losses))
    summary.add_row("plan", escape(report.plan_path))
    summary.add_row("checkpoint", escape(report.checkpoint_path))
    console.print(summary)
    if report.comm:
        comm = Table(title="TP communication per training step, per rank, vs Megatron's formula (README: 'What a step costs')")
        for col in ("pass", "collective", "count", "formula", "ratio", "elements", "formula", "ratio", "bytes"):
            comm.add_column(col, justify="left" if col in ("pass", "collective") else "right")

        def ratio(a, b):
            return "-" if a is None or not b else f"{a / b:.2f}"

        for d, kind, op, n, fn, el, fel, nbytes in report.comm:
            name = "all" if kind == "all" else kind.replace("_", "-") + (f"({op})" if op else "")
            comm.add_row({"forward": "fwd", "backward": "bwd"}.get(d, d), name, str(n), str(fn), ratio(n, fn),
                         "-" if el is None else f"{el:,}", "-" if fel is None else f"{fel:,}", ratio(el, fel),
                         "-" if nbytes is None else _size(nbytes))
        console.print(comm)


def shard(
    model: str = typer.Argument(..., metavar="MODEL_PY", help="Model file defining build_model() and "
                                "example_batch(); path.py:NAME names another factory."),
    tp: int = TP,
    dp: int = DP,
    steps: int = typer.Option(3, "--steps", help="AdamW training steps after the parity check."),
    lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate."),
    out: Path = typer.Option(Path("autotp-out"), "--out", help="Folder for plan.json, summary.json, checkpoints."),
    verify: bool | None = typer.Option(None, "--verify/--no-verify", help="Compare with the unsharded model "
                                       "first (default: yes, except with --weights)."),
    weights: Path | None = typer.Option(None, "--weights", metavar="PATH", help="Build the model on the meta "
                                        "device and load each rank's slices from PATH: a Hugging Face "
                                        "safetensors folder or file, an autotp/DCP checkpoint, a torch file."),
    compile_: bool = typer.Option(False, "--compile", help="torch.compile the rewritten graphs."),
    sequence_parallel: bool = typer.Option(False, "--sequence-parallel", help="Split the norm/dropout/residual "
                                           "regions along the sequence (Megatron-SP)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest complete checkpoint in --out "
                                "(model, optimizer, step) up to --steps in total."),
    save_every: int = typer.Option(0, "--save-every", help="Also checkpoint every N steps (0: only at the end)."),
    nnodes: int = NNODES,
    node_rank: int = NODE_RANK,
    master_addr: str | None = MASTER_ADDR,
    master_port: int | None = MASTER_PORT,
    timeout: float | None = TIMEOUT,
    max_restarts: int = MAX_RESTARTS,
    device: str = DEVICE,
    debug: bool = DEBUG,
) -> None:
    """Shard MODEL_PY over tp × dp ranks, verify, train a few steps, save plan and checkpoint."""
    from autotp.cli.main import USAGE_ERROR

    if steps < 0:
        abort(f"--steps must be >= 0, got {steps}", debug, code=USAGE_ERROR)
    if not lr > 0:
        abort(f"--lr must be > 0, got {lr}", debug, code=USAGE_ERROR)
    if save_every < 0:
        abort(f"--save-every must be >= 0, got {save_every}", debug, code=USAGE_ERROR)
    if out.exists() and not out.is_dir():
        abort(f"--out {out} exists and is not a folder", debug, code=USAGE_ERROR)
    spec = launch_spec(tp, dp, nnodes, node_rank, master_addr, master_port, debug, timeout, max_restarts, device)
    try:
        preflight(load_model_file(model), tp, weights, sequence_parallel)  # before any rank starts
    except AutotpError as exc:
        abort(str(exc), debug, code=USAGE_ERROR)
    try:
        resumable = check_resumable(out) if resume else None
    except AutotpError as exc:
        abort(str(exc), debug, code=USAGE_ERROR)
    if resume and node_rank == 0 and resumable is None:
        Console(stderr=True).print(f"[yellow]note:[/yellow] --resume: no checkpoint in {escape(str(out))} yet; "
                                   "starting from step 0", soft_wrap=True)
    path, factory = parse_spec(model)
    job = ShardJob(model=f"{path.resolve()}:{factory}" if factory else str(path.resolve()),
                   steps=steps, lr=lr, out=str(out.resolve()), verify=weights is None if verify is None else verify,
                   resume=resume, save_every=save_every, compile=compile_, sequence_parallel=sequence_parallel,
                   weights=None if weights is None else str(weights.resolve()))
    try:
        results = launch(spec, shard_worker, job, quiet=not debug)
    except RankFailedError as exc:
        why = ""
        if timeout is not None and "timed out" in exc.message.lower():
            why = f" (no peer answered within --timeout {timeout:g} s: another rank is hung or dead)"
        abort(f"rank {exc.rank}: {exc.message}{why}", debug, trace=exc.traceback)
    except AutotpError as exc:
        abort(str(exc), debug)
    report = results.get(0)
    console = Console()
    if report is None:
        console.print(f"node {node_rank}: {spec.nproc_per_node} ranks finished; the node running rank 0 "
                      "prints the summary")
        return
    render(report, console)
    if report.parity is not None and not report.parity.ok:
        p = report.parity
        abort(f"sharded model differs from the unsharded one: max |Δloss| {p.loss_diff}, max |Δoutput| "
              f"{p.output_diff} exceed {PARITY_TOL:g}", debug, trace="")


def register(app: typer.Typer) -> None:
    app.command("shard")(shard)
