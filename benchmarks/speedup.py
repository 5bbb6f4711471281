"""Benchmark (not a test): does tensor parallelism pay off? autotp's step time against the unsharded model's.

    python benchmarks/speedup.py [--tp 2] [--steps 20] [--warmup 3] [--compile] [--reorder] [--block]
                                 [--sequence-parallel] [--no-bind-cores] [--out benchmarks/results]

Model: the example nanoGPT (4 layers, dim 256, 8 heads, vocab 8192, loss inside the model), batch 4 × 128,
SGD. ``--tp`` gloo ranks on this machine, one intra-op thread each, each bound to cores of its own as
``autotp shard`` binds CPU ranks (``--no-bind-cores``: unbound); every rank runs the unsharded model and
autotp's, step by step interleaved (a barrier before each step, the order reversed every other round), so
both see the same machine load.

Reported (rank 0; medians over ``--steps``):
- speedup = unsharded step / autotp step, eager; with ``--compile`` also both compiled (the compiled
  unsharded model is the compiled variant's baseline; ``compile=True`` compiles with Inductor's
  compute/communication reordering), with ``--reorder`` also autotp compiled without that reordering,
  with ``--block`` also eager autotp whose waits sleep until gloo wakes them (the runtime polls), and
  with ``--sequence-parallel`` autotp with sequence parallelism;
- the limit: unsharded step / tp (each rank's share of the compute) + the step's own collectives timed
  alone (same kinds and sizes, back to back, waited for as the runtime waits, once in every round): the
  best a step without overlap can do;
- a breakdown of the autotp step: its compute and framework time alone (the same step with every
  collective skipped), the communication left exposed (the step minus that), and the time blocked in
  collectives (from each call to its completion, waiting for the other ranks included; medians over
  several steps).

Writes ``OUT/speedup.json`` and ``OUT/speedup.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import unittest.mock
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests" / "support")]

COMM = "collectives_alone"
CONFIG = dict(n_layer=4, n_embd=256, n_head=8, vocab_size=8192, block_size=128, dropout=0.0)
BATCH, SEQ = 4, 128


class _Blocked:
    """Wall time spent blocked in collectives during one step: functional collectives and their waits (a
    dispatch mode sees them), and plain c10d all-reduces, timed around the call and, for async ones,
    from the first poll or ``wait()`` to completion (c10d waits are not dispatcher ops)."""

    def __init__(self):
        self.seconds, self.calls = 0.0, []

    def __enter__(self):
        import torch.distributed as dist
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self
        self._dist, self._orig = dist, dist.all_reduce

        class Timed:  # an async work: blocked from the first poll or wait until it is done
            def __init__(self, work):
                self.work, self.t0 = work, None

            def is_completed(self):
                self.t0 = self.t0 or time.perf_counter()
                return self.work.is_completed()

            def wait(self, *a):
                t0 = self.t0 or time.perf_counter()
                r = self.work.wait(*a)
                outer.seconds += time.perf_counter() - t0
                return r

        def all_reduce(tensor, *args, **kwargs):
            outer.calls.append(("all_reduce", tensor.numel()))
            t0 = time.perf_counter()
            work = outer._orig(tensor, *args, **kwargs)
            outer.seconds += time.perf_counter() - t0
            return Timed(work) if work is not None else None

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                t0 = time.perf_counter()
                out = func(*args, **(kwargs or {}))
                if func.namespace == "_c10d_functional":
                    outer.seconds += time.perf_counter() - t0
                    if func.__name__.split(".")[0] == "all_reduce":
                        outer.calls.append(("all_reduce", args[0].numel()))
                return out

        dist.all_reduce = all_reduce
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._dist.all_reduce = self._orig


class _NoComm:
    """Collectives skipped (each returns at once, leaving its input as it is): the step's compute and framework
    time alone. The numbers are wrong; only the time is read."""

    class Done:
        def is_completed(self):
            return True

        def wait(self, *a):
            return True

    def __enter__(self):
        import torch.distributed as dist

        self._dist, self._orig = dist, dist.all_reduce
        dist.all_reduce = lambda t, *a, async_op=False, **k: self.Done() if async_op else None
        return self

    def __exit__(self, *exc):
        self._dist.all_reduce = self._orig


def worker(opts: dict) -> dict:
    import copy

    import torch
    import torch.distributed as dist

    import autotp
    from autotp.operators import collectives
    from nanogpt import GPT, GPTConfig

    torch.set_num_threads(1)
    # as `autotp shard` / `autotp run` bind CPU ranks (after init_process_group: gloo's threads included)
    cpus = autotp.bind_cpu_cores() if opts["bind_cores"] else None
    torch.manual_seed(0)
    base = GPT(GPTConfig(**CONFIG))
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    tgt = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)

    def tp(**kw):
        return autotp.parallelize(copy.deepcopy(base), example_inputs=(idx, tgt), **kw)

    models = {"unsharded": copy.deepcopy(base), "autotp": tp(), "autotp_compute_only": tp()}
    contexts = {"autotp_compute_only": _NoComm}
    if opts["block"]:  # eager, each wait sleeping until gloo wakes it instead of polling
        models["autotp_sleeping_waits"] = tp()
        contexts["autotp_sleeping_waits"] = lambda: unittest.mock.patch.object(
            collectives, "finish", lambda work, x: work.wait() if work is not None else None)
    if opts["compile"]:
        models["unsharded_compiled"] = torch.compile(copy.deepcopy(base))
        models["autotp_compiled"] = tp(compile=True)
    if opts["reorder"]:  # compile=True without Inductor's compute/communication reordering, for comparison
        from autotp.operators import compile as compile_mod

        with unittest.mock.patch.dict(compile_mod.INDUCTOR_CONFIG, {"reorder_for_compute_comm_overlap": False}):
            models["autotp_compiled_no_reorder"] = tp(compile=True)
    if opts.get("sequence_parallel"):
        models["autotp_sp"] = tp(sequence_parallel=True)
    opt = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}

    def step(name: str, blocked: _Blocked | None = None) -> float:
        dist.barrier()
        with contexts.get(name, contextlib.nullcontext)(), blocked or contextlib.nullcontext():
            t0 = time.perf_counter()
            _, loss = models[name](idx, tgt)
            loss.backward()
            opt[name].step()
            opt[name].zero_grad(set_to_none=True)
            return time.perf_counter() - t0

    for _ in range(opts["warmup"]):
        for name in models:
            step(name)
    # the step's collectives (kinds and sizes), replayed alone back to back and waited for as the runtime
    # waits, timed in every round like the variants
    b = _Blocked()
    step("autotp", b)
    calls, group = b.calls, autotp.tp_state(models["autotp"]).group
    bufs = [torch.randn(n) for _, n in calls]

    def replay() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for buf in bufs:
            collectives.finish(dist.all_reduce(buf, group=group, async_op=True), buf)
        return time.perf_counter() - t0

    names = [*models, COMM]
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(opts["steps"]):
        # every other round in reverse: the step after the unsharded one runs ~2.5 ms slower here
        for name in names[::1 if i % 2 == 0 else -1]:
            times[name].append(replay() if name == COMM else step(name))
    # autotp steps with their collectives timed: blocked = from each call (or first poll) to completion
    blocked = []
    for _ in range(max(5, opts["steps"] // 2)):
        b = _Blocked()
        step("autotp", b)
        blocked.append(b.seconds)
    comm = times.pop(COMM)
    return {
        "rank": dist.get_rank(), "tp": dist.get_world_size(), "cpus": cpus,
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "fastest_s": {k: min(v) for k, v in times.items()},
        "collectives": len(calls), "elements": sum(n for _, n in calls),
        "blocked_s": statistics.median(blocked), "comm_alone_s": statistics.median(comm),
    }


def _markdown(r: dict, opts: dict) -> str:
    med, tp = r["median_s"], r["tp"]
    limit = med["unsharded"] / tp + r["comm_alone_s"]
    rows = [
        f"# autotp speedup over the unsharded model (tp {tp}, gloo on CPU, one thread per rank)", "",
        f"nanoGPT {CONFIG}, batch {BATCH}×{SEQ}, SGD; median of {opts['steps']} interleaved steps after "
        f"{opts['warmup']} warm-up; rank 0. `autotp_compute_only`: the same step with every collective "
        f"skipped (wrong numbers, the compute's time). Ranks "
        + (f"bound to cores as `autotp shard` binds them (rank 0: cpus {r['cpus']})." if r["cpus"]
           else "not bound to cores (`--no-bind-cores`)."), "",
        "| variant | step ms (median) | fastest ms | speedup vs unsharded (compiled vs compiled) | of the eager limit |",
        "|---|---|---|---|---|",
    ]
    for k, v in med.items():
        base = med["unsharded_compiled"] if "compiled" in k and "unsharded_compiled" in med else med["unsharded"]
        rows.append(f"| {k} | {v * 1e3:.1f} | {r['fastest_s'][k] * 1e3:.1f} | {base / v:.2f}× | "
                    f"{limit / v:.0%} |")
    exposed = med["autotp"] - med["autotp_compute_only"]
    rows += [
        "", f"Limit without overlap: unsharded / tp + the step's collectives alone = "
            f"{med['unsharded'] / tp * 1e3:.1f} + {r['comm_alone_s'] * 1e3:.1f} = {limit * 1e3:.1f} ms "
            f"(speedup {med['unsharded'] / limit:.2f}×).",
        "", "One autotp step, broken down (medians):", "",
        "| part | ms |", "|---|---|",
        f"| compute and framework (`autotp_compute_only`; unsharded / tp = {med['unsharded'] / tp * 1e3:.1f}) | "
        f"{med['autotp_compute_only'] * 1e3:.1f} |",
        f"| communication not hidden (autotp − compute only) | {exposed * 1e3:.1f} |",
        f"| blocked in collectives ({r['collectives']} calls, {r['elements']:,} elements; incl. waiting for "
        f"the other rank) | {r['blocked_s'] * 1e3:.1f} |",
        f"| the same collectives alone, back to back | {r['comm_alone_s'] * 1e3:.1f} |",
    ]
    return "\n".join(rows) + "\n"


def main() -> None:
    from ranks import launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--reorder", action="store_true")
    ap.add_argument("--block", action="store_true")
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--no-bind-cores", action="store_true", help="leave the ranks unbound (autotp shard binds them)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    opts = {"steps": a.steps, "warmup": a.warmup, "compile": a.compile or a.reorder, "reorder": a.reorder,
            "block": a.block, "sequence_parallel": a.sequence_parallel, "bind_cores": not a.no_bind_cores}
    r = launch(worker, a.tp, opts)[0]
    r["load_average"] = os.getloadavg()
    md = _markdown(r, opts)
    print(md)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speedup.json").write_text(json.dumps(r, indent=2))
    (out / "speedup.md").write_text(md)


if __name__ == "__main__":
    main()
