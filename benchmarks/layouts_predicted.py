"""The cost model against measurement on this machine: every layout ``benchmarks/layouts_measured.py`` timed
on 4 CPU ranks, predicted by :func:`autotp.search.cost.estimate` with this machine's profile.

The model is the measured one (``benchmarks/layout_gpt.py``), built on meta and captured once at the
benchmark's batch; the profile is what ``autotp profile --nproc 4`` measured here (matmuls, memory bandwidth,
every collective per group size, all four ranks at once). For each layout: predicted against measured step
time, their ratio, and the rank correlation (Spearman) over all of them.

    autotp profile --nproc 4 --model benchmarks/layout_gpt.py --out benchmarks/results/profile-cpu4.json
    python benchmarks/layouts_measured.py                  # the measured step times (minutes)
    python benchmarks/layouts_predicted.py                 # this comparison (seconds)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]

from layout_gpt import GPTConfig, build_model, example_batch  # noqa: E402

from autotp.search.cost import Candidate, Training, estimate  # noqa: E402
from autotp.search.model_costs import capture_costs  # noqa: E402
from autotp.search.hardware import load  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def ranks(xs: list[float]) -> list[float]:
    """Average ranks (ties share theirs)."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", type=Path, default=RESULTS / "layouts_measured.json")
    ap.add_argument("--profile", type=Path, default=RESULTS / "profile-cpu4.json")
    ap.add_argument("--out", type=Path, default=RESULTS / "layouts_predicted.json")
    a = ap.parse_args()
    measured = json.loads(a.measured.read_text())
    cfg = GPTConfig(**{k: v for k, v in measured["model"].items() if k in GPTConfig.__dataclass_fields__})
    hw = load(a.profile)
    with torch.device("meta"):
        net = build_model(cfg)
    idx, targets = example_batch(cfg, measured["batch"])
    facts = capture_costs(net, (idx, targets), {}, [1, 2, 4], measured["batch"], measured["seq"])
    training = Training(act_bytes=4, seq=measured["seq"])
    rows = []
    for r in measured["layouts"]:
        if r.get("status") != "ok" or r["world"] != 4:
            continue
        lay = Candidate(r["tp"], r["dp"], r["pp"], r["micro_batch"], r["microbatches"], 1, bool(r["fsdp"]))
        est = estimate(facts, hw, lay, training)
        rows.append({"name": r["name"], "schedule": r.get("schedule"), "measured_s": r["step_s"],
                     "predicted_s": est.step, "ratio": est.step / r["step_s"],
                     **{k.replace(" ", "_") + "_s": v for k, v in est.terms().items()}})
    rho = spearman([x["measured_s"] for x in rows], [x["predicted_s"] for x in rows])
    worst = max(abs(x["ratio"] - 1) for x in rows)
    console = Console(width=180)
    t = Table(title=f"Predicted against measured step time, 4 CPU ranks ({a.measured.name}, profile {hw.name})")
    for col in ("layout", "measured", "predicted", "pred/meas", "compute", "tp comm", "pp bubble", "pp comm",
                "dp comm", "optimizer"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for x in sorted(rows, key=lambda x: x["measured_s"]):
        t.add_row(x["name"], f"{x['measured_s'] * 1e3:.0f} ms", f"{x['predicted_s'] * 1e3:.0f} ms",
                  f"{x['ratio']:.2f}", *(f"{x[k] * 1e3:.0f}" for k in ("compute_s", "tp_comm_s", "pp_bubble_s",
                                                                         "pp_comm_s", "dp_comm_s", "optimizer_s")))
    t.caption = f"Spearman rank correlation {rho:.2f}; largest |pred/meas − 1| {worst:.0%}. Terms in ms."
    console.print(t)
    a.out.write_text(json.dumps({"profile": hw.to_dict(), "measured": str(a.measured), "spearman": rho,
                                 "worst_ratio_error": worst, "rows": rows}, indent=1))
    lines = ["# Predicted against measured step time on this machine\n",
             f"Measured: `{a.measured.relative_to(ROOT) if a.measured.is_relative_to(ROOT) else a.measured}` "
             f"({measured.get('machine', {}).get('summary', '')}); profile: `autotp profile --nproc 4 --model benchmarks/layout_gpt.py` "
             f"(`{a.profile.name}`). Model: `benchmarks/layout_gpt.py`, {measured['model'].get('params', 0) / 1e6:.1f}M "
             f"fp32 parameters, batch {measured['batch']} × {measured['seq']}.\n",
             "| layout | measured ms | predicted ms | pred/meas | compute | tp comm | pp bubble | pp comm | dp comm "
             "| optimizer |", "|" + "---|" * 10]
    for x in sorted(rows, key=lambda x: x["measured_s"]):
        lines.append(f"| {x['name']} | {x['measured_s'] * 1e3:.0f} | {x['predicted_s'] * 1e3:.0f} | {x['ratio']:.2f} | "
                     + " | ".join(f"{x[k] * 1e3:.0f}" for k in ("compute_s", "tp_comm_s", "pp_bubble_s", "pp_comm_s",
                                                              "dp_comm_s", "optimizer_s")) + " |")
    lines.append(f"\nSpearman rank correlation {rho:.2f}; largest |predicted/measured − 1| {worst:.0%}.\n")
    a.out.with_suffix(".md").write_text("\n".join(lines))
    console.print(f"wrote {a.out} and {a.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
