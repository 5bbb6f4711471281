"""``autotp profile [--nproc N] [--model MODEL_PY]``: measure this node and write a hardware profile.

The layout planner prices a layout with a :class:`autotp.search.hardware.Hardware`: matmul rate, memory
bandwidth and memory, and what a collective costs per group size. The presets come from datasheets; this
command measures the machine it runs on instead. It starts ``--nproc`` ranks with torch's elastic launcher
(:mod:`autotp.search.profile` does the measuring, on all ranks at once), prints what it measured, and
writes the profile as JSON for ``--gpu PATH``. With ``--model`` the matmuls timed are the model's own, read
from its captured graph (on the meta device, as ``autotp plan`` captures it), so the sustained rate is the
one that model's shapes get.
"""
from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autotp.capture.model_spec import model_path
from autotp.cli.common import USAGE_ERROR, warm_ranks
from autotp.cli.plan_format import fmt_size
from autotp.cli.run import DEBUG, TIMEOUT, abort, as_flags
from autotp.errors import AutotpError, LaunchError, LaunchInterrupted, ModelFileError, RankFailedError
from autotp.search.hardware import Hardware, save

MAX_SHAPES = 8  # the largest by flops: a model's many small matmuls add little but time
DTYPE_NAMES = ("fp32", "bf16")  # autotp.search.profile.DTYPES' names, checked here before torch is imported


def model_shapes(model: str, limit: int = MAX_SHAPES) -> list[tuple[int, int, int]]:
    """The distinct (m, k, n) of the matmuls in MODEL_PY's captured forward, the ``limit`` largest by flops."""
    import torch

    from autotp.analysis.flops import shape_of
    from autotp.capture.modelfile import load_model_file, planning_batch
    from autotp.parallel.planning import How, PlanJob, capture_and_plan

    aten = torch.ops.aten
    # m = the leading output dims folded together, k = the contracted dim (its operand), n = the last output dim
    matmuls = {aten.linear.default: 0, aten.mm.default: 0, aten.matmul.default: 0, aten.bmm.default: 0,
               aten.addmm.default: 1}
    mf = load_model_file(model)
    with torch.device("meta"):
        net = mf.build()
    args, kwargs, *_ = planning_batch(mf, net, None, None)
    # captured as everything that plans captures (at tp 1 the plan is the blocks alone: the graph is the point)
    gm = capture_and_plan(net, args, kwargs, PlanJob(1), how=How(device=torch.device("cpu"))).gm
    shapes: set[tuple[int, int, int]] = set()
    for node in gm.graph.nodes:
        operand = matmuls.get(node.target) if node.op == "call_function" else None
        out = shape_of(node) if operand is not None else None
        left = shape_of(node.args[operand]) if out else None
        if out and left and len(out) >= 2:
            shapes.add((math.prod(out[:-1]), left[-1], out[-1]))
    return sorted(shapes, key=lambda s: (-math.prod(s), s))[:limit]


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.2f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.1f} GFLOP/s"


def _time(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def summary_table(hw: Hardware) -> Table:
    from autotp.cli.fit import FitTable

    table = FitTable(title=f"{escape(hw.name)}: {hw.gpus_per_node} ranks, {hw.extra.get('device')}, "
                           f"{hw.extra.get('dtype')}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right", no_wrap=True)
    table.add_column()
    table.add_row("matmul (sustained)", _rate(hw.matmul_flops), "total flops / total time over the shapes below")
    table.add_row("matmul (best shape)", _rate(hw.peak_flops), "peak_flops: the fastest shape measured")
    table.add_row("memory bandwidth", f"{hw.memory_bandwidth / 1e9:.1f} GB/s", "per rank, read + write")
    table.add_row("buffer copies", f"{hw.copy_bandwidth / 1e9:.1f} GB/s" if hw.copy_bandwidth else "not measured",
                  "a block's parameters into a flat buffer and out, read + write (what DDP and FSDP copy)")
    table.add_row("op overhead", f"{hw.overhead * 1e6:.1f} µs", "per op launched or dispatched (an add of 16 elements)")
    table.add_row("AdamW step", f"{hw.optimizer * 1e9:.2f} ns/param", "torch.optim.AdamW on 4M parameters")
    table.add_row("ranks per device", f"{hw.share:g}", "more ranks than cores: they take turns")
    table.add_row("memory", fmt_size(hw.memory_bytes), "per rank")
    table.add_row("threads per rank", str(hw.extra.get("threads_per_rank", "?")), "")
    table.add_row("intra-node link", f"{hw.intra.latency * 1e6:.1f} µs + bytes / "
                  f"{hw.intra.bandwidth / 1e9:.2f} GB/s", "all_reduce over the largest group")
    return table


def matmul_table(hw: Hardware) -> Table:
    from autotp.cli.fit import FitTable

    table = FitTable(title="matmuls (per rank, all ranks at once)", keys=3)
    for col in ("m", "k", "n", "GFLOP", "time", "rate"):
        table.add_column(col, justify="right", no_wrap=True)
    for m, k, n, rate in hw.matmuls:
        flops = 2 * m * k * n
        table.add_row(str(m), str(k), str(n), f"{flops / 1e9:.3g}", _time(flops / rate), _rate(rate))
    return table


def _nominal(nbytes: int) -> int:
    return 2 ** round(math.log2(nbytes))


def collective_table(hw: Hardware) -> Table:
    # a size rounded down to n equal shards (n odd) is shown in the column of the power of two asked for
    from autotp.cli.fit import FitTable

    columns = sorted({_nominal(b) for x in hw.measured for b, _ in x.points})
    table = FitTable(title="collectives: seconds = latency + wire / bandwidth (wire: 2(n−1)/n·S all-reduce, "
                           "(n−1)/n·S all-gather and reduce-scatter, S send), measured per message of S bytes",
                     keys=2, breaks=(4,))
    for col in ("collective", "ranks", "latency", "bandwidth"):
        table.add_column(col, justify="left" if col == "collective" else "right", no_wrap=col != "collective")
    for s in columns:
        table.add_column(fmt_size(s), justify="right", no_wrap=True)
    for x in hw.measured:
        cells = {_nominal(b): t for b, t in x.points}
        table.add_row(x.kind.replace("_", "-"), str(x.ranks), f"{x.link.latency * 1e6:.1f} µs",
                      f"{x.link.bandwidth / 1e9:.2f} GB/s", *(_time(cells[s]) if s in cells else "" for s in columns))
    return table


def render(hw: Hardware, console: Console) -> None:
    console.print(summary_table(hw))
    console.print(matmul_table(hw))
    console.print(collective_table(hw))
    for kind, note in hw.extra.get("collective_notes", {}).items():
        console.print(f"[yellow]note:[/yellow] {kind}: {escape(note)}")


def profile(
    ctx: typer.Context,
    nproc: int = typer.Option(2, "--nproc", help="Ranks to launch on this node (collectives need 2 or more)."),
    device: str | None = typer.Option(None, "--device", help="cuda (one GPU per rank, nccl) or cpu (gloo); "
                                      "default cuda when this node has a GPU, else cpu."),
    dtype: str | None = typer.Option(None, "--dtype", help="Matmul dtype, fp32 or bf16; default bf16 on cuda, "
                                     "fp32 on cpu."),
    model: str | None = typer.Option(None, "--model", metavar="MODEL_PY", help="Time the matmul shapes of "
                                     "this model file's captured forward (the 8 largest) instead of defaults."),
    out: Path = typer.Option(Path("autotp-profile.json"), "--out", help="Where to write the profile (JSON)."),
    quick: bool = typer.Option(False, "--quick", help="Fewer shapes, sizes and repeats: seconds, rougher."),
    timeout: float | None = TIMEOUT,
    debug: bool = DEBUG,
) -> None:
    """Measure this node (matmul rate, memory bandwidth, collectives per group size) and write a hardware
    profile for the layout planner."""
    from autotp.cli.progress import Phases, RankPhases

    phases = Phases()
    phases.say("check", f"the options, then this node's devices (importing torch: seconds)"
               f"{f' and {model} matmuls' if model else ''}, before any rank starts")
    # what needs no torch first (a second or more to import): a mistake is said at once
    if nproc < 2:
        abort(f"--nproc must be >= 2 (collectives need two ranks), got {nproc}", debug, code=USAGE_ERROR)
    if device not in (None, "cpu", "cuda"):
        abort(f"--device must be cpu or cuda, got {device}", debug, code=USAGE_ERROR)
    if dtype is not None and dtype not in DTYPE_NAMES:
        abort(f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype}", debug, code=USAGE_ERROR)
    if out.is_dir():
        abort(f"--out {out} is a folder: give a file path", debug, code=USAGE_ERROR)
    if not out.parent.is_dir():
        abort(f"--out {out}: folder {out.parent} does not exist", debug, code=USAGE_ERROR)
    if model is not None:
        try:
            model_path(model)
        except ModelFileError as exc:
            abort(str(exc), debug, code=USAGE_ERROR)
    warm_ranks(ctx)
    import torch

    from autotp.distributed.launch import LaunchSpec, launch
    from autotp.search.profile import ProfileJob, profile_worker

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype is None:
        dtype = "bf16" if device == "cuda" else "fp32"
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and have < nproc:
        abort(f"--device cuda: --nproc {nproc} needs {nproc} GPUs, this node has {have}", debug, code=USAGE_ERROR)
    shapes, shapes_from = None, None
    if model is not None:
        phases.say("check", f"{model}: capturing its forward on the meta device for the shapes of its matmuls")
        try:
            shapes = model_shapes(model)
        except (AutotpError, ValueError) as exc:  # model file and capture problems: the user's to fix
            abort(str(exc), debug, code=USAGE_ERROR)
        if not shapes:
            abort(f"--model {model}: its captured forward has no matmul to time", debug, code=USAGE_ERROR)
        shapes_from = f"the {len(shapes)} largest matmuls of {model}"
    try:
        spec = LaunchSpec(tp=nproc, device=device, timeout=timeout)
    except LaunchError as exc:
        abort(as_flags(exc), debug, code=USAGE_ERROR)
    job = ProfileJob.make(device, dtype, shapes, quick, shapes_from)
    phases.say("launch", f"starting {nproc} {device} ranks; rank 0 says each measurement as it starts")
    try:
        results = launch(spec, profile_worker, spec.job(), job, RankPhases(phases.started), quiet=not debug)
    except LaunchInterrupted as exc:
        abort(f"{exc}: nothing was written", debug, code=exc.code, trace="")
    except RankFailedError as exc:
        abort(exc.said(), debug, trace=exc.traceback)
    hw = Hardware.from_dict(results[0])
    save(hw, out)
    # the tables fit any width without cutting a number (autotp.cli.fit): a pipe gets rich's 80 columns
    console = Console()
    render(hw, console)
    console.print(f"wrote {escape(str(out))}")


def register(app: typer.Typer) -> None:
    app.command("profile", short_help="Measure this node for the layout planner.")(profile)
