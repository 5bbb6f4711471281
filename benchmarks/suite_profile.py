"""Where the test suite's time goes: per test file, and how much of it is ``torch.export`` in the ranks.

    python benchmarks/suite_profile.py [-m slow] [-k EXPR] [--out benchmarks/results]

Runs ``pytest -n 0`` (one process, tests in order, so each duration is the test's own) with every Python
process of the run (pytest, the fork server and the ranks it forks, ``autotp`` commands and scripts the
tests start) importing a ``sitecustomize`` from a temporary folder put first on ``PYTHONPATH``. It wraps
``torch.export.export`` as soon as ``torch.export`` is imported and appends one line per call (process,
seconds, the exported module's class, its input shapes) to a log in that folder; nothing in autotp changes.

Reported: the run's wall time and pytest's own total; per file the seconds of its tests (call, setup and
teardown, from ``--durations=0``); the number of exports and their CPU seconds (summed over ranks, which run
side by side, so against the run's core-seconds: wall × cores); and the share of export time spent
exporting a module of the same class, on inputs of the same shapes, that the same process had exported
already (a rank running several jobs that each build their own model: what reusing a capture across
models would save).
Writes ``OUT/suite_profile.json`` and ``OUT/suite_profile.md``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# imported by every Python process of the run: waits for torch.export, then times each export
HOOK = r'''
import importlib.abc, importlib.util, os, sys, time

_LOG = os.environ.get("AUTOTP_SUITE_PROFILE_LOG")


def _wrap(module):
    real = module.export

    def export(mod, args, *rest, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(mod, args, *rest, **kwargs)
        finally:
            name = type(mod).__qualname__
            shapes = [tuple(a.shape) for a in args if hasattr(a, "shape")] if isinstance(args, tuple) else []
            with open(_LOG, "a") as f:
                f.write(f"{os.getpid()}\t{time.perf_counter() - t0:.4f}\t{name}\t{shapes}\n")

    module.export = export


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.export":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            run(module)
            _wrap(module)

        loader.exec_module = exec_module
        return spec


if _LOG and "torch.export" not in sys.modules:
    sys.meta_path.insert(0, _Finder())
'''


def _durations(text: str) -> dict[str, float]:
    per: dict[str, float] = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*([\d.]+)s (call|setup|teardown)\s+(tests/\S+?)::", line)
        if m:
            per[m.group(3)] += float(m.group(1))
    return dict(per)


def _exports(log: Path) -> dict:
    rows = [line.split("\t") for line in log.read_text().splitlines()] if log.exists() else []
    total = sum(float(r[1]) for r in rows)
    again, seen = 0.0, set()
    for pid, secs, name, shapes in rows:
        if (pid, name, shapes) in seen:
            again += float(secs)
        seen.add((pid, name, shapes))
    names = collections.Counter(r[2] for r in rows)
    return {"count": len(rows), "cpu_s": total, "again_s": again, "processes": len({r[0] for r in rows}),
            "by_forward": names.most_common(10)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", default="slow", help="pytest marker expression (default: slow)")
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "sitecustomize.py").write_text(HOOK)
        log = Path(tmp, "exports.log")
        env = {**os.environ, "AUTOTP_SUITE_PROFILE_LOG": str(log),
               "PYTHONPATH": os.pathsep.join([tmp, *filter(None, [os.environ.get("PYTHONPATH")])])}
        cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--durations=0",
               "-m", a.m, *(["-k", a.k] if a.k else []), "tests"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        exports = _exports(log)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    per_file = _durations(proc.stdout)
    cores = len(os.sched_getaffinity(0))
    result = {"command": " ".join(cmd[1:]), "rc": proc.returncode, "summary": tail, "wall_s": wall,
              "cores": cores, "tests_s": sum(per_file.values()), "per_file": per_file, "exports": exports}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "suite_profile.json").write_text(json.dumps(result, indent=1))
    (out / "suite_profile.md").write_text(_markdown(result))
    print(_markdown(result))
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        sys.exit(proc.returncode)


def _markdown(r: dict) -> str:
    e = r["exports"]
    core_s = r["wall_s"] * r["cores"]
    lines = [f"# Where the test suite's time goes (`{r['command']}`)", "",
             f"{r['summary']}; wall {r['wall_s']:.0f} s on {r['cores']} cores ({core_s:.0f} core-seconds).", "",
             f"- `torch.export.export` calls: {e['count']} in {e['processes']} processes, {e['cpu_s']:.0f} s "
             f"({e['cpu_s'] / core_s:.0%} of the core-seconds).",
             f"- Exports of a module (class and input shapes) the same process had exported already: "
             f"{e['again_s']:.0f} s ({e['again_s'] / max(e['cpu_s'], 1e-9):.0%} of export time).",
             "", "| file | s |", "|---|---|"]
    lines += [f"| {f} | {s:.1f} |" for f, s in sorted(r["per_file"].items(), key=lambda x: -x[1])]
    lines += ["", "Classes exported most often: " + ", ".join(f"{n} ×{c}" for n, c in e["by_forward"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
