"""Benchmark (not a test): the measured training-step time of every parallel layout autotp supports for one
GPT on 4 CPU ranks, the ground truth a cost model's predictions are compared against.

    python benchmarks/layouts_measured.py [--layouts PATTERN ...] [--steps 3] [--warmup 2] [--quick]
                                          [--wait-idle 180] [--retries 1] [--timeout 900]
                                          [--out benchmarks/results] [--list]

Model (``benchmarks/layout_gpt.py``, ``FULL``): nanoGPT-shaped, 8 pre-LN blocks, hidden 768, 12 heads,
vocab 8192, block 128, attention by ``F.scaled_dot_product_attention``, GELU MLP, LM head not tied to the
embedding, the loss computed in the model: 69.4M fp32 parameters (265 MiB). One global batch of 8 sequences
× 128 tokens, the same in every layout: data-parallel replica r takes sequences [r·8/dp, (r+1)·8/dp), a
pipeline cuts its replica's share into m micro-batches. ``--quick``: ``QUICK`` (4 layers, hidden 128, vocab
512, 32 tokens), a smoke run of the same layouts, written to ``layouts_measured.quick.{json,md}``.

Layouts (``LAYOUTS``), 4 ranks (tp × dp × pp, Megatron's order: tp innermost, then dp, then pp):

    tp ∈ {1, 2, 4}, pp ∈ {1, 2}, dp = 4 / (tp·pp)      (tp 4 × pp 2 needs 8 ranks: not a layout of 4)
    pp 1, dp ≥ 2   DDP over the dp group (what ``autotp run --dp`` does) and ``parallelize(fsdp=True)``
    pp 1, dp 1     tensor parallelism alone (tp 4)
    pp 2           ``autotp.pipeline``: 1F1B with m ∈ {2, 4} micro-batches and GPipe with m 4 (dp > 1: each
                   stage under DDP); micro-batch = 8 / dp / m
    single         the unsharded model on one rank (world 1, eager, no autotp), the reference

Each layout runs in a launch of its own through the project's launcher (``autotp.distributed.launch.launch``
with ``LaunchSpec(tp, dp, pp, device="cpu")``: gloo, ranks bound to their share of the cores, one intra-op
thread each when there are more ranks than cores; the single rank gets them all). Each rank calls
``init_distributed`` (the layout's (pp, dp, tp) mesh), builds the model with the same seed (every rank the
same weights), parallelizes or pipelines it (the build: capture, plan, split), and makes AdamW (lr 1e-4,
torch's default CPU path). A step: forward, backward, ``opt.step()``, ``opt.zero_grad()`` (a pipeline's
forward and backward are ``Pipeline.step``), timed on every rank from its exit of a barrier to its end; the
step's time is the slowest rank's. ``--warmup`` steps (the first allocates Adam's state and first-call
caches), then ``--steps`` timed ones: ``step_s`` is their median. Also per layout: the build time (slowest
rank), the peak RSS (largest ``ru_maxrss`` over the ranks, the build included), and the loss of each step
(the mean over the ranks: over the dp replicas' shares of the batch), which at step 1 must equal the
single rank's (the same weights and batch): the check that every layout computes the same step.

Other processes' load is measured as the layout's: before each layout the harness waits (``--wait-idle``
s at most) for the cores to be under 15% busy, and over its timed steps it reads the machine's busy CPU
(/proc/stat) against the CPU the ranks used: ``load.foreign_share`` is the rest's share of all core time.
A layout measured with more than 20% of the core time others' runs again (``--retries`` times at most), and
the quieter run is kept. Also reported: the shortest timed step (``best_s``) and the ranks' CPU per step
(``cpu_s``).

A layout autotp refuses (an ``AutotpError`` while building, raised on every rank before any collective) is
recorded with its reason; a launch that fails (a rank's error, a watchdog's timeout: ``--timeout`` s per
phase, every thread's traceback then dumped) with its error. The machine is shared: compare layouts of one
run, and mind the load average reported with it.

From another script (``benchmarks`` on ``sys.path``)::

    from layouts_measured import LAYOUTS, measure, build_model, FULL
    step_s = measure(LAYOUTS[3], FULL)          # one launch; raises LayoutRefused if autotp refuses it

Writes ``OUT/layouts_measured.json`` and ``OUT/layouts_measured.md``. With ``--layouts`` (fnmatch patterns
or substrings of the names), the rows of an existing results file of the same model and batch are kept for
the layouts not run again.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]

from fsdp import peak  # noqa: E402  (benchmarks/fsdp.py: ru_maxrss in bytes)
from layout_gpt import FULL, QUICK, GPTConfig, build_model, example_batch, param_count  # noqa: E402
from pipeline import Watchdog, _excerpt, _source_version  # noqa: E402  (benchmarks/pipeline.py)

__all__ = ["BATCH", "FULL", "LAYOUTS", "QUICK", "GPTConfig", "LayoutFailed", "LayoutRefused", "build_model",
           "example_batch", "make_layouts", "measure", "run_layout"]

WORLD = 4
BATCH = 8  # global batch, sequences (each of cfg.block_size tokens)
MiB = 2**20
HZ = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count() or 1
DEFAULTS = {"steps": 3, "warmup": 2, "timeout": 900, "wait_idle": 180, "retries": 1}
BUSY_RETRY = 0.2  # others' share of the core time over a layout's timed steps above which it runs again


# -- the layouts --------------------------------------------------------------------------------------------

def layout_name(lay: dict) -> str:
    if lay["world"] == 1:
        return "single"
    name = f"tp{lay['tp']}-dp{lay['dp']}-pp{lay['pp']}"
    if lay["pp"] > 1:
        return f"{name}-{lay['schedule']}-m{lay['microbatches']}"
    if lay["dp"] > 1:
        return f"{name}-{'fsdp' if lay['fsdp'] else 'ddp'}"
    return name


def _layout(tp: int, dp: int, pp: int, *, fsdp: bool = False, schedule: str | None = None, m: int = 1,
            batch: int = BATCH) -> dict:
    lay = {"world": tp * dp * pp, "tp": tp, "dp": dp, "pp": pp, "fsdp": fsdp, "schedule": schedule,
           "microbatches": m, "micro_batch": batch // dp // m}
    return {"name": layout_name(lay), **lay}


def make_layouts(world: int = WORLD, batch: int = BATCH) -> tuple[list[dict], list[dict]]:
    """(layouts to time, combinations that are no layout of ``world`` ranks with the reason)."""
    out = [_layout(1, 1, 1, batch=batch)]
    skipped = []
    for pp in (1, 2):
        for tp in (1, 2, 4):
            if world % (tp * pp):
                skipped.append({"name": f"tp{tp}-pp{pp}", "tp": tp, "pp": pp,
                                "reason": f"tp·pp = {tp * pp} does not divide {world} ranks"})
                continue
            dp = world // (tp * pp)
            if pp == 1:
                out += ([_layout(tp, dp, 1, fsdp=f, batch=batch) for f in (False, True)] if dp > 1
                        else [_layout(tp, dp, 1, batch=batch)])
            else:
                out += [_layout(tp, dp, pp, schedule=s, m=m, batch=batch)
                        for s, m in (("1F1B", 2), ("1F1B", 4), ("GPipe", 4))]
    return out, skipped


LAYOUTS, SKIPPED = make_layouts()


def select(patterns: list[str] | None, layouts: list[dict] = LAYOUTS) -> list[dict]:
    if not patterns:
        return list(layouts)
    return [lay for lay in layouts
            if any(fnmatch.fnmatch(lay["name"], p) or p in lay["name"] for p in patterns)]


# -- the machine's load ------------------------------------------------------------------------------------

def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine since boot, in clock ticks (/proc/stat's first line; busy:
    user, nice, system, irq, softirq and steal, i.e. everything but idle and iowait)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def busy_fraction(seconds: float = 1.0) -> float:
    """The share of the machine's cores busy over the next ``seconds``."""
    b0, t0 = cpu_jiffies()
    time.sleep(seconds)
    b1, t1 = cpu_jiffies()
    return (b1 - b0) / max(1, t1 - t0)


def wait_for_idle(limit: float, threshold: float = 0.15) -> dict:
    """Wait (at most ``limit`` s) until the cores are busy less than ``threshold`` of a second: other
    processes' load would be measured as the layout's. Returns the last busy fraction and the wait."""
    start = time.perf_counter()
    busy = busy_fraction()
    while busy >= threshold and time.perf_counter() - start < limit:
        time.sleep(4.0)
        busy = busy_fraction()
    return {"busy_before": round(busy, 3), "waited_s": round(time.perf_counter() - start, 1)}


# -- on every rank ------------------------------------------------------------------------------------------

def _rank_main(lay: dict, cfg: dict, opts: dict) -> dict:
    """Build ``lay`` on this rank and time its steps; returns this rank's times, losses and memory."""
    import torch
    import torch.distributed as dist

    import autotp
    from autotp.distributed.launch import init_distributed

    from layout_gpt import GPTConfig, build_model, example_batch

    ctx = init_distributed(lay["tp"], lay["dp"], lay["pp"])  # binds this rank to its cores
    rank = dist.get_rank()
    dog = Watchdog(os.path.join(opts["dumps"], f"rank{rank}.txt"))
    coords = ctx.coords
    config = GPTConfig(**cfg)
    per = opts["batch"] // lay["dp"]
    ids, targets = example_batch(config, opts["batch"])
    r = coords.get("dp", 0)
    ids, targets = ids[r * per:(r + 1) * per].contiguous(), targets[r * per:(r + 1) * per].contiguous()

    dog.arm(opts["timeout"], "build")
    t0 = time.perf_counter()
    try:
        model = build_model(config)
        if lay["world"] == 1:
            params, step_fn = model.parameters(), lambda: model(ids, targets)[1]
        elif lay["pp"] > 1:
            pipe = autotp.pipeline(model, example_inputs=(ids, targets), microbatches=lay["microbatches"],
                                   schedule=lay["schedule"], mesh=ctx.mesh)
            params, step_fn = pipe.parameters(), lambda: pipe.step(ids, targets)
        else:
            where = (dict(fsdp=True, mesh=ctx.mesh) if lay["fsdp"]
                     else dict(fsdp=False, tp_group=ctx.tp_group()))
            model = autotp.parallelize(model, example_inputs=((ids, targets), {}), **where)
            if lay["dp"] > 1 and not lay["fsdp"]:
                model = torch.nn.parallel.DistributedDataParallel(model, process_group=ctx.dp_group())
            params, step_fn = model.parameters(), lambda: model(ids, targets)[1]
    except autotp.AutotpError as e:  # raised on every rank alike, before any collective
        dog.disarm()
        return {"refused": f"{type(e).__name__}: {e}", "coords": coords}
    opt = torch.optim.AdamW(params, lr=1e-4)
    build_s = time.perf_counter() - t0
    dog.disarm()

    times, cpu, losses = [], [], []
    window = {}
    for i in range(opts["warmup"] + opts["steps"]):
        dog.arm(opts["timeout"], f"step {i}")
        dist.barrier()
        if i == opts["warmup"]:  # the timed window opens: this process's CPU, the machine's (rank 0)
            window = {"cpu0": time.process_time(), "stat0": cpu_jiffies() if rank == 0 else None}
        t, c = time.perf_counter(), time.process_time()
        loss = step_fn()
        if lay["pp"] == 1:  # Pipeline.step ran the backward already
            loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        dog.disarm()
        losses.append(loss.item())
    dist.barrier()
    window.update(cpu1=time.process_time(), stat1=cpu_jiffies() if rank == 0 else None)
    return {"times": times, "cpu": cpu, "losses": losses, "build_s": build_s, "peak_rss": peak(), "coords": coords,
            "window": window, "threads": torch.get_num_threads(), "cpus": sorted(os.sched_getaffinity(0))}


# -- in the launching process -------------------------------------------------------------------------------

class LayoutRefused(RuntimeError):
    """autotp refused to build the layout (the reason is the message)."""


class LayoutFailed(RuntimeError):
    """The layout's launch failed (a rank's error, a timeout)."""


def run_layout(lay: dict, cfg: GPTConfig = FULL, *, steps: int = DEFAULTS["steps"],
               warmup: int = DEFAULTS["warmup"], batch: int = BATCH, timeout: float = DEFAULTS["timeout"],
               wait_idle: float = 0.0) -> dict:
    """One launch of ``lay`` (a dict of ``LAYOUTS``: world, tp, dp, pp, fsdp, schedule, microbatches) on
    ``lay['world']`` ranks; the result row: ``status`` ("ok", "refused" with ``reason``, "failed" with
    ``error``), and when ok ``step_s`` (median of the timed steps), ``steps``, ``warmup_steps``, ``losses``,
    ``build_s``, ``peak_rss_mb``, ``launch_s``, ``cpu_s`` (the ranks' CPU in a step, summed, median) and
    ``load`` (over the timed steps: the machine's busy CPU not the ranks', ``foreign_share`` of all its core
    time). ``wait_idle`` > 0: first wait up to that many seconds for the machine to go quiet."""
    from autotp.distributed.launch import LaunchSpec, launch
    from autotp.errors import RankFailedError

    lay = _layout(lay["tp"], lay["dp"], lay["pp"], fsdp=lay.get("fsdp", False), schedule=lay.get("schedule"),
                  m=lay.get("microbatches", 1), batch=batch)  # normalised, micro_batch for this batch
    if batch % (lay["dp"] * lay["microbatches"]):
        raise ValueError(f"layout {lay['name']}: dp·m = {lay['dp'] * lay['microbatches']} does not divide the "
                         f"batch of {batch}")
    row = {**lay, "model": cfg.as_dict(), "batch": batch, "seq": cfg.block_size}
    idle = wait_for_idle(wait_idle) if wait_idle > 0 else {}
    spec = LaunchSpec(tp=lay["tp"], dp=lay["dp"], pp=lay["pp"], device="cpu", timeout=timeout)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as dumps:
        opts = {"steps": steps, "warmup": warmup, "batch": batch, "timeout": timeout, "dumps": dumps}
        try:
            ranks = launch(spec, _rank_main, lay, cfg.as_dict(), opts)
        except RankFailedError as e:
            dumps_text = "\n".join(f"[{f.name}]\n{_excerpt(f.read_text(), 40)}"
                                   for f in sorted(Path(dumps).glob("*.txt")) if "Thread" in f.read_text())
            err = _excerpt(f"{e}\n{e.traceback}", 40) + ("\n" + dumps_text if dumps_text else "")
            return {**row, "status": "failed", "error": err, "launch_s": time.perf_counter() - start}
    row["launch_s"] = time.perf_counter() - start
    refused = {r["refused"] for r in ranks.values() if "refused" in r}
    if refused:
        return {**row, "status": "refused", "reason": sorted(refused)[0]}
    n = warmup + steps
    per_step = [max(r["times"][i] for r in ranks.values()) for i in range(n)]
    timed = per_step[warmup:]
    losses = [statistics.fmean(r["losses"][i] for r in ranks.values()) for i in range(n)]
    # the timed window: the CPU the ranks used against the machine's busy CPU (others' load, steal)
    w0 = ranks[0]["window"]
    busy = (w0["stat1"][0] - w0["stat0"][0]) / HZ
    total = (w0["stat1"][1] - w0["stat0"][1]) / HZ
    own = sum(r["window"]["cpu1"] - r["window"]["cpu0"] for r in ranks.values())
    return {**row, "status": "ok", "step_s": statistics.median(timed), "best_s": min(timed), "steps": timed,
            "warmup_steps": per_step[:warmup], "rank0_steps": ranks[0]["times"][warmup:], "losses": losses,
            "cpu_s": statistics.median(sum(r["cpu"][i] for r in ranks.values()) for i in range(warmup, n)),
            "load": {**idle, "window_s": round(total / CORES, 2), "own_cpu_s": round(own, 2),
                     "machine_busy_cpu_s": round(busy, 2),
                     "foreign_share": round(max(0.0, busy - own) / total, 3) if total else None},
            "build_s": max(r["build_s"] for r in ranks.values()),
            "peak_rss_mb": max(r["peak_rss"] for r in ranks.values()) / MiB,
            "threads_per_rank": ranks[0]["threads"], "cpus": {str(k): r["cpus"] for k, r in ranks.items()}}


def measure(layout: dict, model_cfg: GPTConfig = FULL, *, steps: int = DEFAULTS["steps"],
            warmup: int = DEFAULTS["warmup"], batch: int = BATCH, timeout: float = DEFAULTS["timeout"],
            wait_idle: float = 0.0) -> float:
    """The measured step time (s, median of ``steps`` after ``warmup``) of ``layout`` for ``model_cfg``'s
    model: forward + backward + AdamW step + zero_grad of the global batch of ``batch`` sequences of
    ``model_cfg.block_size`` tokens. Raises :class:`LayoutRefused` or :class:`LayoutFailed`."""
    row = run_layout(layout, model_cfg, steps=steps, warmup=warmup, batch=batch, timeout=timeout,
                     wait_idle=wait_idle)
    if row["status"] == "refused":
        raise LayoutRefused(row["reason"])
    if row["status"] == "failed":
        raise LayoutFailed(row["error"])
    return row["step_s"]


# -- the report ---------------------------------------------------------------------------------------------

def _machine() -> dict:
    import torch

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = len(os.sched_getaffinity(0))
    return {"cores": cores, "cpu": cpu, "memory_gib": round(mem / 2**30, 1), "torch": torch.__version__,
            "python": platform.python_version(), "backend": "gloo",
            "summary": f"{cores} cores ({cpu or platform.machine()}), {mem / 2**30:.0f} GiB, "
                       f"torch {torch.__version__}, gloo"}


def _schedule(r: dict) -> str:
    return f"{r['schedule']} m{r['microbatches']}" if r["pp"] > 1 else ("FSDP2" if r["fsdp"] else
                                                                          "DDP" if r["dp"] > 1 else "–")


def _command(res: dict) -> str:
    """The command line that makes ``res`` again (its options that differ from the defaults)."""
    parts = ["python benchmarks/layouts_measured.py"] + (["--quick"] if res["quick"] else [])
    for k, v in res["options"].items():
        if k == "layouts":
            parts += ["--layouts", *v] if v else []
        elif v != DEFAULTS.get(k):
            parts += [f"--{k.replace('_', '-')}", f"{v:g}"]
    return " ".join(parts)


def _markdown(res: dict) -> str:
    rows = res["layouts"]
    ref = next((r for r in rows if r["name"] == "single" and r["status"] == "ok"), None)
    m = res["model"]
    lines = [
        "# Measured step time of every parallel layout (4 CPU ranks)",
        "",
        f"GPT (benchmarks/layout_gpt.py): {m['n_layer']} layers, hidden {m['n_embd']}, {m['n_head']} heads, vocab "
        f"{m['vocab_size']}, LM head untied, {m['params'] / 1e6:.1f}M fp32 parameters ({m['bytes'] / MiB:.0f} MiB). "
        f"Global batch {res['batch']} × {res['seq']} tokens in every layout. A step: forward + backward + AdamW "
        "step + zero_grad, timed on every rank from a barrier, the slowest rank's; step s = median of "
        f"{res['options']['steps']} steps after {res['options']['warmup']} warm-up steps. Each layout in a launch "
        "of its own (autotp's launcher, gloo, ranks bound to their cores). best s: the shortest timed step. CPU "
        "s / step: the ranks' process CPU time in a step, summed (median). others' CPU: the machine's busy core "
        "time over the timed steps that was not the ranks' (other processes, the launcher, steal), as a share of "
        "all its core time: a layout measured with much of it is slowed by them. Machine: "
        f"{res['machine']['summary']}; load average {res['load'][0]:.2f} at the start, {res['load'][1]:.2f} at "
        "the end.",
        "",
        "| layout | tp | dp | pp | data parallel / schedule | micro-batch | step s (median) | best s | steps s | "
        "vs single | CPU s / step | others' CPU | build s | peak RSS MiB/rank | loss step 1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['name']} | {r['tp']} | {r['dp']} | {r['pp']} | {_schedule(r)} | {r['micro_batch']} |"
        if r["status"] != "ok":
            why = (r.get("reason") or r.get("error") or "").strip().splitlines()
            lines.append(f"{head} {r['status']}: {why[0] if why else ''} |" + " |" * 8)
            continue
        vs = f"{r['step_s'] / ref['step_s']:.2f}" if ref else "–"
        lines.append(f"{head} {r['step_s']:.3f} | {r['best_s']:.3f} | {', '.join(f'{t:.2f}' for t in r['steps'])} | "
                     f"{vs} | {r['cpu_s']:.2f} | {r['load']['foreign_share']:.0%} | {r['build_s']:.1f} | "
                     f"{r['peak_rss_mb']:.0f} | {r['losses'][0]:.5f} |")
    for s in res["skipped"]:
        lines.append(f"| {s['name']} | {s['tp']} | | {s['pp']} | not a layout: {s['reason']} |" + " |" * 10)
    ok = [r for r in rows if r["status"] == "ok"]
    if ref and ok:
        worst = max(abs(r["losses"][0] - ref["losses"][0]) for r in ok)
        lines += ["", f"Loss at step 1 (the same weights and batch everywhere): largest difference from the single "
                      f"rank's {ref['losses'][0]:.5f} over the layouts {worst:.1e}."]
    bad = [r for r in rows if r["status"] != "ok"]
    if bad:
        lines += ["", "## Refused or failed", ""]
        for r in bad:
            lines += [f"{r['name']} ({r['status']}):", "", "```", (r.get("reason") or r.get("error") or "").strip(),
                      "```", ""]
    lines += ["", f"autotp: HEAD {res['source']['commit'][:12]}, sources digest {res['source']['sources']}"
              + (" (the sources changed during the run)." if res["source_changed"] else "."),
              "", f"Reproduce: `{_command(res)}` (this run: {res['wall_s']:.0f} s wall, {len(rows)} layouts)."]
    return "\n".join(lines) + "\n"


def _table(rows: list[dict], ref: dict | None):
    from rich.table import Table

    table = Table(title="measured step time per layout")
    for col in ("layout", "tp", "dp", "pp", "dp/schedule", "micro-batch", "step s", "best s", "vs single",
                "steps s", "CPU s", "others' CPU", "build s", "peak RSS MiB", "loss 1"):
        table.add_column(col, justify="right" if col not in ("layout", "dp/schedule") else "left")
    for r in rows:
        base = [r["name"], str(r["tp"]), str(r["dp"]), str(r["pp"]), _schedule(r), str(r["micro_batch"])]
        if r["status"] != "ok":
            why = (r.get("reason") or r.get("error") or "").strip().splitlines()
            table.add_row(*base, f"[red]{r['status']}[/]", "", "", (why[0] if why else "")[:60], "", "", "", "", "")
            continue
        table.add_row(*base, f"{r['step_s']:.3f}", f"{r['best_s']:.3f}",
                      f"{r['step_s'] / ref['step_s']:.2f}" if ref else "–", " ".join(f"{t:.2f}" for t in r["steps"]),
                      f"{r['cpu_s']:.2f}", f"{r['load']['foreign_share']:.0%}", f"{r['build_s']:.1f}",
                      f"{r['peak_rss_mb']:.0f}", f"{r['losses'][0]:.4f}")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", metavar="PATTERN",
                    help="only these layouts (fnmatch patterns or substrings of the names: "
                         + ", ".join(lay["name"] for lay in LAYOUTS) + ")")
    ap.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="untimed steps before them")
    ap.add_argument("--quick", action="store_true", help="the small QUICK model: a smoke run")
    ap.add_argument("--timeout", type=float, default=DEFAULTS["timeout"], help="s per build or step before a rank "
                                                                               "is ended (and collective timeout)")
    ap.add_argument("--wait-idle", type=float, default=DEFAULTS["wait_idle"],
                    help="before each layout, wait up to this many s for the cores to be < 15%% busy (0: don't)")
    ap.add_argument("--retries", type=int, default=DEFAULTS["retries"],
                    help=f"run a layout again (at most this many times) when others used more than {BUSY_RETRY * 100:.0f}%% "
                         "of the cores over its timed steps; the quieter run is kept")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--list", action="store_true", help="print the layouts and exit")
    a = ap.parse_args()
    if a.steps < 1 or a.warmup < 0:
        ap.error("need --steps >= 1 and --warmup >= 0")

    from rich.console import Console

    console = Console(width=200)
    chosen = select(a.layouts)
    if a.list or not chosen:
        for lay in LAYOUTS:
            console.print(lay["name"], {k: v for k, v in lay.items() if k != "name"})
        if not chosen:
            console.print(f"[red]no layout matches {a.layouts}[/]")
        return
    cfg = QUICK if a.quick else FULL
    stem = "layouts_measured" + (".quick" if a.quick else "")
    out = Path(a.out)
    start = time.perf_counter()
    load0 = os.getloadavg()[0]
    source = _source_version()
    rows = []
    for lay in chosen:
        console.print(f"[bold]{lay['name']}[/] ({lay['world']} rank{'s' if lay['world'] > 1 else ''}) …", end=" ")
        row = run_layout(lay, cfg, steps=a.steps, warmup=a.warmup, batch=BATCH, timeout=a.timeout,
                         wait_idle=a.wait_idle)
        for attempt in range(a.retries):  # measured under others' load: once more, the quieter run kept
            if row["status"] != "ok" or row["load"]["foreign_share"] <= BUSY_RETRY:
                break
            console.print(f"others' CPU {row['load']['foreign_share']:.0%} (step {row['step_s']:.3f} s): again …",
                          end=" ")
            again = run_layout(lay, cfg, steps=a.steps, warmup=a.warmup, batch=BATCH, timeout=a.timeout,
                               wait_idle=a.wait_idle)
            again["attempts"] = attempt + 2
            if again["status"] == "ok" and again["load"]["foreign_share"] < row["load"]["foreign_share"]:
                row = again
        row["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        rows.append(row)
        if row["status"] == "ok":
            console.print(f"step {row['step_s']:.3f} s ({', '.join(f'{t:.2f}' for t in row['steps'])}; warm-up "
                          f"{', '.join(f'{t:.2f}' for t in row['warmup_steps'])}), build {row['build_s']:.1f} s, "
                          f"launch {row['launch_s']:.0f} s, loss {row['losses'][0]:.5f}, others' CPU "
                          f"{row['load']['foreign_share']:.0%}" + (f", waited {row['load']['waited_s']:.0f} s for "
                                                                   f"quiet" if row["load"].get("waited_s", 0) > 2 else ""))
        else:
            console.print(f"[red]{row['status']}[/]: {(row.get('reason') or row.get('error') or '').strip()}")
    params = param_count(cfg)
    model = {**cfg.as_dict(), "params": params, "bytes": 4 * params, "dtype": "float32", "tied": False}
    if a.layouts and (out / f"{stem}.json").exists():  # keep the other layouts' rows of the same model
        old = json.loads((out / f"{stem}.json").read_text())
        if old.get("model") == model and old.get("batch") == BATCH:
            ran = {r["name"] for r in rows}
            order = [lay["name"] for lay in LAYOUTS]
            kept = [r for r in old["layouts"]  # rows of this harness's current schema only
                    if r["name"] not in ran and (r["status"] != "ok" or {"best_s", "load", "cpu_s"} <= set(r))]
            rows = sorted(kept + rows,
                          key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
    res = {"model": model, "batch": BATCH, "seq": cfg.block_size, "tokens": BATCH * cfg.block_size,
           "machine": _machine(), "world": WORLD, "quick": a.quick,
           "options": {"steps": a.steps, "warmup": a.warmup, "timeout": a.timeout, "wait_idle": a.wait_idle,
                       "retries": a.retries, "layouts": a.layouts},
           "layouts": rows, "skipped": SKIPPED, "load": [load0, os.getloadavg()[0]],
           "wall_s": time.perf_counter() - start, "source": source,
           "source_changed": _source_version()["sources"] != source["sources"]}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stem}.md").write_text(_markdown(res))
    ref = next((r for r in rows if r["name"] == "single" and r["status"] == "ok"), None)
    console.print(_table(rows, ref))
    for s in SKIPPED:
        console.print(f"[yellow]not a layout[/] {s['name']}: {s['reason']}")
    console.print(f"wrote {out / (stem + '.md')} and {out / (stem + '.json')} ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
