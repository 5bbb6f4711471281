"""Where the test suite's time goes: per test file, and how much of it is ``torch.export`` in the ranks.

    python benchmarks/suite_profile.py [-m slow] [-k EXPR] [--out benchmarks/results]

Runs ``pytest -n 0`` (one process, tests in order, so each duration is the test's own) with every Python
process of the run (pytest, the fork server and the ranks it forks, ``autotp`` commands and scripts the
tests start) importing a ``sitecustomize`` from a temporary folder put first on ``PYTHONPATH``. It wraps
``torch.export.export`` as soon as ``torch.export`` is imported and appends one line per call (process,
the calling thread's CPU seconds, the exported module's class, its input shapes, when it ended) to a log in
that folder; nothing in autotp changes. The test helpers that run functions on ranks
(``tests/support/ranks.py``) log each job's span and CPU seconds in every rank beside it.

Reported: the run's wall time and pytest's own total; per file the seconds of its tests (call, setup and
teardown, from ``--durations=0``); the number of exports and their CPU seconds (summed over processes, so
against the run's core-seconds: wall × cores); the share of export time spent exporting a module of the
same class, on inputs of the same shapes, that the same process had exported already (a rank running
several jobs that each build their own model), and the part of it that exported the very graph (the same ops
in the same order) the process had exported already: the re-export share, what reusing a capture across equal
models (``tests/support/capture_reuse.py``) would still save; and per rank job its CPU seconds summed over its
ranks, and the exports inside it.
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
import hashlib, importlib.abc, importlib.util, os, sys, time

_LOG = os.environ.get("AUTOTP_SUITE_PROFILE_LOG")


def _wrap(module):
    real = module.export

    def export(mod, args, *rest, **kwargs):
        t0 = time.thread_time()
        ep = None
        try:
            ep = real(mod, args, *rest, **kwargs)
            return ep
        finally:
            secs = time.thread_time() - t0
            name = type(mod).__qualname__
            shapes = [tuple(a.shape) for a in args if hasattr(a, "shape")] if isinstance(args, tuple) else []
            # the graph itself (ops, their order and arguments): equal for equal models, whatever their weights
            graph = hashlib.sha1(str(ep.graph).encode()).hexdigest()[:16] if ep is not None else "failed"
            with open(_LOG, "a") as f:
                f.write(f"{os.getpid()}\t{secs:.4f}\t{name}\t{shapes}\t{time.time():.3f}\t{graph}\n")

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
    same, graphs = 0.0, set()
    for pid, secs, name, shapes, _, graph in rows:
        if (pid, name, shapes) in seen:
            again += float(secs)
        seen.add((pid, name, shapes))
        if graph != "failed" and (pid, name, shapes, graph) in graphs:
            same += float(secs)
        graphs.add((pid, name, shapes, graph))
    names = collections.Counter(r[2] for r in rows)
    return {"count": len(rows), "cpu_s": total, "again_s": again, "same_graph_s": same,
            "processes": len({r[0] for r in rows}), "by_forward": names.most_common(10)}


def _jobs(log: Path, exports: Path) -> dict:
    """Rank CPU seconds per job (summed over its ranks) and the export CPU seconds inside each, from the lines
    ``tests/support/ranks.py`` writes: a launch's own line (job "") holds its jobs' lines."""
    rows = [line.split("\t") for line in log.read_text().splitlines()] if log.exists() else []
    spans = [(pid, fn, job, float(a), float(b), float(cpu)) for pid, _, fn, job, a, b, cpu in rows]
    done = [line.split("\t") for line in exports.read_text().splitlines()] if exports.exists() else []
    per: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    launches_cpu = 0.0
    for pid, fn, job, a, b, cpu in spans:
        if job:
            key = f"{fn} · {job}"
            per[key][0] += cpu
        else:
            launches_cpu += cpu
            key = fn
            if any(p == pid and j and a <= a2 and b2 <= b for p, _, j, a2, b2, _ in spans):
                continue  # a launch of named jobs: its time is theirs
            per[key][0] += cpu
        for epid, secs, _, _, at, *_ in done:
            if epid == pid and a <= float(at) <= b:
                per[key][1] += float(secs)
                per[key][2] += 1
    top = sorted(per.items(), key=lambda kv: -kv[1][0])
    return {"rank_cpu_s": launches_cpu, "rank_export_cpu_s": sum(v[1] for v in per.values()),
            "jobs": [{"job": k, "cpu_s": round(v[0], 2), "export_cpu_s": round(v[1], 2), "exports": v[2]}
                     for k, v in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", default="slow", help="pytest marker expression (default: slow)")
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "sitecustomize.py").write_text(HOOK)
        log, jobs_log = Path(tmp, "exports.log"), Path(tmp, "jobs.log")
        env = {**os.environ, "AUTOTP_SUITE_PROFILE_LOG": str(log), "AUTOTP_SUITE_PROFILE_JOBS": str(jobs_log),
               "PYTHONPATH": os.pathsep.join([tmp, *filter(None, [os.environ.get("PYTHONPATH")])])}
        cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--durations=0",
               "-m", a.m, *(["-k", a.k] if a.k else []), "tests"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        exports, jobs = _exports(log), _jobs(jobs_log, log)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    per_file = _durations(proc.stdout)
    cores = len(os.sched_getaffinity(0))
    result = {"command": " ".join(cmd[1:]), "rc": proc.returncode, "summary": tail, "wall_s": wall,
              "cores": cores, "tests_s": sum(per_file.values()), "per_file": per_file, "exports": exports,
              "jobs": jobs}
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
             f"{e['again_s']:.0f} s ({e['again_s'] / max(e['cpu_s'], 1e-9):.0%} of export time); of those, the "
             f"same graph again (the re-export share: what reusing a capture would have saved): "
             f"{e.get('same_graph_s', 0):.0f} s ({e.get('same_graph_s', 0) / max(e['cpu_s'], 1e-9):.0%}).",
             "", "| file | s |", "|---|---|"]
    lines += [f"| {f} | {s:.1f} |" for f, s in sorted(r["per_file"].items(), key=lambda x: -x[1])]
    lines += ["", "Classes exported most often: " + ", ".join(f"{n} ×{c}" for n, c in e["by_forward"])]
    j = r["jobs"]
    lines += ["", f"Ranks of launched functions: {j['rank_cpu_s']:.0f} CPU-s, of which exporting "
              f"{j['rank_export_cpu_s']:.0f} CPU-s. Jobs by CPU seconds over their ranks:", "",
              "| job | CPU s | export CPU s | exports |", "|---|---|---|---|"]
    lines += [f"| {x['job']} | {x['cpu_s']:.1f} | {x['export_cpu_s']:.1f} | {x['exports']} |" for x in j["jobs"][:60]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
