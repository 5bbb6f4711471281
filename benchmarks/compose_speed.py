"""Benchmark (not a test): the dimensions together. Step time of tp 2 × fsdp 2 with and without compile, and
of tp 2 × pp 2 × fsdp 2 against tp 2 × pp 2 with DDP over the same dp 2; peak memory per rank against the
formula for the FSDP layouts.

    python benchmarks/compose_speed.py [--steps 8] [--mem-steps 3] [--layers 4] [--out benchmarks/results]

Model: benchmarks/fsdp.py's nanoGPT (dim 1024, 16 heads, vocab 8192 tied to the LM head, block 128, dropout 0,
attention written out) with ``--layers`` blocks, built on meta and initialised per local piece; batch 2 × 64
per data-parallel replica (the pipelines: 2 micro-batches of 1 × 64, 1F1B), AdamW, fp32, one intra-op
thread per rank, gloo ranks on this machine (torch's elastic launcher, tests/support/ranks.py).

Speed: each world's configurations are built side by side in one launch (glibc's malloc as it comes) and
stepped in turns (a barrier before each step, the order reversed every other round), so that they share the
machine's load: compare the ratios, not the seconds. A step's time is the slowest rank's; the median of
rounds 2..``--steps`` (round 1 allocates AdamW's state, compiles).

    world 4, mesh (dp 2, tp 2):        fsdp            parallelize(fsdp=True)
                                       fsdp_compile    parallelize(fsdp=True, compile=True): each unit's piece
    world 8, mesh (pp 2, dp 2, tp 2):  pp_fsdp         autotp.pipeline(fsdp=True): each stage one FSDP unit,
                                                       kept gathered through the step (the default)
                                       pp_ddp          autotp.pipeline(): DDP over dp

Memory: each FSDP layout in a launch of its own, in a process of its own started with every allocation of
128 KiB or more mapped on its own (``MALLOC_MMAP_THRESHOLD_=131072``: the RSS follows the live tensors), the peak RSS per rank over
``--mem-steps`` steps minus the RSS just before the model is built (benchmarks/fsdp.py's probes), the
largest over the ranks, against (L: the elements a rank's tp shard holds, of its stage under pp; d = 2):

    fsdp       16·L/d + 2·U + A              benchmarks/fsdp.py's formula (U: the largest unit gathered, A:
                                             the TP model's forward activations, measured)
    pp_fsdp    16·L/d + 4·L + 4·L + A_r      the stage gathered through the step, and its gradients
                                             unsharded until the one reduce-scatter after the last
                                             micro-batch; A_r = A · min(m, p − r) / (m · p): the micro-batches
                                             1F1B keeps on pipeline rank r, each through 1/p of the blocks

Writes ``OUT/compose_speed.json`` and ``OUT/compose_speed.md``.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "examples"), str(ROOT / "tests" / "support")]

from fsdp import (CONFIG, MALLOC, MiB, _build, _setup, _source_version, activations,  # noqa: E402
                  formula, peak, reset_peak, rss, train)

GOAL = 1.15
PP, TP, DP, MICRO = 2, 2, 2, 2
BATCH, SEQ = 2, 64


# -- on every rank ------------------------------------------------------------------------------------------

def _pipe_setup():
    """(pp, dp, tp) mesh, this replica's batch, the baseline RSS."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torch._dynamo  # noqa: F401  imported before the baseline, as parallelize would lazily
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401

    import autotp  # noqa: F401

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    for dim in ("pp", "dp", "tp"):
        dist.all_reduce(torch.ones(1), group=mesh[dim].get_group())
    g = torch.Generator().manual_seed(1000 + mesh["dp"].get_local_rank())
    batch = tuple(torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g) for _ in range(2))
    dist.barrier()
    gc.collect()
    return mesh, batch, rss(), reset_peak()


def _pipe_build(opts: dict, mesh, batch, fsdp: bool):
    import torch

    import autotp
    from autotp.io.empty import mark_loaded
    from nanogpt import GPT, GPTConfig

    with autotp.empty_weights():
        model = GPT(GPTConfig(**{**CONFIG, "n_layer": opts["layers"]}))
    pipe = autotp.pipeline(model, example_inputs=(batch, {}), microbatches=MICRO, schedule="1F1B", mesh=mesh,
                           fsdp=fsdp)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in pipe.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).normal_(0, 0.02)
    mark_loaded(model)
    return pipe, model


def _local_stage(model) -> int:
    """L of this pipeline rank: the elements its tp shard holds of its stages' parameters (allocated ones)."""
    n = 0
    for p in model.parameters():
        if p.is_meta:
            continue
        if hasattr(p, "placements"):  # FSDP: the TP shards side by side over (dp, tp)
            n += p.numel() // TP if p.placements[-1].is_shard() else p.numel()
        else:
            n += p.numel()
    return n


def _step(run, batch) -> float:
    import torch.distributed as dist

    kind, model, opt = run
    dist.barrier()
    t = time.perf_counter()
    if kind == "pipe":
        model.step(*batch)
    else:
        model(*batch)[1].backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t


def timing(world: int, opts: dict) -> dict:
    """Step times of the world's configurations, built side by side and stepped in turns."""
    import torch

    runs = {}
    if world == 4:
        mesh, batch, _, _ = _setup(opts)
        for name, extra in (("fsdp", {}), ("fsdp_compile", {"compile": True})):
            model = _build_compiled(opts, mesh, batch, extra)
            runs[name] = ("model", model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    else:
        mesh, batch, _, _ = _pipe_setup()
        for name, fsdp in (("pp_fsdp", True), ("pp_ddp", False)):
            pipe, _ = _pipe_build(opts, mesh, batch, fsdp)
            runs[name] = ("pipe", pipe, torch.optim.AdamW(list(pipe.parameters()), lr=1e-4))
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(opts["steps"]):
        for n in (names if rnd % 2 == 0 else names[::-1]):
            times[n].append(_step(runs[n], batch))
    return {"times": times}


def _build_compiled(opts: dict, mesh, batch, extra: dict):
    """benchmarks/fsdp.py's FSDP build, with ``extra`` parallelize options (compile)."""
    if not extra:
        return _build(opts, mesh, batch, {})[0]
    import torch

    import autotp
    from autotp.distributed.data_parallel import FSDPConfig
    from autotp.io.empty import mark_loaded
    from nanogpt import GPT, GPTConfig

    with autotp.empty_weights():
        model = GPT(GPTConfig(**{**CONFIG, "n_layer": opts["layers"]}))
    model = autotp.parallelize(model, example_inputs=(batch, {}), fsdp=FSDPConfig(), mesh=mesh, **extra)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
    mark_loaded(model)
    return model


def pipe_memory(opts: dict) -> dict:
    """tp 2 × pp 2 × fsdp 2 alone: the peak RSS over ``mem_steps`` steps, and L of this rank's stage."""
    import torch

    mesh, batch, base, _ = _pipe_setup()
    pipe, model = _pipe_build(opts, mesh, batch, True)
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=1e-4)
    times = [_step(("pipe", pipe, opt), batch) for _ in range(opts["mem_steps"])]
    return {"peak": peak() - base, "local": _local_stage(model), "pp_rank": mesh.get_local_rank("pp"),
            "times": times}


# -- in the launching process -------------------------------------------------------------------------------

def _launch_world(world: int, mode: str, fn, *args) -> dict:
    from ranks import launch

    from autotp.distributed.launch import _environ

    with _environ(MALLOC[mode]):
        return launch(fn, world, *args)


def _memory_phase(a: argparse.Namespace, opts: dict) -> dict:
    """The memory launches, in a process of their own started with tensors of ≥ 128 KiB mapped on their own:
    glibc reads that at process start, and ranks fork from a server that keeps the environment it started
    with, so they cannot share this process's (whose ranks the timing launches used)."""
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "memory.json"
        subprocess.run([sys.executable, __file__, "--steps", str(a.steps), "--mem-steps", str(a.mem_steps),
                        "--layers", str(a.layers), "--memory-phase", str(out)],
                       env={**os.environ, **MALLOC["mmap"]}, check=True)
        return json.loads(out.read_text())


def _memory(opts: dict) -> dict:
    """Peak per rank against the formula, tp 2 × fsdp 2 and tp 2 × pp 2 × fsdp 2 (run under ``mmap``)."""
    act_ranks = _launch_world(4, "mmap", activations, opts)
    A = max(r["warm"]["forward"] for r in act_ranks.values())
    fs_ranks = _launch_world(4, "mmap", train, "fsdp", {**opts, "steps": opts["mem_steps"]})
    r0 = fs_ranks[0]
    f = formula("fsdp", r0, A)
    fs_peak = max(r["peak"] for r in fs_ranks.values())
    memory = {"fsdp": {"peak": fs_peak, "formula": f["total"], "terms": f["terms"], "ratio": fs_peak / f["total"]}}
    pp_ranks = _launch_world(8, "mmap", pipe_memory, opts)
    rows = []
    for r in pp_ranks.values():
        L, rank = r["local"], r["pp_rank"]
        terms = {"16·L/d": 16 * L / DP, "4·L gathered": 4 * L, "4·L gradients": 4 * L,
                 "A_r": A * min(MICRO, PP - rank) / (MICRO * PP)}
        rows.append({"peak": r["peak"], "formula": sum(terms.values()), "terms": terms})
    busiest = max(rows, key=lambda x: x["peak"] / x["formula"])
    memory["pp_fsdp"] = {**busiest, "ratio": busiest["peak"] / busiest["formula"]}
    return {"memory": memory, "A": A, "params": r0["params"]}


def _median(ts: list[float]) -> float:
    return statistics.median(ts[1:])


def _markdown(res: dict) -> str:
    t, m = res["step_s"], res["memory"]
    lines = [
        "# The dimensions together: step time and memory per rank",
        "",
        f"nanoGPT {res['model']}: {res['params'] / 1e6:.1f}M parameters; batch {BATCH}×{SEQ} per replica "
        f"(pipelines: {MICRO} micro-batches, 1F1B), AdamW, fp32, gloo ranks with one thread each on "
        f"{res['cores']} cores. Step: median of rounds 2..{res['options']['steps']}, configurations of a world "
        "stepped in turns in one launch (compare ratios within a world). Memory: peak RSS per rank minus the "
        "RSS before the build, tensors of ≥ 128 KiB mapped on their own, largest over the ranks.",
        "",
        "| world | configuration | step s | ratio |",
        "|---|---|---|---|",
        f"| 4 | tp 2 × fsdp 2 | {t['fsdp']:.3f} | 1.00 |",
        f"| 4 | tp 2 × fsdp 2, compile (each unit's piece, Inductor) | {t['fsdp_compile']:.3f} | "
        f"{t['fsdp_compile'] / t['fsdp']:.2f} |",
        f"| 8 | tp 2 × pp 2 × dp 2 (DDP) | {t['pp_ddp']:.3f} | 1.00 |",
        f"| 8 | tp 2 × pp 2 × fsdp 2 | {t['pp_fsdp']:.3f} | {t['pp_fsdp'] / t['pp_ddp']:.2f} |",
        "",
        "| layout | peak / rank MiB | formula MiB | terms | measured / formula |",
        "|---|---|---|---|---|",
    ]
    for name, label in (("fsdp", "tp 2 × fsdp 2"), ("pp_fsdp", "tp 2 × pp 2 × fsdp 2 (busiest rank)")):
        r = m[name]
        terms = " + ".join(f"{k} {v / MiB:.0f}" for k, v in r["terms"].items())
        lines.append(f"| {label} | {r['peak'] / MiB:.0f} | {r['formula'] / MiB:.0f} | {terms} | {r['ratio']:.3f} |")
    lines += [
        "",
        f"Goal: measured / formula ≤ {GOAL}: " + ", ".join(f"{n} {'met' if m[n]['ratio'] <= GOAL else 'NOT met'}"
                                                          for n in m) + ".",
        f"A (the TP model's forward activations, measured): {res['activations'] / MiB:.1f} MiB.",
        "",
        f"autotp: HEAD {res['source']['commit'][:12]}, sources digest {res['source']['sources']}.",
        "",
        f"Reproduce: `python benchmarks/compose_speed.py --steps {res['options']['steps']} --mem-steps "
        f"{res['options']['mem_steps']} --layers {res['options']['layers']}` (this run: {res['wall_s']:.0f} s).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    import os

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--mem-steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--memory-phase", default=None, help=argparse.SUPPRESS)  # internal: see _memory_phase
    a = ap.parse_args()
    if a.steps < 2 or a.mem_steps < 2 or a.layers < PP:
        ap.error(f"need --steps >= 2, --mem-steps >= 2 and --layers >= {PP}")
    opts = {"steps": a.steps, "mem_steps": a.mem_steps, "layers": a.layers}
    if a.memory_phase is not None:
        Path(a.memory_phase).write_text(json.dumps(_memory(opts)))
        return

    from rich.console import Console
    from rich.markdown import Markdown

    console = Console(width=160)
    start = time.perf_counter()
    source = _source_version()
    step_s = {}
    for world in (4, 8):
        console.print(f"[bold]timing[/], {world} ranks …")
        ranks = _launch_world(world, "glibc", timing, world, opts)
        for name in ranks[0]["times"]:
            per_round = [max(r["times"][name][i] for r in ranks.values()) for i in range(a.steps)]
            step_s[name] = _median(per_round)
            console.print(f"  {name}: " + ", ".join(f"{x:.2f}" for x in per_round))
    console.print("[bold]memory[/]: activations (TP model), tp 2 × fsdp 2, tp 2 × pp 2 × fsdp 2 …")
    mem = _memory_phase(a, opts)
    result = {"options": opts, "model": {**CONFIG, "n_layer": a.layers}, "params": mem.pop("params"),
              "cores": os.cpu_count(), "step_s": step_s, "memory": mem["memory"], "activations": mem["A"],
              "goal": GOAL, "source": source, "wall_s": time.perf_counter() - start}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compose_speed.json").write_text(json.dumps(result, indent=2))
    (out / "compose_speed.md").write_text(_markdown(result))
    console.print(Markdown(_markdown(result)))


if __name__ == "__main__":
    main()
