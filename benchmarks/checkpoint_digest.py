"""Benchmark (not a test): what the checkpoint checksums cost. One process saves a state dict of ``--mb``
megabytes of fp32 tensors with DCP's own FileSystemWriter and with autotp's DigestingWriter (XXH3-64 of
every byte as it is written), and reads the files back to check them against the digests, as a load does
first, and loads them plainly (a load with verification is check + load); each the median of ``--repeat``
runs, alternating, on the same folder's disk.

    python benchmarks/checkpoint_digest.py [--mb 256] [--repeat 5] [--out benchmarks/results]

Writes ``OUT/checkpoint_digest.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from rich.console import Console
from rich.table import Table
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from autotp.io.ckpt_digest import DigestingWriter, verify_share


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    n = a.mb * 2**20 // 4 // 64
    state = {f"layer{i}.weight": torch.randn(n // 16, 16) for i in range(64)}  # 64 tensors, a.mb MB in all
    times: dict[str, list[float]] = {"save": [], "save + xxh3": [], "load": [], "check": []}
    into = {k: torch.empty_like(v) for k, v in state.items()}
    root = Path(tempfile.mkdtemp(prefix="autotp-digest-", dir=os.environ.get("TMPDIR")))
    try:
        for _ in range(a.repeat):
            for kind in ("save", "save + xxh3"):
                path = root / kind.replace(" ", "")
                shutil.rmtree(path, ignore_errors=True)
                writer = DigestingWriter(path) if "xxh3" in kind else FileSystemWriter(path)
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=writer, no_dist=True)
                times[kind].append(time.perf_counter() - t0)
                if "xxh3" in kind:
                    digests = writer.digests
            t0 = time.perf_counter()
            dcp.load(into, storage_reader=FileSystemReader(root / "save+xxh3"), no_dist=True)
            times["load"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert verify_share(root / "save+xxh3", digests, 0, 1) is None
            times["check"].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"megabytes": a.mb, "repeat": a.repeat, "median_s": med, "all_s": times,
              "save_overhead": med["save + xxh3"] / med["save"] - 1, "check_vs_save": med["check"] / med["save"],
              "check_vs_load": med["check"] / med["load"]}
    table = Table(title=f"checkpoint checksums, {a.mb} MB of fp32 tensors, median of {a.repeat}")
    for col in ("what", "seconds", "vs plain save"):
        table.add_column(col)
    for k, v in med.items():
        table.add_row(k, f"{v:.3f}", f"{v / med['save']:.3f}×")
    Console().print(table)
    os.makedirs(a.out, exist_ok=True)
    Path(a.out, "checkpoint_digest.json").write_text(json.dumps(result, indent=1) + "\n")
    Path(a.out, "checkpoint_digest.md").write_text(
        f"# Checkpoint checksums\n\n`python benchmarks/checkpoint_digest.py --mb {a.mb} --repeat {a.repeat}`: "
        f"{a.mb} MB of fp32 tensors, one process, median of {a.repeat} (CPU: {os.cpu_count()} cores).\n\n"
        "| what | seconds | vs plain save |\n| --- | --- | --- |\n" +
        "".join(f"| {k} | {v:.3f} | {v / med['save']:.3f}× |\n" for k, v in med.items()))


if __name__ == "__main__":
    sys.exit(main())
