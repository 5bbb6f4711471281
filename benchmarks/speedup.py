"""Benchmark (not a test): does tensor parallelism pay off? autotp's step time against the unsharded model's.

    python benchmarks/speedup.py [--tp 2] [--steps 20] [--warmup 3] [--compile] [--reorder] [--sequence-parallel]
                                 [--out benchmarks/results]

Model: the example nanoGPT (4 layers, dim 256, 8 heads, vocab 8192, loss inside the model), batch 4 × 128,
SGD. ``--tp`` gloo ranks on this machine, one intra-op thread each; every rank runs the unsharded model and
autotp's, step by step interleaved (a barrier before each step), so both see the same machine load.

Reported (rank 0; medians over ``--steps``):
- speedup = unsharded step / autotp step, eager; with ``--compile`` also both compiled (the compiled
  unsharded model is the compiled variant's baseline; ``compile=True`` compiles with Inductor's
  compute/communication reordering), with ``--reorder`` also autotp compiled without that reordering, and
  with ``--sequence-parallel`` autotp with sequence parallelism;
- the limit: unsharded step / tp (each rank's share of the compute) + the step's own collectives timed
  alone in the same run (same kinds and sizes, back to back): the best a step without overlap can do;
- a breakdown of one autotp step: time blocked in collectives (inside the collective calls and their
  waits, timed in one forward + backward under a dispatch mode), and everything else (the median step
  minus that: compute and framework overhead).

Writes ``OUT/speedup.json`` and ``OUT/speedup.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import unittest.mock
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests")]

CONFIG = dict(n_layer=4, n_embd=256, n_head=8, vocab_size=8192, block_size=128, dropout=0.0)
BATCH, SEQ = 4, 128


class _Blocked:
    """Wall time spent blocked in collectives during one step: functional collectives and their waits (a
    dispatch mode sees them), and plain c10d all-reduces, timed around the call and, for async ones,
    around ``wait()`` (c10d waits are not dispatcher ops)."""

    def __init__(self):
        self.seconds, self.calls = 0.0, []

    def __enter__(self):
        import torch.distributed as dist
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self
        self._dist, self._orig = dist, dist.all_reduce

        class Timed:
            def __init__(self, work):
                self.work = work

            def wait(self, *a):
                t0 = time.perf_counter()
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


def worker(opts: dict) -> dict:
    import copy

    import torch
    import torch.distributed as dist

    import autotp
    from nanogpt import GPT, GPTConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = GPT(GPTConfig(**CONFIG))
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    tgt = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    models = {"unsharded": copy.deepcopy(base),
              "autotp": autotp.parallelize(copy.deepcopy(base), example_inputs=(idx, tgt))}
    if opts["compile"]:
        models["unsharded_compiled"] = torch.compile(copy.deepcopy(base))
        models["autotp_compiled"] = autotp.parallelize(copy.deepcopy(base), example_inputs=(idx, tgt), compile=True)
    if opts["reorder"]:  # compile=True without Inductor's compute/communication reordering, for comparison
        from autotp.runtime import compile as compile_mod

        with unittest.mock.patch.dict(compile_mod.INDUCTOR_CONFIG, {"reorder_for_compute_comm_overlap": False}):
            models["autotp_compiled_no_reorder"] = autotp.parallelize(copy.deepcopy(base), example_inputs=(idx, tgt),
                                                                      compile=True)
    if opts.get("sequence_parallel"):
        models["autotp_sp"] = autotp.parallelize(copy.deepcopy(base), example_inputs=(idx, tgt),
                                                 sequence_parallel=True)
    opt = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}

    def step(name: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        _, loss = models[name](idx, tgt)
        loss.backward()
        opt[name].step()
        opt[name].zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for _ in range(opts["warmup"]):
        for name in models:
            step(name)
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(opts["steps"]):
        for name in models:
            times[name].append(step(name))
    # one autotp step with its collectives timed
    blocked = _Blocked()
    dist.barrier()
    t0 = time.perf_counter()
    with blocked:
        _, loss = models["autotp"](idx, tgt)
        loss.backward()
    observed = time.perf_counter() - t0
    # the same collectives alone, back to back: what the step's communication costs on this machine
    group = autotp.tp_state(models["autotp"]).group
    bufs = [torch.randn(n) for _, n in blocked.calls]
    comm = []
    for _ in range(max(5, opts["steps"] // 2)):
        dist.barrier()
        t0 = time.perf_counter()
        for b in bufs:
            dist.all_reduce(b, group=group)
        comm.append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "rank": dist.get_rank(), "tp": dist.get_world_size(), "median_s": med,
        "fastest_s": {k: min(v) for k, v in times.items()},
        "collectives": len(blocked.calls), "elements": sum(n for _, n in blocked.calls),
        "blocked_s": blocked.seconds, "observed_fwd_bwd_s": observed, "comm_alone_s": statistics.median(comm),
    }


def _markdown(r: dict, opts: dict) -> str:
    med, tp = r["median_s"], r["tp"]
    limit = med["unsharded"] / tp + r["comm_alone_s"]
    rows = [
        f"# autotp speedup over the unsharded model (tp {tp}, gloo on CPU, one thread per rank)", "",
        f"nanoGPT {CONFIG}, batch {BATCH}×{SEQ}, SGD; median of {opts['steps']} interleaved steps after "
        f"{opts['warmup']} warm-up; rank 0.", "",
        "| variant | step ms (median) | fastest ms | speedup vs unsharded (compiled vs compiled) | of the eager limit |",
        "|---|---|---|---|---|",
    ]
    for k, v in med.items():
        base = med["unsharded_compiled"] if "compiled" in k and "unsharded_compiled" in med else med["unsharded"]
        rows.append(f"| {k} | {v * 1e3:.1f} | {r['fastest_s'][k] * 1e3:.1f} | {base / v:.2f}× | "
                    f"{limit / v:.0%} |")
    rows += [
        "", f"Limit without overlap: unsharded / tp + the step's collectives alone = "
            f"{med['unsharded'] / tp * 1e3:.1f} + {r['comm_alone_s'] * 1e3:.1f} = {limit * 1e3:.1f} ms "
            f"(speedup {med['unsharded'] / limit:.2f}×).",
        "", "One autotp forward + backward, broken down:", "",
        "| part | ms |", "|---|---|",
        f"| blocked in collectives ({r['collectives']} calls, {r['elements']:,} elements) | {r['blocked_s'] * 1e3:.1f} |",
        f"| everything else (compute, framework): median step − blocked | "
        f"{(med['autotp'] - r['blocked_s']) * 1e3:.1f} |",
        f"| the same collectives alone | {r['comm_alone_s'] * 1e3:.1f} |",
    ]
    return "\n".join(rows) + "\n"


def main() -> None:
    from distributed import launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--reorder", action="store_true")
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    opts = {"steps": a.steps, "warmup": a.warmup, "compile": a.compile or a.reorder, "reorder": a.reorder,
            "sequence_parallel": a.sequence_parallel}
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
