"""How start-up time of ``autotp plan`` and ``autotp.parallelize`` grows with model depth, phase by phase.

    python benchmarks/startup.py [--layers 2,8,32,80] [--tp 8] [--repeats 1] [--out benchmarks/results/startup]

The model is the 70B-wide Llama-shaped decoder (``benchmarks/llama_depth.py``: hidden 8192, 64 heads, 8 kv
heads, SwiGLU 28672, vocab 32000) with L layers, built on meta and captured on (1, 2048) token ids. Capture
exports the first blocks of each kind and copies them (``autotp/capture/repeats.py``); on the first call
signature analysis, the passes and the tables still visit every block, a later one plans and rewrites the
exported blocks and copies the rewritten ones. ``PYTHONPATH`` at an older checkout measures it instead
(``--note`` says so in the results). Per L, each in a fresh process (cold
imports; the OS file cache is warmed once before the first so the first row is not the only cold one):

- ``plan`` worker: what ``autotp plan`` runs (``plan_file`` and cli/plan.py's ``render``), phase by phase:
  import torch / autotp / autotp.cli.main, build, capture, analysis (analyze_graph),
  plan (the rest of make_plan), report (build_report and the size check), render (tables to a 160-column
  StringIO console).
- ``cli``: the wall of ``AUTOTP_BENCH_LAYERS=L autotp plan benchmarks/llama_depth.py --tp T`` itself, and
  of the same command again with the plan it saved (warm cache).
- ``parallelize`` worker: the single-process part of ``autotp.parallelize`` (``_build``): capture with meta
  stand-ins, plan, the rewrite passes; sharding the weights needs a process group of T ranks and is left out.
  *later call*: capture, plan and passes again for a second call signature (the model in eval mode), as
  ``parallelize`` does on the first call of each signature: the exported blocks planned and rewritten, then
  copied (``autotp/parallel/rewrite.py``).

Times are the median of ``--repeats`` runs (seconds); peak RSS is the process's ru_maxrss (os.wait4). Each
process gets an empty ``AUTOTP_CACHE_DIR``, so no run reuses a plan an earlier one saved.
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
MODEL_FILE = "benchmarks/llama_depth.py"
PLAN_PHASES = ("torch", "autotp", "cli", "build", "capture", "analysis", "plan", "report", "render")
PAR_PHASES = ("torch", "autotp", "build", "capture", "analysis", "plan", "passes")
# what make_plan calls to analyse the graph; the rest of make_plan (plan_from_facts) is "plan"
ANALYSIS = ("analyze_graph",)


# -- workers: run in a fresh interpreter, print one JSON line --------------------------------------------
def _timed_plan(gm, tp: int):
    """make_plan(gm, tp), with the time spent in its analysis calls told apart from the rest."""
    from autotp.plan import planner

    spent = [0.0]

    def timed(fn):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t
        return call

    saved = {n: getattr(planner, n) for n in ANALYSIS if hasattr(planner, n)}
    for name, fn in saved.items():
        setattr(planner, name, timed(fn))
    try:
        t = time.perf_counter()
        plan = planner.make_plan(gm, tp)
        total = time.perf_counter() - t
    finally:
        for name, fn in saved.items():
            setattr(planner, name, fn)
    return plan, spent[0], total - spent[0]


def worker(kind: str, layers: int, tp: int) -> dict:
    t: dict[str, float] = {}
    mark = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        t[phase] = now - mark
        mark = now

    import torch
    lap("torch")
    import autotp
    lap("autotp")
    if kind == "plan":
        import autotp.cli.main  # noqa: F401
        lap("cli")
    from autotp.capture.tracer import capture, input_guard, stand_ins
    from llama_depth import LlamaShaped, config

    ids = torch.zeros(1, 2048, dtype=torch.long)
    mark = time.perf_counter()
    with torch.device("meta"):
        net = LlamaShaped(config(layers))
    lap("build")
    cpu = torch.device("cpu")
    if kind == "plan":
        import io

        from rich.console import Console

        from autotp.cli.plan import render
        from autotp.parallel.planning import check_sizes
        from autotp.distributed.rank_grid import RankGrid
        from autotp.reports.sharding import build_report
        from autotp.reports.symbols import size_ranges

        mark = time.perf_counter()
        gm, _ = capture(net, (ids,), {}, params=None, device=cpu)
        lap("capture")
        plan, t["analysis"], t["plan"] = _timed_plan(gm, tp)
        mark = time.perf_counter()
        report = build_report(plan, net.named_parameters(remove_duplicate=False), 1, 2048)
        check_sizes(report, size_ranges(gm))
        names = [n for n, _ in net.named_parameters(remove_duplicate=False)]
        lap("report")
        grid = RankGrid.build(tp, tp)
        render(Console(file=io.StringIO(), width=160), MODEL_FILE, plan, report, grid, names, "")
        lap("render")
    else:
        from autotp.passes import run_passes

        # as parallelize's _build does for a model built wholly on meta: meta stand-ins, graph for the CPU
        mark = time.perf_counter()
        swap = stand_ins({**dict(net.named_parameters(remove_duplicate=False)),
                          **dict(net.named_buffers(remove_duplicate=False))}, torch.device("meta"))
        gm, _ = capture(net, (ids,), {}, forward=type(net).forward.__get__(net), params=swap, device=cpu)
        input_guard(gm)
        lap("capture")
        plan, t["analysis"], t["plan"] = _timed_plan(gm, tp)
        mark = time.perf_counter()
        run_passes(gm, plan)
        lap("passes")
        # a later call signature (eval mode: parallelize captures each signature on its first call), all of it,
        # as _build runs it: the exported blocks planned and rewritten, then copied (autotp.parallel.rewrite)
        from autotp.parallel.planning import How, capture_and_plan, job_of
        from autotp.parallel.rewrite import rewrite
        from autotp.options import Options
        from autotp.state import RankIdentity, TPState

        st = TPState(RankIdentity(None, tp, 0, cpu), Options(), type(net), None)
        st.shards, st.cached = {**dict(plan.params), **dict(plan.buffers)}, plan
        net.eval()
        mark = time.perf_counter()
        planned = capture_and_plan(net, (ids,), {}, job_of(tp, st.options), blocks=True,
                                   how=How(type(net).forward.__get__(net), swap, cpu))
        later = rewrite(st, planned, stacklevel=2)
        lap("later call")
        t["later copied"] = float(later.copied)
    return {"phases": t, "nodes": len(gm.graph.nodes), "pairs": len(plan.pairs), "torch": torch.__version__,
            "autotp": str(Path(autotp.__file__).parent)}


# -- driver ----------------------------------------------------------------------------------------------
def _spawn(cmd: list[str], env: dict | None = None, cache: str | None = None) -> dict:
    """Run ``cmd`` to completion: its wall, peak RSS (MiB) and stdout. Output goes to files, not pipes,
    so an 80-layer table cannot fill a pipe while we wait on the process. ``cache``: the plan cache folder
    (default: an empty one, start-up without a plan saved by an earlier run or by the user)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
            tempfile.TemporaryDirectory() as empty:
        env = {**os.environ, **(env or {}), "AUTOTP_CACHE_DIR": cache or empty}
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return {"wall_s": wall, "rss_mib": usage.ru_maxrss / 1024, "stdout": stdout}


def measure(layers: int, tp: int) -> dict:
    row = {}
    for kind in ("plan", "parallelize"):
        run = _spawn([sys.executable, __file__, "--worker", kind, "--layers", str(layers), "--tp", str(tp)])
        row[kind] = {**json.loads(run["stdout"].strip().splitlines()[-1]), "wall_s": run["wall_s"],
                     "rss_mib": run["rss_mib"]}
    cli = str(Path(sys.executable).with_name("autotp"))
    with tempfile.TemporaryDirectory() as cache:  # the second run reads the plan the first one saved
        cmd, env = [cli, "plan", MODEL_FILE, "--tp", str(tp)], {"AUTOTP_BENCH_LAYERS": str(layers)}
        run = _spawn(cmd, env, cache)
        warm = _spawn(cmd, env, cache)
    row["cli"] = {"wall_s": run["wall_s"], "rss_mib": run["rss_mib"], "warm_s": warm["wall_s"]}
    return row


def _median(runs: list[dict], kind: str, key: str) -> float:
    return statistics.median(r[kind]["phases"][key] if key in r[kind].get("phases", {}) else r[kind][key]
                             for r in runs)


def tables(results: dict) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    plan_head = ["L", *PLAN_PHASES, "sum", "worker wall", "RSS MiB", "CLI wall", "CLI RSS MiB", "CLI warm cache"]
    par_head = ["L", *PAR_PHASES, "sum", "later call", "worker wall", "RSS MiB"]
    plan_rows, par_rows = [], []
    for layers, runs in results.items():
        p = [_median(runs, "plan", k) for k in PLAN_PHASES]
        plan_rows.append([str(layers), *(f"{x:.2f}" for x in p), f"{sum(p):.2f}",
                          f"{_median(runs, 'plan', 'wall_s'):.2f}", f"{_median(runs, 'plan', 'rss_mib'):.0f}",
                          f"{_median(runs, 'cli', 'wall_s'):.2f}", f"{_median(runs, 'cli', 'rss_mib'):.0f}",
                          f"{_median(runs, 'cli', 'warm_s'):.2f}" if all("warm_s" in r["cli"] for r in runs) else "-"])
        q = [_median(runs, "parallelize", k) for k in PAR_PHASES]
        later = (f"{_median(runs, 'parallelize', 'later call'):.2f}"
                 if all("later call" in r["parallelize"]["phases"] for r in runs) else "-")
        par_rows.append([str(layers), *(f"{x:.2f}" for x in q), f"{sum(q):.2f}", later,
                         f"{_median(runs, 'parallelize', 'wall_s'):.2f}",
                         f"{_median(runs, 'parallelize', 'rss_mib'):.0f}"])
    return plan_head, plan_rows, par_head, par_rows


def ratios(results: dict, a: int = 80, b: int = 8) -> dict[str, float]:
    if a not in results or b not in results:
        return {}
    return {f"cli_wall_{a}/{b}": _median(results[a], "cli", "wall_s") / _median(results[b], "cli", "wall_s"),
            f"capture_{a}/{b}": _median(results[a], "plan", "capture") / _median(results[b], "plan", "capture"),
            f"later_call_{a}/{b}": _median(results[a], "parallelize", "later call")
            / _median(results[b], "parallelize", "later call")}


def markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def code_version() -> dict:
    """Which autotp was measured: the commit and any uncommitted change to the package (read-only git)."""
    def git(*args: str) -> str:
        run = subprocess.run(["git", "--no-optional-locks", *args], cwd=ROOT, capture_output=True, text=True)
        return run.stdout.strip()

    return {"commit": git("rev-parse", "HEAD"),
            "uncommitted": git("status", "--porcelain", "--", "autotp", "passes", "cli").splitlines()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="2,8,32,80", help="comma-separated depths")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/startup", help="writes OUT.json and OUT.md")
    ap.add_argument("--note", default="", help="a line for the results: which code this measures, and why")
    ap.add_argument("--worker", choices=("plan", "parallelize"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, int(a.layers), a.tp)))
        return

    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # rich's 80-column fallback would fold the tables' headers
        console = Console(width=160)
    depths = [int(x) for x in a.layers.split(",")]
    load_start = os.getloadavg()
    # warm the OS file cache (from benchmarks/, so a PYTHONPATH copy of autotp is found before the checkout)
    subprocess.run([sys.executable, "-c", "import autotp.cli.main"], cwd=ROOT / "benchmarks", check=True)
    results: dict[int, list[dict]] = {}
    for layers in depths:
        for i in range(a.repeats):
            console.log(f"L={layers} run {i + 1}/{a.repeats}")
            results.setdefault(layers, []).append(measure(layers, a.tp))
    load_end = os.getloadavg()

    plan_head, plan_rows, par_head, par_rows = tables(results)
    for title, head, rows in ((f"autotp plan, tp {a.tp} (s)", plan_head, plan_rows),
                              (f"autotp.parallelize single-process part, tp {a.tp} (s)", par_head, par_rows)):
        table = Table(title=title)
        for h in head:
            table.add_column(h, justify="left" if h == "L" else "right")
        for r in rows:
            table.add_row(*r)
        console.print(table)
    r = ratios(results)
    for k, v in r.items():
        console.print(f"{k}: {v:.2f}×")

    torch_version = results[depths[0]][0]["plan"]["torch"]
    command = f"python benchmarks/startup.py --layers {a.layers} --tp {a.tp} --repeats {a.repeats}"
    if os.environ.get("PYTHONPATH"):
        command = f"PYTHONPATH={os.environ['PYTHONPATH']} {command}"
    machine = {"cores": os.cpu_count(), "torch": torch_version, "python": platform.python_version(),
               "platform": platform.platform(), "loadavg_start": load_start, "loadavg_end": load_end}
    code = {"imported_from": results[depths[0]][0]["plan"]["autotp"]}
    if code["imported_from"].startswith(str(ROOT)):  # not a copy put first on PYTHONPATH: the checkout's state
        code.update(code_version())
    where = ", ".join([f"autotp from {code['imported_from']}",
                       *([f"commit {code['commit'][:10]}"] if "commit" in code else []), *code.get("uncommitted", [])])
    out = ROOT / a.out if not Path(a.out).is_absolute() else Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"command": command, "note": a.note, "tp": a.tp, "model": MODEL_FILE, "machine": machine, "code": code,
            "ratios": r, "runs": results}
    Path(f"{out}.json").write_text(json.dumps(data, indent=1))
    load = lambda x: ", ".join(f"{v:.2f}" for v in x)  # noqa: E731
    Path(f"{out}.md").write_text(
        f"# Start-up time vs depth: `autotp plan` and `autotp.parallelize`\n\n`{command}`\n\n"
        f"Llama-shaped, 70B-wide (`{MODEL_FILE}`), built on meta, (1, 2048) token ids, tp {a.tp}; median of "
        f"{a.repeats} run(s), seconds, each depth in fresh processes. {os.cpu_count()} cores, torch "
        f"{torch_version}, Python {platform.python_version()}; load average (1, 5, 15 min) {load(load_start)} "
        f"at start, {load(load_end)} at end; {where}.{' ' + a.note if a.note else ''}\n\n## autotp plan\n\n"
        f"Phases in one process (as cli/plan.py runs them); *sum* is theirs, *worker wall* the whole process "
        f"(interpreter start and exit besides); *CLI wall* is `AUTOTP_BENCH_LAYERS=L autotp plan {MODEL_FILE} "
        f"--tp {a.tp}` as a whole."
        f"\n\n{markdown(plan_head, plan_rows)}\n\n## autotp.parallelize (single-process part)\n\nCapture with "
        f"meta stand-ins, plan and rewrite passes as `_build` runs them; no process group, no weight sharding."
        f"\n\n{markdown(par_head, par_rows)}\n\n" + "".join(f"- {k}: {v:.2f}×\n" for k, v in r.items()))


if __name__ == "__main__":
    main()
