"""Benchmark (not a test): ``autotp plan``'s work for a GPT-2-XL-shaped model, on the meta device.

48 layers, n_embd 1600, 25 heads, vocab 50257, 1024 positions (1.56 B parameters, ~6.2 GB in fp32) is built
under ``torch.device("meta")`` and never materialised; then it is captured, planned for tp 5 (25 heads are
not divisible by 4, so tp 4 is refused with a ShardingError), reported for an 8 × 1024 batch and rendered
as ``autotp plan`` renders it. Prints wall time per phase and the peak RSS of this process and writes
``benchmarks/results/plan_gpt2_xl.json``. Targets: under 20 s and 2 GB RSS.

    python benchmarks/plan_gpt2_xl.py [--tp 5] [--batch 8] [--seq 1024]
"""
from __future__ import annotations

import argparse
import io
import json
import platform
import resource
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
import torch  # noqa: E402  (timed: importing torch and transformers is part of what a user waits for)
from rich.console import Console  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from autotp.capture.tracer import capture  # noqa: E402
from autotp.cli.plan import render  # noqa: E402
from autotp.distributed.rank_grid import RankGrid  # noqa: E402
from autotp.plan.planner import make_plan  # noqa: E402
from autotp.reports.sharding import build_report  # noqa: E402
from autotp.reports.symbols import size_ranges  # noqa: E402

IMPORT_S = time.perf_counter() - T0
RESULTS = Path(__file__).resolve().parent / "results" / "plan_gpt2_xl.json"
TARGET_S, TARGET_RSS_MB = 20.0, 2048.0


def peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    opts = parser.parse_args()

    phases: dict[str, float] = {}
    rss: dict[str, float] = {"after_import": peak_rss_mb()}

    def timed(name, fn):
        start = time.perf_counter()
        out = fn()
        phases[name] = time.perf_counter() - start
        rss[f"after_{name}"] = peak_rss_mb()
        return out

    cfg = GPT2Config(n_layer=48, n_embd=1600, n_head=25, vocab_size=50257, n_positions=1024,
                     loss_type="ForCausalLM")

    def build():
        with torch.device("meta"):
            return GPT2LMHeadModel(cfg)

    model = timed("build", build)
    assert all(p.is_meta for p in model.parameters()), "the model must stay on the meta device"
    # real ids are tiny (64 KiB); capture turns them into meta tensors itself
    ids = torch.zeros(opts.batch, opts.seq, dtype=torch.long)
    kwargs = {"input_ids": ids, "labels": ids, "use_cache": False}
    gm = timed("capture", lambda: capture(model, (), kwargs)[0])
    materialised = [n for n, p in gm.named_parameters() if not p.is_meta]
    plan = timed("plan", lambda: make_plan(gm, opts.tp))
    report = timed("report", lambda: build_report(plan, model.named_parameters(remove_duplicate=False),
                                                  opts.batch, opts.seq))
    ranges = size_ranges(gm)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    grid = RankGrid.build(opts.tp, opts.tp)

    def draw():
        console = Console(file=io.StringIO(), width=160, record=True)
        render(console, "gpt2-xl (meta)", plan, report, grid, names)
        return console.export_text()

    text = timed("render", draw)
    work = sum(phases.values())
    total = time.perf_counter() - T0
    peak = peak_rss_mb()
    result = {
        "model": "GPT-2-XL shape (transformers GPT2LMHeadModel, meta device)",
        "parameters": report.memory.params,
        "tp": opts.tp, "batch": opts.batch, "seq": opts.seq,
        "pairs": len(plan.pairs), "collectives": len(plan.collectives),
        "comm_ratio": {"count": report.total().count_ratio, "elements": report.total().elements_ratio},
        "memory_formula_ratio": report.memory.formula_ratio,
        "materialised_params": len(materialised),
        "size_ranges": {k: [lo, hi] for k, (lo, hi) in ranges.items()},
        "import_s": round(IMPORT_S, 3),
        "phases_s": {k: round(v, 3) for k, v in phases.items()},
        "plan_logic_s": round(work, 3),  # build + capture + plan + report + render
        "total_s": round(total, 3),  # including imports
        "peak_rss_mb": round(peak, 1),
        "rss_mb": {k: round(v, 1) for k, v in rss.items()},
        "rendered_lines": text.count("\n"),
        "targets": {"seconds": TARGET_S, "rss_mb": TARGET_RSS_MB},
        "ok": work < TARGET_S and peak < TARGET_RSS_MB,
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "platform": platform.platform(), "cpus": len(__import__("os").sched_getaffinity(0))},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for name, secs in phases.items():
        print(f"{name:>8}: {secs:7.2f} s   (peak RSS so far {rss[f'after_{name}']:.0f} MB)")
    print(f"plan logic {work:.2f} s (target < {TARGET_S:.0f} s), with imports {total:.2f} s; "
          f"peak RSS {peak:.0f} MB (target < {TARGET_RSS_MB:.0f} MB); "
          f"{len(plan.pairs)} pairs, {len(plan.collectives)} collectives, "
          f"comm ratio {report.total().count_ratio:.2f} count / {report.total().elements_ratio:.2f} elements")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
