"""How long ``autotp plan --auto`` takes on a deep model: the Llama-shaped 70B (``benchmarks/llama70b.py``, 80
layers, built on meta) for 64 GPUs in nodes of 8, the whole command as a user runs it (import, build,
one capture, a plan per tensor-parallel size, the search, the tables).

    python benchmarks/auto_plan_time.py      # writes benchmarks/results/auto_plan_time.{json,md}
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ARGS = ["benchmarks/llama70b.py", "--auto", "--world-size", "64", "--gpus-per-node", "8", "--gpu", "h100",
        "--global-batch", "256", "--top", "5"]


def main() -> None:
    autotp = shutil.which("autotp") or "autotp"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "auto.json"
        start = time.perf_counter()
        run = subprocess.run([autotp, "plan", *ARGS, "--json", str(out)], cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if run.returncode != 0:
            sys.exit(run.stdout + run.stderr)
        data = json.loads(out.read_text())
    best = data["ranked"][0]
    result = {"command": "autotp plan " + " ".join(ARGS), "wall_s": wall, "considered": data["considered"],
              "rejected": data["rejected"], "best": best["label"], "best_step_s": best["step_s"],
              "best_tokens_per_s_per_device": best["tokens_per_s_per_device"], "why": data["why"]}
    (RESULTS / "auto_plan_time.json").write_text(json.dumps(result, indent=1))
    (RESULTS / "auto_plan_time.md").write_text(
        f"# `autotp plan --auto` on a Llama-shaped 70B\n\n`{result['command']}`: {wall:.1f} s wall on this "
        f"machine (2 cores), {data['considered']} layouts priced, {data['rejected']} over memory. Best: "
        f"{best['label']}, {best['step_s']:.2f} s per step predicted, {best['tokens_per_s_per_device']:,.0f} "
        f"tokens/s per GPU.\n\n" + "\n".join(f"- {w}" for w in data["why"]) + "\n")
    print(f"{wall:.1f} s; best {best['label']}")


if __name__ == "__main__":
    main()
