"""Benchmark (not a test): pipeline bubble and activation memory of GPipe, 1F1B and Interleaved1F1B under
``autotp.pipeline``, measured from per-stage timestamps and saved-for-backward bytes, against the formulas.

    python benchmarks/pipeline.py [--steps 10] [--warmup 2] [--pp 2 4] [--microbatches 2 4 8]
                                  [--schedules GPipe 1F1B Interleaved1F1B] [--timeout 180]
                                  [--out benchmarks/results]

Model: the example nanoGPT (examples/nanogpt.py) with 8 layers, dim 384, 6 heads, vocab 2048, block 128,
dropout 0 (15.0M parameters, the LM head tied to the embedding); one batch of 8 × 128 tokens, the same for
every configuration, cut into m micro-batches (m = 8: one sequence each). fp32, gloo, one intra-op thread
per rank, tp 1, dp 1, on a (pp, 1, 1) device mesh. A step is ``Pipeline.step`` (the forward and backward of
the whole batch through the schedule, the loss broadcast to every rank), then the gradients are dropped;
no optimizer, so every step computes the same thing and the loss must equal the unpipelined model's.

One launch per pp builds every configuration of that pp side by side on each rank (each from its own copy
of the same model) and steps them in turns: a barrier, one step of each configuration, the order reversed
every other round, ``--warmup`` rounds left out, then ``--steps`` timed rounds, so that all see the same
machine load (the machine is shared and noisy: compare ratios from one run, not absolute times). The
unpipelined model's step on the whole batch runs in the same rounds on pipeline rank 0 alone (the others
wait in the barrier): the single-rank reference.

Instrumentation (in this process only; the library is not changed): each ``PipelineStage``'s
``forward_one_chunk`` and ``backward_one_chunk`` are wrapped with ``perf_counter`` and ``thread_time``
stamps. The schedules call them after the micro-batch's receives have completed and send afterwards, so a
span is the stage's own computation (the last stage's backward includes the loss's). Per step:

    step        the global window: the earliest rank's start of ``Pipeline.step`` to the latest rank's end
    busy_r      the wall time of rank r's spans; cpu_r the CPU time of its thread in them
    ideal       Σ_r cpu_r / p: the step if the work were spread evenly over p ranks with a core each and
                nobody waited
    bubble      (step − ideal) / ideal, against (p − 1)/m for GPipe and 1F1B, (p − 1)/(v·m) for
                Interleaved1F1B (v = 2): the pipeline flush measured in units of the ideal step
    idle_r      1 − busy_r / step, against the formula's (p − 1)/(m + p − 1) (interleaved: v·m for m)
    model       the formula with the ranks' own work: max_r cpu_r + (Σ_r cpu_r − max_r cpu_r)/(v·m), which
                equal stages turn into ideal · (1 + formula); floor: that, or Σ_r cpu_r / cores if larger

Reported: the median over the timed rounds, and the best (shortest) step with its idle fractions and
timeline. Other processes on the machine only ever add time to a step while the work is the same every
step, so the best step is the least disturbed one. ``cpu_r`` rather than the wall time makes the ideal
independent of how the kernel shares the cores among the ranks. Also per step: each rank's CPU outside its
spans (all its threads: the schedule, gloo, the loss), and the hand-off latency (a span's end to the start
of the span on another rank that waited for it, when that rank was idle).

Memory (one more round after the timed ones, not timed): every tensor that autograd saves for backward
inside a stage's forward is seen by a ``saved_tensors_hooks`` pack hook, which counts the bytes of its
storage once (parameters left out) and keeps it in a small holder whose release subtracts them again when
the backward frees the graph: the bytes saved for backward alive at once on each rank, and their peak. The
wrappers also count the micro-batches in flight on each rank (forward done, backward not yet), in units of
one micro-batch through one stage, and the bytes one such forward saves. Expected in flight on pipeline
rank r: GPipe m; 1F1B min(m, p − r) (its warm-up runs p − r forwards before the first backward);
Interleaved1F1B min(v·m, w + 1), w = (v − 1)·m/k + 2·(p − 1 − r), k = max(1, m // p) rounds (torch's
``_get_warmup_ops``: Megatron's (v − 1)·p + 2·(p − r − 1) when m is a multiple of p), each unit holding
1/v of the rank's layers.

A configuration the library refuses (``PipelineError``) is recorded as such. Each rank arms a watchdog
(``faulthandler.dump_traceback_later``, ``--timeout`` s per step, more for the build) that dumps every
thread's traceback and ends the rank; if a launch fails, each of its configurations is tried in a launch
of its own (one step), the failing ones are recorded with their tracebacks, and the rest run again together.

Writes ``OUT/pipeline.json`` and ``OUT/pipeline.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests" / "support")]

CONFIG = dict(n_layer=8, n_embd=384, n_head=6, vocab_size=2048, block_size=128, dropout=0.0)
BATCH, SEQ = 8, 128
V = 2  # virtual stages per rank of Interleaved1F1B
MiB = 2**20
BUILD_TIMEOUT = 600  # s: capture and planning of one configuration with 4 ranks on 2 cores
DEFAULTS = {"steps": 10, "warmup": 2, "pp": [2, 4], "microbatches": [2, 4, 8],
            "schedules": ["GPipe", "1F1B", "Interleaved1F1B"], "timeout": 180}


# -- records ------------------------------------------------------------------------------------------------

@dataclass
class Span:
    """One forward or backward of one micro-batch through one stage, on one rank."""

    kind: str  # "F" or "B"
    stage: int
    mb: int
    start: float  # perf_counter, s (one clock for every process on the machine)
    end: float
    cpu: float  # CPU time of the rank's thread in the span, s


@dataclass
class StepRecord:
    """One ``Pipeline.step`` on one rank."""

    start: float
    end: float
    cpu: float  # CPU time of the rank's main thread over the step
    process_cpu: float  # CPU time of all the rank's threads (gloo's own included) over the step
    loss: float
    spans: list[Span] = field(default_factory=list)
    inflight_peak: int = 0
    saved_peak: int = 0  # bytes saved for backward alive at once (memory round only)
    saved_per_forward: dict[int, list[int]] = field(default_factory=dict)  # stage -> bytes each forward saved


@dataclass
class Ledger:
    """Bytes of the storages saved for backward that are alive now, each storage counted once."""

    params: frozenset[int]
    holders: dict[int, int] = field(default_factory=dict)  # storage pointer -> holders alive
    sizes: dict[int, int] = field(default_factory=dict)
    live: int = 0
    peak: int = 0
    added: int = 0  # bytes of storages first seen since the last reset (one forward's own)

    def hold(self, key: int, nbytes: int) -> None:
        if self.holders.get(key, 0) == 0:
            self.sizes[key] = nbytes
            self.live += nbytes
            self.added += nbytes
            self.peak = max(self.peak, self.live)
        self.holders[key] = self.holders.get(key, 0) + 1

    def release(self, key: int) -> None:
        self.holders[key] -= 1
        if self.holders[key] == 0:
            del self.holders[key]
            self.live -= self.sizes.pop(key)


class Saved:
    """What the pack hook stores in the graph instead of the tensor: freeing the graph frees this holder,
    whose release is the moment the saved bytes stop counting."""

    __slots__ = ("tensor", "key", "ledger")

    def __init__(self, tensor, key: int, ledger: Ledger):
        self.tensor, self.key, self.ledger = tensor, key, ledger
        ledger.hold(key, tensor.untyped_storage().nbytes())

    def __del__(self):
        self.ledger.release(self.key)


class Recorder:
    """The spans and the in-flight count of one pipeline on this rank; with ``ledger`` set, the stages'
    forwards run under the saved-tensors hooks."""

    def __init__(self):
        self.step: StepRecord | None = None
        self.ledger: Ledger | None = None
        self.inflight = 0

    def instrument(self, stage) -> None:
        import torch

        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key in self.ledger.params or t.device.type == "meta":
                return t  # a parameter (or a view of one): weights, not activations
            return Saved(t, key, self.ledger)

        def unpack(x):
            return x.tensor if isinstance(x, Saved) else x

        def forward_one_chunk(mb, *args, **kwargs):
            hooks = (torch.autograd.graph.saved_tensors_hooks(pack, unpack) if self.ledger is not None
                     else contextlib.nullcontext())
            if self.ledger is not None:
                self.ledger.added = 0
            t0, c0 = time.perf_counter(), time.thread_time()
            with hooks:
                out = forward(mb, *args, **kwargs)
            self._span("F", stage.stage_index, mb, t0, c0)
            if self.ledger is not None:
                self.step.saved_per_forward.setdefault(stage.stage_index, []).append(self.ledger.added)
            self.inflight += 1
            self.step.inflight_peak = max(self.step.inflight_peak, self.inflight)
            return out

        def backward_one_chunk(mb, *args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            out = backward(mb, *args, **kwargs)
            self._span("B", stage.stage_index, mb, t0, c0)
            self.inflight -= 1
            return out

        # instance attributes: this pipeline's stages only, torch's class untouched
        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk

    def _span(self, kind: str, stage: int, mb: int, t0: float, c0: float) -> None:
        self.step.spans.append(Span(kind, stage, mb, t0, time.perf_counter(), time.thread_time() - c0))


# -- on every rank ------------------------------------------------------------------------------------------

def _label(schedule: str, m: int) -> str:
    return f"{schedule} m{m}"


class Watchdog:
    """Ends this rank with every thread's traceback in ``path`` if an armed phase outlasts its limit: a hung
    schedule becomes a failed launch with a traceback instead of a stuck benchmark."""

    def __init__(self, path: str):
        self.file = open(path, "w")

    def arm(self, seconds: float, what: str) -> None:
        import faulthandler

        self.file.write(f"\n-- {what} (limit {seconds:.0f} s)\n")
        self.file.flush()
        faulthandler.dump_traceback_later(seconds, exit=True, file=self.file)

    def disarm(self) -> None:
        import faulthandler

        faulthandler.cancel_dump_traceback_later()


def sweep(pp: int, configs: list[list], opts: dict) -> dict:
    """Every configuration ``[schedule, m]`` of this pp built on this rank and stepped in turns; returns the
    per-step records of each, the single-rank reference's on pipeline rank 0, and the refusals."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    from nanogpt import GPT, GPTConfig

    torch.set_num_threads(1)
    rank = dist.get_rank()
    dog = Watchdog(os.path.join(opts["dumps"], f"pp{pp}_rank{rank}.txt"))
    mesh = init_device_mesh("cpu", (pp, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**CONFIG))
    g = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g) for _ in range(2))

    pipes: dict[str, tuple] = {}
    refused: dict[str, str] = {}
    build_s: dict[str, float] = {}
    for schedule, m in configs:
        label = _label(schedule, m)
        dog.arm(BUILD_TIMEOUT, f"build {label}")
        t = time.perf_counter()
        try:
            pipe = autotp.pipeline(copy.deepcopy(ref), example_inputs=batch, microbatches=m, schedule=schedule,
                                   virtual_stages=V if schedule == "Interleaved1F1B" else None, mesh=mesh)
        except autotp.PipelineError as e:  # raised on every rank alike, before any collective
            refused[label] = f"{type(e).__name__}: {e}"
            continue
        finally:
            dog.disarm()
        build_s[label] = time.perf_counter() - t
        rec = Recorder()
        for stage in pipe.stages:
            rec.instrument(stage)
        params = frozenset(p.untyped_storage().data_ptr() for p in pipe.parameters())
        pipes[label] = (pipe, rec, params)

    records: dict[str, list[dict]] = {label: [] for label in pipes}
    reference: list[dict] = []
    order = ["reference", *pipes]
    rounds = opts["warmup"] + opts["steps"] + 1  # the last round: memory
    for rnd in range(rounds):
        memory = rnd == rounds - 1
        for label in (order if rnd % 2 == 0 else order[::-1]):
            dist.barrier()
            if label == "reference":
                if mesh.get_local_rank("pp") == 0 and not memory:
                    t0, c0 = time.perf_counter(), time.thread_time()
                    loss = ref(*batch)[1]
                    loss.backward()
                    ref.zero_grad(set_to_none=True)
                    reference.append({"start": t0, "end": time.perf_counter(), "cpu": time.thread_time() - c0,
                                      "loss": loss.item()})
                continue
            pipe, rec, params = pipes[label]
            rec.ledger = Ledger(params) if memory else None
            rec.inflight = 0
            dog.arm(opts["timeout"], f"round {rnd} {label}")
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            rec.step = StepRecord(t0, 0.0, 0.0, 0.0, 0.0)
            loss = pipe.step(*batch)
            rec.step.end, rec.step.cpu = time.perf_counter(), time.thread_time() - c0
            rec.step.process_cpu = time.process_time() - p0
            dog.disarm()
            for p in pipe.parameters():
                p.grad = None
            rec.step.loss = loss.item()
            if memory:
                rec.step.saved_peak = rec.ledger.peak
                rec.ledger = None
            records[label].append(asdict(rec.step))
    info = {label: {"stages": list(p.stage_indices),
                    "blocks": [list(s.blocks) for s in autotp.tp_state(p.model).plan.stages],
                    "params": sum(x.numel() for x in p.parameters())} for label, (p, _, _) in pipes.items()}
    return {"pp_rank": mesh.get_local_rank("pp"), "records": records, "reference": reference, "refused": refused,
            "build_s": build_s, "info": info, "params": sum(p.numel() for p in ref.parameters())}


# -- in the launching process -------------------------------------------------------------------------------

def expected_inflight(schedule: str, p: int, m: int, r: int) -> int:
    """Micro-batch × stage units in flight at most on pipeline rank ``r``, from the schedule's warm-up."""
    if schedule == "GPipe":
        return m
    if schedule == "1F1B":
        return min(m, p - r)
    rounds = max(1, m // p)
    warmup = min((V - 1) * (m // rounds) + 2 * (p - 1 - r), V * m)
    return min(V * m, warmup + 1)


def bubble_formula(schedule: str, p: int, m: int) -> float:
    return (p - 1) / (V * m if schedule == "Interleaved1F1B" else m)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def handoffs(recs: dict[int, dict], count: int) -> list[float]:
    """Hand-off latencies of one step, s: for each span that waited on another rank's span (the forward of
    micro-batch i at stage s on the forward at s − 1, a backward on the backward at s + 1) and whose rank was
    idle when that span ended, the time from its end to this span's start: send, receive and wake-up."""
    spans = {(x["kind"], x["stage"], x["mb"]): (r, x) for r, rec in recs.items() for x in rec["spans"]}
    ends = {r: sorted(x["end"] for x in rec["spans"]) for r, rec in recs.items()}
    out = []
    for (kind, stage, mb), (r, x) in spans.items():
        src = stage - 1 if kind == "F" else stage + 1
        if not 0 <= src < count or (kind, src, mb) not in spans:
            continue
        r0, y = spans[(kind, src, mb)]
        before = [e for e in ends[r] if e <= x["start"]]
        if r0 != r and (not before or before[-1] <= y["end"]):
            out.append(x["start"] - y["end"])
    return out


def analyse(pp: int, schedule: str, m: int, ranks: dict[int, dict], timed: slice, cores: int) -> dict:
    """The step, bubble, idle and memory numbers of one configuration from every rank's records."""
    label = _label(schedule, m)
    by_pp = {r["pp_rank"]: r["records"][label] for r in ranks.values()}
    v = V if schedule == "Interleaved1F1B" else 1
    steps = []
    for i in range(len(by_pp[0])):
        recs = {r: by_pp[r][i] for r in range(pp)}
        window = max(x["end"] for x in recs.values()) - min(x["start"] for x in recs.values())
        busy = {r: sum(s["end"] - s["start"] for s in x["spans"]) for r, x in recs.items()}
        cpu = {r: sum(s["cpu"] for s in x["spans"]) for r, x in recs.items()}
        total, slowest = sum(cpu.values()), max(cpu.values())
        ideal = total / pp
        # the formula with this step's own per-rank work: the slowest rank's whole work, plus the others' fill
        # and drain in 1/(v·m) slices; uniform stages give ideal · (1 + (p − 1)/(v·m))
        model = slowest + (total - slowest) / (v * m)
        floor = max(model, total / min(pp, cores))  # no more ranks compute at once than there are cores
        steps.append({"step": window, "busy": busy, "cpu": cpu, "ideal": ideal, "model": model, "floor": floor,
                      "bubble": (window - ideal) / ideal, "imbalance": slowest / ideal,
                      "idle": {r: 1 - b / window for r, b in busy.items()},
                      "span_stretch": sum(busy.values()) / total,
                      "other_cpu": {r: x["process_cpu"] - cpu[r] for r, x in recs.items()},
                      "handoff": handoffs(recs, pp * v), "loss": recs[0]["loss"]})
    run = steps[timed]
    mem = {r: by_pp[r][-1] for r in range(pp)}
    best = min(range(len(run)), key=lambda i: run[i]["step"])
    timeline = {r: by_pp[r][(timed.start or 0) + best] for r in range(pp)}
    memory = {}
    for r in range(pp):
        per = [b for bs in mem[r]["saved_per_forward"].values() for b in bs]
        unit = statistics.median(per) if per else 0
        memory[r] = {"inflight": mem[r]["inflight_peak"], "expected": expected_inflight(schedule, pp, m, r),
                     "saved_peak": mem[r]["saved_peak"], "per_unit": unit,
                     "per_unit_by_stage": {s: statistics.median(bs) for s, bs in mem[r]["saved_per_forward"].items()},
                     "peak_in_units": mem[r]["saved_peak"] / unit if unit else float("nan")}
    spans = [x["end"] - x["start"] for r in range(pp) for st in by_pp[r][timed] for x in st["spans"]]
    lat = [h for s in run for h in s["handoff"]]
    med = {k: _median([s[k] for s in run]) for k in ("step", "ideal", "model", "floor", "bubble", "imbalance",
                                                      "span_stretch")}
    return {
        "label": label, "schedule": schedule, "pp": pp, "m": m, "v": v,
        "step_s": med["step"], "ideal_s": med["ideal"], "model_s": med["model"], "floor_s": med["floor"],
        "bubble": med["bubble"], "formula": bubble_formula(schedule, p=pp, m=m), "imbalance": med["imbalance"],
        "step_vs_model": _median([s["step"] / s["model"] for s in run]),
        "step_vs_floor": _median([s["step"] / s["floor"] for s in run]),
        # the least disturbed step: other processes on the machine only ever add time to a step, and the work
        # (CPU in spans) is the same every step, so the shortest step is the schedule's own
        "best_step_s": min(s["step"] for s in run), "best_bubble": min(s["bubble"] for s in run),
        "best_vs_model": min(s["step"] / s["model"] for s in run),
        "best_vs_floor": min(s["step"] / s["floor"] for s in run),
        "span_stretch": med["span_stretch"], "best_stretch": run[best]["span_stretch"],
        "cpu_total_s": _median([sum(s["cpu"].values()) for s in run]),
        "idle": run[best]["idle"],  # the best step's: the others' spans are stretched by other processes
        "idle_median": {r: _median([s["idle"][r] for s in run]) for r in range(pp)},
        "idle_formula": (pp - 1) / (v * m + pp - 1),
        "busy_s": {r: _median([s["busy"][r] for s in run]) for r in range(pp)},
        "cpu_s": {r: _median([s["cpu"][r] for s in run]) for r in range(pp)},
        "other_cpu_s": {r: _median([s["other_cpu"][r] for s in run]) for r in range(pp)},
        "span_ms": _median(spans) * 1e3, "handoff_ms": _median(lat) * 1e3, "handoffs": len(lat),
        "steps": [s["step"] for s in steps], "losses": sorted({round(s["loss"], 6) for s in steps}),
        "memory": memory, "timeline": {r: {"start": x["start"], "end": x["end"], "spans": x["spans"]}
                                      for r, x in timeline.items()},
    }


def render_timeline(t: dict, width: int = 96) -> list[str]:
    """One line per pipeline rank: a forward of micro-batch i as the digit i, its backward as the letter
    ``a`` + i, idle as '·', over the step's global window."""
    t0 = min(x["start"] for x in t.values())
    t1 = max(x["end"] for x in t.values())
    scale = width / (t1 - t0)
    lines = []
    for r in sorted(t, key=int):
        row = ["·"] * width
        for s in t[r]["spans"]:
            ch = str(s["mb"] % 10) if s["kind"] == "F" else chr(ord("a") + s["mb"] % 26)
            a, b = int((s["start"] - t0) * scale), max(int((s["start"] - t0) * scale) + 1, int((s["end"] - t0) * scale))
            for k in range(a, min(b, width)):
                row[k] = ch
        lines.append(f"rank {r} |{''.join(row)}|")
    return lines


def _excerpt(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run_pp(pp: int, configs: list[list], opts: dict, console) -> tuple[dict[int, dict] | None, dict[str, str]]:
    """The sweep of ``configs`` at ``pp``; on a failed launch, each configuration alone (one step) to find the
    failing ones, recorded with their tracebacks, and the sweep again without them."""
    from ranks import launch

    failures: dict[str, str] = {}

    def attempt(cfgs: list[list], o: dict) -> tuple[dict | None, str]:
        for f in Path(o["dumps"]).glob(f"pp{pp}_rank*.txt"):
            f.unlink()
        try:
            return launch(sweep, pp, pp, cfgs, o), ""
        except Exception as e:  # noqa: BLE001  a failed child: its traceback and the watchdog's dumps
            dumps = "\n".join(f"[{f.name}]\n{_excerpt(f.read_text(), 40)}"
                              for f in sorted(Path(o["dumps"]).glob(f"pp{pp}_rank*.txt")) if "Thread" in f.read_text())
            return None, _excerpt(str(e), 40) + ("\n" + dumps if dumps else "")

    ranks, err = attempt(configs, opts)
    if ranks is not None:
        return ranks, failures
    console.print(f"[red]pp {pp}: the launch failed[/]; trying each configuration alone\n{err}")
    ok = []
    for cfg in configs:
        ranks, err = attempt([cfg], {**opts, "steps": 1, "warmup": 0})
        if ranks is None:
            failures[_label(*cfg)] = err
            console.print(f"  [red]{_label(*cfg)} failed[/]")
        else:
            ok.append(cfg)
    if not ok:
        return None, failures
    ranks, err = attempt(ok, opts)
    if ranks is None:
        failures["sweep of the rest"] = err
    return ranks, failures


def _source_version() -> dict:
    """The commit, and a digest of the package's sources as they are on disk (others may edit them meanwhile)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = ""
    digest = hashlib.sha1()
    for path in sorted([*ROOT.glob("autotp/**/*.py"), *ROOT.glob("passes/**/*.py")]):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return {"commit": commit, "sources": digest.hexdigest()[:12]}


# -- the report ---------------------------------------------------------------------------------------------

def _sched(r: dict) -> str:
    return f"{r['schedule']} (v {r['v']})" if r["v"] > 1 else r["schedule"]


def _per_rank(values: dict, fmt: str, sep: str = " / ") -> str:
    return sep.join(format(values[k], fmt) for k in sorted(values, key=int))


def _find(rows: list[dict], pp: int, schedule: str, m: int) -> dict | None:
    return next((r for r in rows if r["pp"] == pp and r["schedule"] == schedule and r["m"] == m), None)


def _notes(res: dict) -> list[str]:
    """What the run shows, its numbers filled in from the results (the reasoning is the same every run)."""
    rows, o = res["rows"], res["options"]
    if not rows:
        return ["- No configuration ran."]
    out = []
    wrong = [f"{r['label']} pp {r['pp']} rank {k}: {x['inflight']} (expected {x['expected']})"
             for r in rows for k, x in r["memory"].items() if x["inflight"] != x["expected"]]
    out.append("- Micro-batches in flight: " + ("as expected on every rank of every configuration (GPipe m; 1F1B "
                                                "p − r; Interleaved1F1B torch's warm-up + 1)." if not wrong else
                                                "differ from the expectation: " + "; ".join(wrong) + "."))
    off = max((abs(x["peak_in_units"] - x["inflight"]) for r in rows if r["v"] == 1 for x in r["memory"].values()),
              default=float("nan"))
    out.append(f"- Saved bytes follow the count: for GPipe and 1F1B, saved peak / one micro-batch's saved bytes "
               f"equals the in-flight count to within {off:.3f} on every rank (a micro-batch's saved tensors are "
               "freed by its backward, nothing else accumulates). For Interleaved1F1B it is not a whole number on "
               "the last rank, whose two stages differ in size (the second holds the LM head and the loss).")
    for pp in o["pp"]:
        g = [_find(rows, pp, "GPipe", m) for m in o["microbatches"]]
        f = [_find(rows, pp, "1F1B", m) for m in o["microbatches"]]
        g, f = [r for r in g if r], [r for r in f if r]
        if g and f:
            out.append(f"- pp {pp}, rank 0's saved peak: GPipe " + ", ".join(
                f"m {r['m']} {r['memory'][0]['saved_peak'] / MiB:.1f} MiB" for r in g)
                + " (the whole batch's activations of its layers, whatever m); 1F1B " + ", ".join(
                f"m {r['m']} {r['memory'][0]['saved_peak'] / MiB:.1f} MiB" for r in f)
                + " (p − r micro-batches, each 1/m of the batch: it falls as 1/m once m ≥ p).")
        big = max(o["microbatches"])
        i, f1 = _find(rows, pp, "Interleaved1F1B", big), _find(rows, pp, "1F1B", big)
        if i and f1:
            ratios = [i["memory"][k]["saved_peak"] / f1["memory"][k]["saved_peak"] for k in i["memory"]]
            held = {name: _per_rank({k: x["inflight"] for k, x in row["memory"].items()}, "d", ", ")
                    for name, row in (("i", i), ("f", f1))}
            out.append(f"- pp {pp}, m {big}: Interleaved1F1B holds {held['i']} units of half a rank's layers "
                       f"against 1F1B's {held['f']} whole ones: {min(ratios):.2f}–{max(ratios):.2f}× 1F1B's saved "
                       "peak per rank. Its smaller "
                       "bubble is paid for in activation memory (its warm-up runs (v − 1)·p + 2·(p − 1 − r) "
                       "forwards before the first backward).")
    for pp in o["pp"]:
        got = [r for r in rows if r["pp"] == pp]
        if not got:
            continue
        imb = [r["imbalance"] for r in got]
        hand = [r["handoff_ms"] for r in got]
        span = [r["span_ms"] for r in got]
        stretch = [r["span_stretch"] for r in got]
        bs = [r["best_stretch"] for r in got]
        out.append(
            f"- pp {pp}: the formula assumes equal stages and free hand-offs. The stages are not equal: the slowest "
            f"rank's CPU is {min(imb):.2f}–{max(imb):.2f}× the mean (the last stage carries ln_f, the LM head "
            "and the loss; autotp balances whole blocks by FLOPs), so even a perfect schedule exceeds the "
            "formula, by more the smaller the formula's bubble (large m); 'formula, measured stages' puts each "
            "rank's own CPU time in it. Hand-offs cost "
            f"{min(hand):.2f}–{max(hand):.2f} ms (median per configuration, from a span's end to the waiting "
            f"consumer's start) against spans of {min(span):.0f}–{max(span):.0f} ms: compute-dominated.")
        if pp <= res["cores"]:
            bv = [r["best_vs_model"] for r in got]
            out.append(
                f"  The best step is {min(bv):.2f}–{max(bv):.2f}× the formula with measured stages; the rest is "
                "the schedule's CPU outside the spans ('other CPU'), the hand-offs on the critical path, and what "
                f"other processes took even in the best step (its spans ran {min(bs):.2f}–{max(bs):.2f}× their "
                f"CPU time). Over all timed steps the spans ran {min(stretch):.2f}–{max(stretch):.2f}× their CPU "
                "time (median per configuration) although each rank had a core: other processes on this shared "
                "machine took the cores at times, which is why the median steps lie above the best ones.")
        else:
            bf = [r["best_vs_floor"] for r in got]
            out.append(
                f"  pp {pp} runs {pp} ranks on {res['cores']} cores: whenever more than {res['cores']} ranks compute "
                f"they share a core (spans {min(stretch):.2f}–{max(stretch):.2f}× longer in wall than CPU time), "
                f"and no step can be shorter than Σ CPU / {res['cores']}, which alone is a bubble of "
                f"{pp / res['cores'] - 1:.2f} over the one-core-per-rank ideal. The pp {pp} bubbles are therefore "
                "inflated by core sharing, while the idle fractions count a rank waiting for a core as busy. "
                f"The best step is {min(bf):.2f}–{max(bf):.2f}× the floor (the larger of the "
                f"formula with measured stages and Σ CPU / {res['cores']}). Compare within pp {pp} as ratios.")
        bubbles = [f"{_sched(r)} m {r['m']} {r['best_bubble']:.3f} (formula {r['formula']:.3f})" for r in got]
        out.append(f"  Best-step bubble: {', '.join(bubbles)}.")
        pairs = [(f, g) for f in got if f["schedule"] == "1F1B"
                 for g in got if g["schedule"] == "GPipe" and g["m"] == f["m"]]
        if pairs:
            out.append("  GPipe and 1F1B share a formula, and their best steps agree (1F1B / GPipe: " + ", ".join(
                f"m {f['m']} {f['best_step_s'] / g['best_step_s']:.2f}" for f, g in pairs)
                + "): 1F1B's gain is memory, not time.")
        pairs = [(i, f) for i in got if i["schedule"] == "Interleaved1F1B"
                 for f in got if f["schedule"] == "1F1B" and f["m"] == i["m"]]
        if pairs:
            out.append("  Interleaved1F1B / 1F1B best step: " + ", ".join(
                f"m {i['m']} {i['best_step_s'] / f['best_step_s']:.2f} (formula "
                f"{(1 + i['formula']) / (1 + f['formula']):.2f})" for i, f in pairs)
                + f"; it sends {V}× as many activations and gradients, in pieces half as large"
                + (f". With the {res['cores']} cores the bound, the formula's gain cannot show." if pp > res["cores"]
                   else "."))
        g = sorted((r for r in got if r["schedule"] == "GPipe"), key=lambda r: r["m"])
        if len(g) > 1:
            out.append(
                f"  More micro-batches shrink the bubble, but each computes less efficiently (smaller matrix "
                f"products, per-call overhead): GPipe's ideal grows from {g[0]['ideal_s']:.3f} s at m {g[0]['m']} "
                f"to {g[-1]['ideal_s']:.3f} s at m {g[-1]['m']} (+{g[-1]['ideal_s'] / g[0]['ideal_s'] - 1:.0%}), "
                "so its best step goes " + " → ".join(f"{r['best_step_s']:.3f}" for r in g) + " s.")
    small = [r["best_step_s"] for r in rows if r["pp"] <= res["cores"]]
    big = [r["best_step_s"] for r in rows if r["pp"] > res["cores"]]
    if small and big:
        out.append(f"- On {res['cores']} cores, the best steps with more ranks than cores ({min(big):.3f}–"
                   f"{max(big):.3f} s) are barely shorter than with a core per rank ({min(small):.3f}–"
                   f"{max(small):.3f} s): the cores, not the pipeline, bound them. The single-rank reference "
                   "(below) is the unpipelined model on one core.")
    return out


def _markdown(res: dict) -> str:
    o, rows = res["options"], res["rows"]
    lines = [
        "# Pipeline parallelism: bubble and activation memory of GPipe, 1F1B and Interleaved1F1B",
        "",
        f"nanoGPT {res['model']}: {res['params'] / 1e6:.1f}M parameters; one batch of {BATCH}×{SEQ} tokens cut into "
        f"m micro-batches; fp32; tp 1, dp 1; gloo ranks (torch's elastic launcher, tests/support/ranks.py) with one "
        f"intra-op thread each on {res['cores']} cores, so pp 4's ranks share them. A step: `Pipeline.step` "
        "(forward + backward of the batch through the schedule), gradients dropped, no optimizer. Each pp in one "
        f"launch, its configurations stepped in turns: {o['warmup']} warm-up rounds, {o['steps']} timed rounds, one "
        "more round for memory. Spans: every stage's `forward_one_chunk` / `backward_one_chunk` (the schedules call "
        "them after the receives and send afterwards) with wall and thread-CPU stamps.",
        "",
        "- step: first rank's start to last rank's end of `Pipeline.step`; median, and best (shortest) of the timed "
        "rounds",
        "- ideal = Σ_r CPU time of rank r's spans / p; bubble = (step − ideal) / ideal, against (p − 1)/m "
        "(GPipe, 1F1B) and (p − 1)/(v·m) (Interleaved1F1B, v = 2)",
        "- idle_r = 1 − wall time of rank r's spans / step, in the best step, against (p − 1)/(m + p − 1) "
        "(interleaved: v·m for m)",
        f"- the machine is shared (load average {res['load'][0]:.1f} when the run began, {res['load'][1]:.1f} at its "
        "end): the medians include steps slowed by other processes; the best step and the CPU-time ideal do not",
        "",
        "## Step time and bubble",
        "",
        "| pp | schedule | m | step s (median) | best step s | ideal s | bubble (median) | bubble (best) | formula | "
        "best / formula | idle per rank | idle formula |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['pp']} | {_sched(r)} | {r['m']} | {r['step_s']:.3f} | {r['best_step_s']:.3f} | {r['ideal_s']:.3f} "
            f"| {r['bubble']:.3f} | {r['best_bubble']:.3f} | {r['formula']:.3f} "
            f"| {r['best_bubble'] / r['formula']:.2f} "
            f"| {_per_rank(r['idle'], '.2f')} | {r['idle_formula']:.2f} |")
    for label, why in res["refused"].items():
        pp, sched, m = label.split()
        lines.append(f"| {pp} | {sched} | {m[1:]} | refused: {why.splitlines()[0]} |" + " |" * 8)
    lines += [
        "",
        "## Where the step goes beyond the formula",
        "",
        "imbalance: the slowest rank's span CPU / the mean. formula, measured stages: "
        "slowest + (Σ − slowest)/(v·m) "
        "of the ranks' span CPU (equal stages give ideal · (1 + formula)). floor: that, or Σ CPU / cores if larger "
        "(no more ranks compute at once than there are cores). span wall / CPU: > 1 when a computing rank was "
        "descheduled. other CPU: the rank's CPU (all its threads) in the step outside its spans (schedule, gloo, "
        "loss). hand-off: a waiting consumer's span start − its producer's span end (median); span: median span.",
        "",
        "| pp | schedule | m | imbalance | formula, measured stages s | median step / it | best step / it | floor s | "
        "best step / floor | span wall / CPU | other CPU ms per rank | hand-off ms | span ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['pp']} | {_sched(r)} | {r['m']} | {r['imbalance']:.2f} | {r['model_s']:.3f} | "
            f"{r['step_vs_model']:.2f} | {r['best_vs_model']:.2f} | {r['floor_s']:.3f} | {r['best_vs_floor']:.2f} | "
            f"{r['span_stretch']:.2f} | {_per_rank({k: v * 1e3 for k, v in r['other_cpu_s'].items()}, '.0f')} | "
            f"{r['handoff_ms']:.2f} | {r['span_ms']:.1f} |")
    lines += [""]
    if res["failures"]:
        lines += ["## Failures", ""]
        for label, err in res["failures"].items():
            lines += [f"{label}:", "", "```", err, "```", ""]
    lines += [
        "## Activation memory per pipeline rank",
        "",
        "in flight: the most units whose forward has run and backward not yet on the rank, a unit being one "
        f"micro-batch through one stage (for Interleaved1F1B one of the rank's {V} stages: half its layers); "
        "expected: GPipe m, 1F1B min(m, p − r), Interleaved1F1B min(v·m, w + 1) with torch's warm-up "
        "w = (v − 1)·m/k + 2·(p − 1 − r), k = max(1, m // p). saved peak: the most bytes saved for backward "
        "alive "
        "at once (each storage once, parameters left out). unit: the median bytes one stage forward saves.",
        "",
        "| pp | schedule | m | in flight per rank: measured (expected) | saved peak MiB per rank | unit MiB | "
        "peak / unit |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem = r["memory"]
        lines.append(
            f"| {r['pp']} | {_sched(r)} | {r['m']} | "
            + ", ".join(f"{mem[k]['inflight']} ({mem[k]['expected']})" for k in sorted(mem, key=int)) + " | "
            + _per_rank({k: x["saved_peak"] / MiB for k, x in mem.items()}, ".1f") + " | "
            + _per_rank({k: x["per_unit"] / MiB for k, x in mem.items()}, ".2f") + " | "
            + _per_rank({k: x["peak_in_units"] for k, x in mem.items()}, ".2f") + " |")
    lines += ["", "## Timelines (the best step)", "",
              "A forward of micro-batch i is the digit i, its backward the letter a + i (a: micro-batch 0), · idle; "
              "one line per pipeline rank, over the step's window (Interleaved1F1B: both of a rank's stages on its "
              "line).", ""]
    for r in rows:
        if r["m"] == max(o["microbatches"]):
            lines += [f"pp {r['pp']}, {_sched(r)}, m {r['m']}: step {r['best_step_s']:.3f} s", "", "```",
                      *render_timeline(r["timeline"]), "```", ""]
    agree = ("the same in every configuration and step, and equal to the unpipelined model's" if res["losses_agree"]
             else f"NOT all equal to the unpipelined model's: {res['losses']}")
    lines += [
        "## What the numbers show", "", *res["notes"], "",
        f"Loss: {agree} ({res['reference_loss']:.5f}). Single-rank reference (the unpipelined model, whole batch, "
        "on pipeline rank 0 while the others wait), median: "
        + ", ".join(f"{v:.3f} s in the pp {k} launch" for k, v in res["reference_s"].items())
        + "; build (capture, plan, split) per configuration, median: "
        + ", ".join(f"{v:.1f} s at pp {k}" for k, v in res["build_s"].items()) + ".",
        "",
        f"autotp: HEAD {res['source']['commit'][:12]} when the run began, sources digest {res['source']['sources']}"
        + (" (the sources changed during the run)." if res["source_changed"] else " (unchanged during the run)."),
        "",
        "Reproduce: `python benchmarks/pipeline.py" + "".join(
            f" --{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in o.items() if k in DEFAULTS and v != DEFAULTS[k])
        + f"` (this run: {res['wall_s']:.0f} s).",
    ]
    return "\n".join(lines) + "\n"


def _table(res: dict):
    from rich.table import Table

    table = Table(title="pipeline bubble (best step) and activation memory")
    for col in ("pp", "schedule", "m", "step s", "best s", "ideal s", "bubble", "formula", "best/formula",
                "best/measured-stage formula", "idle per rank", "in flight (expected)", "saved peak MiB"):
        table.add_column(col, justify="right")
    for r in res["rows"]:
        mem = r["memory"]
        name = r["schedule"] + (f" v{r['v']}" if r["v"] > 1 else "")
        table.add_row(str(r["pp"]), name, str(r["m"]), f"{r['step_s']:.3f}", f"{r['best_step_s']:.3f}",
                      f"{r['ideal_s']:.3f}", f"{r['best_bubble']:.3f}", f"{r['formula']:.3f}",
                      f"{r['best_bubble'] / r['formula']:.2f}", f"{r['best_vs_model']:.2f}",
                      _per_rank(r["idle"], ".2f", " "),
                      " ".join(f"{mem[k]['inflight']}({mem[k]['expected']})" for k in sorted(mem, key=int)),
                      _per_rank({k: x["saved_peak"] / MiB for k, x in mem.items()}, ".1f", " "))
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    ap.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    ap.add_argument("--pp", type=int, nargs="+", default=DEFAULTS["pp"])
    ap.add_argument("--microbatches", type=int, nargs="+", default=DEFAULTS["microbatches"])
    ap.add_argument("--schedules", nargs="+", choices=DEFAULTS["schedules"], default=DEFAULTS["schedules"])
    ap.add_argument("--timeout", type=int, default=DEFAULTS["timeout"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--render", metavar="JSON", help="only write the report again from a results file")
    a = ap.parse_args()
    if a.steps < 1:
        ap.error("need --steps >= 1")
    opts = {"steps": a.steps, "warmup": a.warmup, "pp": a.pp, "microbatches": a.microbatches,
            "schedules": a.schedules, "timeout": a.timeout}

    from rich.console import Console

    console = Console(width=200)
    out = Path(a.out)
    if a.render:
        res = json.loads(Path(a.render).read_text())
        res["notes"] = _notes(_int_keys(res))
    else:
        res = measure(opts, console)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline.json").write_text(json.dumps(res, indent=1))
    (out / "pipeline.md").write_text(_markdown(res))
    console.print(_table(res))
    for label, why in res["refused"].items():
        console.print(f"[yellow]refused[/] pp {label}: {why}")
    for label, err in res["failures"].items():
        console.print(f"[red]failed[/] {label}:\n{err}")
    console.print(f"wrote {out / 'pipeline.md'} and {out / 'pipeline.json'} ({res['wall_s']:.0f} s)")


def _int_keys(res: dict) -> dict:
    """Per-rank dicts of a results file read back: JSON made their rank keys strings."""
    for r in res["rows"]:
        for k in ("idle", "idle_median", "busy_s", "cpu_s", "other_cpu_s", "memory", "timeline"):
            r[k] = {int(x): v for x, v in r.get(k, {}).items()}
    return res


def measure(opts: dict, console) -> dict:
    """Every pp's sweep, analysed."""
    start = time.perf_counter()
    load = os.getloadavg()[0]
    source = _source_version()
    cores = len(os.sched_getaffinity(0))
    rows, refused, failures, reference_s, build_s = [], {}, {}, {}, {}
    ref_losses: set[float] = set()
    losses: set[float] = set()
    params = 0
    with tempfile.TemporaryDirectory() as dumps:
        for pp in opts["pp"]:
            configs = [[s, m] for s in opts["schedules"] for m in opts["microbatches"]]
            console.print(f"[bold]pp {pp}[/]: {len(configs)} configurations, {pp} ranks …")
            t = time.perf_counter()
            ranks, fails = _run_pp(pp, configs, {**opts, "dumps": dumps}, console)
            failures.update({f"pp {pp} {k}": v for k, v in fails.items()})
            console.print(f"  {time.perf_counter() - t:.0f} s")
            if ranks is None:
                continue
            r0 = next(r for r in ranks.values() if r["pp_rank"] == 0)
            params = r0["params"]
            refused.update({f"{pp} {k}": v for k, v in r0["refused"].items()})
            reference_s[str(pp)] = _median([x["end"] - x["start"] for x in r0["reference"][opts["warmup"]:]])
            ref_losses.update(round(x["loss"], 5) for x in r0["reference"])
            build_s[str(pp)] = _median(list(r0["build_s"].values()))
            timed = slice(opts["warmup"], opts["warmup"] + opts["steps"])
            for schedule, m in configs:
                if _label(schedule, m) in r0["records"]:
                    row = analyse(pp, schedule, m, ranks, timed, cores)
                    row["info"] = r0["info"][_label(schedule, m)]
                    losses.update(round(x, 5) for x in row["losses"])
                    rows.append(row)
    res = {"options": opts, "model": CONFIG, "batch": [BATCH, SEQ], "params": params, "cores": cores,
           "rows": rows, "refused": refused, "failures": failures, "reference_s": reference_s, "build_s": build_s,
           "reference_loss": min(ref_losses) if ref_losses else float("nan"), "losses": sorted(losses),
           "losses_agree": len(ref_losses) == 1 and losses <= ref_losses,
           "load": [load, os.getloadavg()[0]], "wall_s": time.perf_counter() - start, "source": source,
           "source_changed": _source_version()["sources"] != source["sources"]}
    res["notes"] = _notes(res)
    return res


if __name__ == "__main__":
    main()
