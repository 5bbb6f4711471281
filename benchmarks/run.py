"""Benchmarks (not tests) for autotp: step time, communication, memory, planning time, compile.

    python benchmarks/run.py --out benchmarks/results [--steps 20] [--warmup 3] [--compile]

a) training-step time (forward + backward + AdamW), median over ``--steps`` after ``--warmup``, the variants
   interleaved step by step in the same 2 gloo processes (one intra-op thread each): autotp, PyTorch's
   hand-written DTensor plan (``Transformer.parallelize`` from torch's own DTensor tests) and the unsharded
   model, on torch's test Transformer (4 layers, dim 256, vocab 8192, batch 4 × 128), tp = 2 on CPU.
   On a CUDA machine the same comparison also runs with tp = 1 on the GPU (skipped, and said so, on CPU).
b) communication: collectives and elements of one autotp training step, measured with a TorchDispatchMode,
   against Megatron's formula (README, "What a step costs") (``autotp.reports.sharding``), as ratios.
c) memory: per-rank parameter + gradient + AdamW-state bytes against 16·P_sharded/t + 16·P_replicated,
   and the peak RSS of each rank (which holds all three variants).
d) capture + plan + rewrite time of a GPT-2-shaped nanoGPT (n_embd 768, 12 heads, vocab 50257) with 12, 24
   and 48 layers on the meta device, no process group; and the per-layer slope.
e) with ``--compile``: compile time (first step) and compiled/eager speedup of every variant.

Writes ``OUT/benchmarks.json`` and ``OUT/benchmarks.md``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.utils.distributed import get_free_port  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from autotp.parallel.held import held_grads, held_params, held_state  # noqa: E402

TARGETS = {"step_vs_dtensor": 0.85, "comm_count": 1.00, "comm_elements": 1.01, "memory": 1.02, "plan_48_s": 10.0}
MODEL = dict(n_layers=4, dim=256, vocab_size=8192, max_seq_len=128, n_heads=4, dropout_p=0.0)
BATCH, SEQ = 4, 128


# -- helpers run inside each rank ---------------------------------------------------------------------
class CollectiveLog(TorchDispatchMode):
    """Every all-reduce (functional or c10d) and functional collective as (op, reduce op, elements)."""

    KINDS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in self.KINDS:
            self.calls.append((name, args[1] if isinstance(args[1], str) else "", args[0].numel()))
        elif func.namespace == "c10d" and name == "allreduce_":  # eager all-reduces are plain c10d ones
            self.calls.append(("all_reduce", {0: "sum", 3: "min", 4: "max"}.get(args[2].op(), "?"), args[0][0].numel()))
        return func(*args, **(kwargs or {}))


class WithLoss(nn.Module):
    """The test Transformer returns logits; the training step's loss is part of the model autotp captures."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _transformer():
    try:
        from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer
    except ModuleNotFoundError as e:  # torch's test helpers import expecttest, which is not a torch dependency
        if e.name != "expecttest":
            raise
        import types

        sys.modules["expecttest"] = types.SimpleNamespace(TestCase=object)
        from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer
    return ModelArgs, Transformer


def _state_bytes(module: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """This rank's training state (autotp.parallel.held, as ``autotp shard``'s summary counts it): parameters and
    gradients (each DTensor its local shard, a tied tensor once) and AdamW's moments (its step counts are not
    state per parameter)."""
    params = list(module.parameters())
    p, g, s = held_params(params).bytes, held_grads(params).bytes, held_state(opt).bytes
    return {"params": p, "grads": g, "adam": s, "total": p + g + s}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def step_worker(opts: dict) -> dict:
    import autotp
    from autotp.reports.sharding import build_report
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(1)
    device = torch.device(opts["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)
    tp, rank = dist.get_world_size(), dist.get_rank()
    ModelArgs, Transformer = _transformer()
    torch.manual_seed(0)
    base = Transformer(ModelArgs(**MODEL)).to(device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=g).to(device)
    targets = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=g).to(device)

    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    variants: dict[str, nn.Module] = {
        "unsharded": WithLoss(copy.deepcopy(base)),
        "dtensor": WithLoss(Transformer.parallelize(copy.deepcopy(base), mesh, use_seq_parallel=False,
                                                    local_output_for_attn=True)),
    }
    t0 = time.perf_counter()
    variants["autotp"] = autotp.parallelize(WithLoss(copy.deepcopy(base)), example_inputs=(tokens, targets))
    parallelize_s = time.perf_counter() - t0
    tpm = variants["autotp"]
    if opts["compile"]:
        variants["autotp_compiled"] = autotp.parallelize(WithLoss(copy.deepcopy(base)), example_inputs=(tokens, targets),
                                                         compile=True)
        variants["dtensor_compiled"] = torch.compile(WithLoss(Transformer.parallelize(
            copy.deepcopy(base), mesh, use_seq_parallel=False, local_output_for_attn=True)))
        variants["unsharded_compiled"] = torch.compile(WithLoss(copy.deepcopy(base)))
    opt = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in variants.items()}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    held: dict[str, dict] = {}

    def step(name, measure: bool = False):
        loss = variants[name](tokens, targets)
        loss.backward()
        opt[name].step()
        if measure:  # parameters, gradients and AdamW state all alive: the step's resident training state
            held[name] = _state_bytes(variants[name], opt[name])
        opt[name].zero_grad(set_to_none=True)
        return loss.detach()

    out: dict = {"rank": rank, "tp": tp, "device": str(device), "parallelize_s": parallelize_s}
    # parity of the first step (same weights, same batch), and the collectives of one autotp step
    first = {}
    log = CollectiveLog()
    for name in variants:
        dist.barrier()
        sync()
        start = time.perf_counter()
        if name == "autotp":
            with log:
                first[name] = step(name, measure=True).item()
        else:
            first[name] = step(name, measure=True).item()
        sync()
        if name.endswith("_compiled"):
            out.setdefault("compile_s", {})[name] = time.perf_counter() - start
    out["first_loss"] = first
    out["loss_diff_vs_unsharded"] = {k: abs(v - first["unsharded"]) for k, v in first.items()}
    dt_log = CollectiveLog()
    with dt_log:  # what the DTensor plan moves, for comparison
        step("dtensor")
    out["dtensor_collectives"] = {"count": len(dt_log.calls), "elements": sum(c[2] for c in dt_log.calls)}

    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(opts["warmup"] + opts["steps"]):
        for name in variants:  # interleaved: every variant sees the same machine state
            dist.barrier()
            sync()
            start, cstart = time.perf_counter(), time.process_time()
            step(name)
            sync()
            if i >= opts["warmup"]:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - cstart)
    out["step_ms"] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["step_ms_all"] = {k: [round(x * 1e3, 3) for x in v] for k, v in times.items()}
    # CPU seconds of this process per step (all its threads): what the step costs, less time spent descheduled
    out["cpu_ms"] = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}

    report = build_report(autotp.tp_state(tpm).plan, WithLoss(base).named_parameters(remove_duplicate=False), BATCH, SEQ)
    f_count = sum(t.count for t in report.formula)
    f_el = sum(t.count * t.elements for t in report.formula) if all(t.elements for t in report.formula) else None
    out["comm"] = {
        "measured_count": len(log.calls), "measured_elements": sum(c[2] for c in log.calls),
        "formula_count": f_count, "formula_elements": f_el, "calls": log.calls,
        "formula": [{"direction": t.direction, "op": t.op, "what": t.what, "count": t.count, "each": t.each,
                     "elements": t.elements} for t in report.formula],
    }
    m = report.memory
    out["memory"] = {k: held[k] for k in ("autotp", "dtensor", "unsharded")}
    out["memory"]["formula_bytes"] = m.formula_bytes
    out["memory"]["ideal_all_sharded_bytes"] = m.ideal_bytes
    out["memory"]["P_sharded"], out["memory"]["P_replicated"] = m.sharded, m.replicated
    out["peak_rss_mb"] = _peak_rss_mb()
    if opts.get("profile"):  # every rank steps (the collectives need both); rank 0 reports
        import cProfile
        import io
        import pstats

        for name in ("autotp", "dtensor"):
            pr = cProfile.Profile()
            dist.barrier()
            pr.enable()
            for _ in range(5):
                step(name)
            pr.disable()
            if rank == 0:
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(20)
                out[f"profile_{name}"] = s.getvalue()
    dist.barrier()
    return out


# -- launching --------------------------------------------------------------------------------------------
def _entry(fn, backend, *args):
    sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
    dist.init_process_group(backend)
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


def launch(fn, world: int, backend: str, *args) -> dict:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{get_free_port()}", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn")
    return elastic_launch(config, _entry)(fn, backend, *args)


# -- d) planning time -------------------------------------------------------------------------------------
def plan_times(layers: list[int], tp: int = 2) -> list[dict]:
    from autotp.capture.tracer import capture
    from autotp.passes import run_passes
    from autotp.plan.planner import make_plan
    from nanogpt import GPT, GPTConfig

    rows = []
    for n in layers:
        with torch.device("meta"):
            model = GPT(GPTConfig(n_layer=n, n_embd=768, n_head=12, vocab_size=50257, block_size=1024))
        ids = torch.zeros(8, 1024, dtype=torch.long)
        t0 = time.perf_counter()
        gm = capture(model, (ids, ids), {})[0]
        t1 = time.perf_counter()
        plan = make_plan(gm, tp)
        t2 = time.perf_counter()
        run_passes(gm, plan)
        t3 = time.perf_counter()
        rows.append({"layers": n, "capture_s": t1 - t0, "plan_s": t2 - t1, "rewrite_s": t3 - t2, "total_s": t3 - t0,
                     "nodes": len(gm.graph.nodes)})
    if len(rows) > 1:
        xs, ys = [r["layers"] for r in rows], [r["total_s"] for r in rows]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        for r in rows:
            r["slope_s_per_layer"] = slope
            r["intercept_s"] = my - slope * mx
    return rows


# -- output -----------------------------------------------------------------------------------------------
def _ok(value, target, le=True) -> str:
    if value is None:
        return "n/a"
    return "✅" if (value <= target if le else value == target) else "❌"


def summarize(res: dict) -> dict:
    cpu = res["cpu_tp2"]
    r0 = cpu[0]
    worst = lambda key: max(r["step_ms"][key] for r in cpu.values())  # noqa: E731 - a step is as slow as its slowest rank
    s = {"step_ms": {k: worst(k) for k in r0["step_ms"]}}
    s["cpu_ms"] = {k: max(r["cpu_ms"][k] for r in cpu.values()) for k in r0["cpu_ms"]}
    # per step, the slowest rank; then the median over steps of autotp's step ÷ the DTensor plan's step of the
    # same iteration: paired, so load from other processes that drifts over the run cancels
    per_step = {k: [max(r["step_ms_all"][k][i] for r in cpu.values()) for i in range(len(r0["step_ms_all"][k]))]
                for k in r0["step_ms_all"]}
    s["autotp_over_dtensor"] = statistics.median(a / d for a, d in zip(per_step["autotp"], per_step["dtensor"]))
    s["autotp_over_dtensor_of_medians"] = s["step_ms"]["autotp"] / s["step_ms"]["dtensor"]
    s["autotp_over_dtensor_of_minima"] = min(per_step["autotp"]) / min(per_step["dtensor"])
    s["autotp_over_dtensor_cpu"] = s["cpu_ms"]["autotp"] / s["cpu_ms"]["dtensor"]
    s["step_ms_min"] = {k: min(v) for k, v in per_step.items()}
    s["autotp_over_unsharded"] = s["step_ms"]["autotp"] / s["step_ms"]["unsharded"]
    s["dtensor_over_unsharded"] = s["step_ms"]["dtensor"] / s["step_ms"]["unsharded"]
    c = r0["comm"]
    s["comm_count_ratio"] = c["measured_count"] / c["formula_count"]
    s["comm_elements_ratio"] = c["measured_elements"] / c["formula_elements"] if c["formula_elements"] else None
    m = r0["memory"]
    s["memory_ratio"] = max(r["memory"]["autotp"]["total"] for r in cpu.values()) / m["formula_bytes"]
    s["dtensor_memory_ratio"] = max(r["memory"]["dtensor"]["total"] for r in cpu.values()) / m["formula_bytes"]
    s["max_loss_diff_vs_unsharded"] = max(max(r["loss_diff_vs_unsharded"].values()) for r in cpu.values())
    p48 = [r for r in res["plan_times"] if r["layers"] == 48]
    s["plan_48_s"] = p48[0]["total_s"] if p48 else None
    if "compile_s" in r0:
        s["compile_s"] = {k: max(r["compile_s"][k] for r in cpu.values()) for k in r0["compile_s"]}
        s["compiled_speedup"] = {k: s["step_ms"][k] / s["step_ms"][f"{k}_compiled"]
                                 for k in ("autotp", "dtensor", "unsharded")}
    return s


def markdown(res: dict) -> str:
    s, r0 = res["summary"], res["cpu_tp2"][0]
    L = [f"# autotp benchmarks ({res['when']})", "",
         f"torch {res['torch']}, {res['machine']}, {res['cpus']} CPUs; tp 2 over gloo, one intra-op thread per "
         f"rank; model: torch's DTensor test Transformer {MODEL}, batch {BATCH}×{SEQ}; "
         f"{res['steps']} timed steps after {res['warmup']} warm-up, variants interleaved.", "",
         "| metric | value | target | ok |", "|---|---|---|---|"]
    L.append(f"| autotp step / DTensor-plan step (median of paired per-step ratios) | {s['autotp_over_dtensor']:.3f} "
             f"| ≤ {TARGETS['step_vs_dtensor']} | {_ok(s['autotp_over_dtensor'], TARGETS['step_vs_dtensor'])} |")
    for key, what in (("of_medians", "ratio of medians"), ("of_minima", "ratio of fastest steps"),
                      ("cpu", "ratio of median CPU time per step")):
        v = s[f"autotp_over_dtensor_{key}"]
        L.append(f"| autotp / DTensor plan, {what} | {v:.3f} | ≤ {TARGETS['step_vs_dtensor']} | "
                 f"{_ok(v, TARGETS['step_vs_dtensor'])} |")
    L.append(f"| collectives / step: measured ÷ formula (count) | {s['comm_count_ratio']:.3f} "
             f"({r0['comm']['measured_count']} / {r0['comm']['formula_count']}) | 1.00 | "
             f"{_ok(round(s['comm_count_ratio'], 6), 1.0, le=False)} |")
    el = s["comm_elements_ratio"]
    L.append(f"| elements / step: measured ÷ formula | {el:.4f} ({r0['comm']['measured_elements']:,} / "
             f"{r0['comm']['formula_elements']:,}) | ≤ 1.01 | {_ok(el, 1.01)} |")
    L.append(f"| param+grad+AdamW bytes / rank ÷ (16·P_sh/t + 16·P_rep) | {s['memory_ratio']:.4f} | ≤ 1.02 | "
             f"{_ok(s['memory_ratio'], 1.02)} |")
    p48 = "not run" if s["plan_48_s"] is None else f"{s['plan_48_s']:.2f} s"
    L.append(f"| capture+plan+rewrite, 48 layers | {p48} | ≤ 10 s | {_ok(s['plan_48_s'], 10.0)} |")
    L += ["", "## a) training step (median ms over steps, slowest rank; fastest step; median CPU ms)", "",
          "| variant | median ms | ÷ unsharded | ÷ DTensor plan | fastest ms | CPU ms |", "|---|---|---|---|---|---|"]
    for k, v in s["step_ms"].items():
        L.append(f"| {k} | {v:.1f} | {v / s['step_ms']['unsharded']:.3f} | {v / s['step_ms']['dtensor']:.3f} | "
                 f"{s['step_ms_min'][k]:.1f} | {s['cpu_ms'][k]:.1f} |")
    L += ["", f"Load average when the run ended: {res.get('loadavg', '?')} (2-core machine; other jobs share it, "
          "so absolute times drift; the variants are interleaved step by step and compared per step)."]
    L.append("")
    L.append("First-step loss difference vs unsharded (rank 0): " + ", ".join(
        f"{k} {v:.2e}" for k, v in r0["loss_diff_vs_unsharded"].items() if k != "unsharded")
        + f" (loss {r0['first_loss']['unsharded']:.4f}).")
    L.append("")
    L.append("GPU (tp 1): " + (res["gpu"]["note"] if "note" in res["gpu"] else
                               ", ".join(f"{k} {v:.2f} ms" for k, v in res["gpu"]["step_ms"].items())))
    L += ["", "## b) communication of one autotp training step (rank 0)", "",
          f"measured {r0['comm']['measured_count']} collectives, {r0['comm']['measured_elements']:,} elements; "
          f"formula {r0['comm']['formula_count']}, {r0['comm']['formula_elements']:,}. "
          f"The DTensor plan's step: {r0['dtensor_collectives']['count']} collectives, "
          f"{r0['dtensor_collectives']['elements']:,} elements.", "",
          "| direction | op | what | count | each |", "|---|---|---|---|---|"]
    for t in r0["comm"]["formula"]:
        L.append(f"| {t['direction']} | {t['op']} | {t['what']} | {t['count']} | {t['each']} = {t['elements']:,} |")
    L += ["", "## c) memory per rank (bytes, after optimizer.step, before zero_grad)", "", "| variant | params | grads | AdamW | total |",
          "|---|---|---|---|---|"]
    for k in ("autotp", "dtensor", "unsharded"):
        m = r0["memory"][k]
        L.append(f"| {k} | {m['params']:,} | {m['grads']:,} | {m['adam']:,} | {m['total']:,} |")
    m = r0["memory"]
    L.append(f"| formula 16·P_sharded/t + 16·P_replicated | | | | {m['formula_bytes']:,} |")
    L.append("")
    L.append(f"P_sharded {m['P_sharded']:,}, P_replicated {m['P_replicated']:,}. Peak RSS per rank (all "
             f"variants in one process): " + ", ".join(f"{r['peak_rss_mb']:.0f} MB" for r in res["cpu_tp2"].values())
             + ".")
    L += ["", "## d) capture + plan + rewrite (GPT-2-shaped nanoGPT, meta device, tp 2, 8×1024 ids)", "",
          "| layers | capture s | plan s | rewrite s | total s | graph nodes |", "|---|---|---|---|---|---|"]
    for r in res["plan_times"]:
        L.append(f"| {r['layers']} | {r['capture_s']:.2f} | {r['plan_s']:.2f} | {r['rewrite_s']:.3f} | "
                 f"{r['total_s']:.2f} | {r['nodes']} |")
    if res["plan_times"] and "slope_s_per_layer" in res["plan_times"][0]:
        r = res["plan_times"][0]
        L.append(f"\nslope {r['slope_s_per_layer'] * 1e3:.1f} ms/layer (least squares), intercept {r['intercept_s']:.2f} s.")
    L += ["", "## e) torch.compile", ""]
    if "compile_s" in s:
        L += ["The first step's time (dynamo + AOTAutograd + inductor, forward and backward) depends on inductor's "
              "on-disk caches (/tmp/torchinductor_$USER): a re-run of this script is much faster than a cold one.", "",
              "| variant | compile (first step) s | compiled ms | eager ÷ compiled |", "|---|---|---|---|"]
        for k in ("autotp", "dtensor", "unsharded"):
            L.append(f"| {k} | {s['compile_s'][k + '_compiled']:.1f} | {s['step_ms'][k + '_compiled']:.1f} | "
                     f"{s['compiled_speedup'][k]:.3f} |")
    else:
        L.append("not run (pass --compile).")
    for name in ("autotp", "dtensor"):
        if f"profile_{name}" in r0:
            text = r0[f"profile_{name}"].strip()
            text = text[text.find("ncalls"):] if "ncalls" in text else text
            L += ["", f"## cProfile of 5 {name} steps (rank 0, by tottime)", "", "```", text, "```"]
    return "\n".join(L) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd variants (slow on CPU)")
    ap.add_argument("--profile", action="store_true", help="cProfile 5 autotp steps on rank 0")
    ap.add_argument("--layers", default="12,24,48", help="layer counts for the planning-time benchmark")
    a = ap.parse_args()
    opts = {"steps": a.steps, "warmup": a.warmup, "compile": a.compile, "profile": a.profile, "device": "cpu"}
    res = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "machine": platform.platform(),
           "cpus": os.cpu_count(), "steps": a.steps, "warmup": a.warmup, "targets": TARGETS}
    t0 = time.perf_counter()
    res["plan_times"] = plan_times([int(x) for x in a.layers.split(",") if x]) if a.layers else []
    print(f"d) planning: {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    res["cpu_tp2"] = launch(step_worker, 2, "gloo", opts)
    print(f"a-c) tp 2 on CPU: {time.perf_counter() - t0:.1f} s", flush=True)
    if torch.cuda.is_available():
        gpu = launch(step_worker, 1, "nccl", {**opts, "device": "cuda", "compile": False, "profile": False})[0]
        res["gpu"] = {"device": torch.cuda.get_device_name(0), "step_ms": gpu["step_ms"],
                      "loss_diff_vs_unsharded": gpu["loss_diff_vs_unsharded"]}
    else:
        res["gpu"] = {"note": "skipped: no CUDA device on this machine (the tp 1 GPU run needs one)"}
    res["loadavg"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    res["summary"] = summarize(res)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "benchmarks.json").write_text(json.dumps(res, indent=2, default=str))
    md = markdown(res)
    (a.out / "benchmarks.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
