"""How long ``autotp shard`` takes from the command to its last line, with ranks forked from the warm fork
server (the ``autotp`` console script: ``python -m autotp.cli``) against spawned ranks that import torch and
autotp themselves (``python -m autotp.cli.main``, the app without the warm-up).

    python benchmarks/warm_ranks.py [--tp 2,4] [--repeats 3] [--out benchmarks/results/warm_ranks]

The job is the main job's model (``examples/nanogpt.py``), one step, no parity check and the final
checkpoint only (``--steps 1 --no-verify --save-every 0``), so start-up is most of it. The two ways alternate, each run in a
fresh process with its own output folder and plan cache; times are medians (seconds) and the ratio is warm
over spawned, measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WAYS = {"warm": ["-m", "autotp.cli"], "spawned": ["-m", "autotp.cli.main"]}


def one(way: str, tp: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, *WAYS[way], "shard", "examples/nanogpt.py", "--tp", str(tp), "--steps", "1",
               "--no-verify", "--save-every", "0", "--out", os.path.join(tmp, "out")]
        env = {**os.environ, "AUTOTP_CACHE_DIR": os.path.join(tmp, "cache")}
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "warm_ranks"))
    a = ap.parse_args()
    rows = []
    for tp in (int(t) for t in a.tp.split(",")):
        times = {way: [] for way in WAYS}
        for _ in range(a.repeats):
            for way in WAYS:
                times[way].append(one(way, tp))
        med = {way: statistics.median(ts) for way, ts in times.items()}
        rows.append({"tp": tp, **{f"{w}_s": round(m, 2) for w, m in med.items()},
                     "ratio": round(med["warm"] / med["spawned"], 2), "runs": times})
        print(f"tp {tp}: warm {med['warm']:.2f} s, spawned {med['spawned']:.2f} s, "
              f"ratio {med['warm'] / med['spawned']:.2f}")
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "repeats": a.repeats, "rows": rows}
    Path(a.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# autotp shard start-up: warm ranks against spawned ranks", "",
             f"`python benchmarks/warm_ranks.py` on {result['machine']}; medians of {a.repeats} alternating runs "
             "of `autotp shard examples/nanogpt.py --tp T --steps 1 --no-verify --save-every 0`, seconds from "
             "the command to its exit.", "", "| tp | warm (s) | spawned (s) | warm / spawned |", "|---|---|---|---|"]
    lines += [f"| {r['tp']} | {r['warm_s']} | {r['spawned_s']} | {r['ratio']} |" for r in rows]
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
