"""Benchmark (not a test): memory per rank and step time of tensor parallelism × FSDP2 against tensor
parallelism × DDP, measured against the per-rank memory formula.

    python benchmarks/fsdp.py [--steps 10] [--mem-steps 3] [--layers 8] [--malloc glibc mmap]
                              [--configs fsdp fsdp_keep fsdp_nopf ddp] [--out benchmarks/results]

Model: the example nanoGPT (examples/nanogpt.py: 8 layers, dim 1024, 16 heads, vocab 8192 with the LM head
tied to the embedding, block 128, dropout 0, attention written out), 109.3M parameters; batch 2 × 64
tokens per data-parallel replica, AdamW (lr 1e-4, its default single-tensor CPU path), fp32. 4 gloo ranks
on this machine (torch's elastic launcher, tests/support/ranks.py), a (dp 2, tp 2) device mesh, one
intra-op thread per rank. The model is built inside ``autotp.empty_weights()`` (parameters on meta: a rank
only ever allocates its own shards), its local pieces initialised with ``normal_(0, 0.02)``, then
``mark_loaded``. Configurations, each in a launch of its own so that each process's peak is its own:

    fsdp          parallelize(fsdp=FSDPConfig(), mesh=mesh)                     reshard after forward, prefetch
    fsdp_keep     FSDPConfig(reshard_after_forward=False)                       blocks kept gathered to backward
    fsdp_nopf     FSDPConfig(prefetch=False)                                    no prefetch
    ddp           parallelize(tp_group=mesh["tp"]) + DistributedDataParallel(process_group=mesh["dp"])

Memory, per rank: the peak resident set size (``getrusage(RUSAGE_SELF).ru_maxrss``, KiB) at the end of
``--mem-steps`` training steps minus the RSS just before the model is built (after the imports, autotp's
and those ``parallelize`` makes lazily (torch.export, dynamo, FSDP) included, the process group, the mesh,
one small all-reduce on each of its groups, ``gc.collect()``). The kernel's high-water mark is reset at
that baseline (``/proc/self/clear_refs`` ← 5), so the peak is the peak since then. It includes what
``parallelize`` leaves behind (graphs, plans) and whatever the allocator keeps. Reported per rank, the
largest over the 4 ranks. Also reported: the peak of step ``--mem-steps`` alone (the mark reset again
just before it), the RSS and peak after setup, and the exact bytes of the training state after a step
(the local parameter tensors, their gradients, AdamW's state).

Each configuration runs twice (``--malloc``): ``glibc``, the allocator as it comes: what a user's process
shows, with glibc's retention (its mmap threshold rises to the size of each large block freed, up to
32 MiB, and blocks below it come from its heaps, which keep what is freed) and fragmentation; and
``mmap``, the ranks started with ``MALLOC_MMAP_THRESHOLD_=131072``: every allocation of 128 KiB or more
(every tensor that matters) gets a mapping of its own, returned to the system when freed, so the RSS
follows the live tensors: the allocator-independent measure, comparable with the formula. The memory
launches run ``--mem-steps`` steps.

The formula, per rank (t = 2, d = 2; L = the elements one TP rank holds: the sum over parameters of their
TP-local sizes, replicated parameters counted whole, a tied one once; U = the largest FSDP unit's gathered
bytes, 4 × its TP-local elements, over FSDP's own parameter groups: one per unit of
``autotp.tp_state(model).units`` (the blocks, and the modules read before and after them) and the root
(whatever no unit owns: here the embedding tied to the LM head)):

    fsdp          16·L/d + 2·U + A       weights, gradients, Adam's two moments sharded; the running unit and
                                         the prefetched one gathered
    fsdp_keep     16·L/d + 4·L + A       every unit stays gathered from its forward to its backward
    fsdp_nopf     16·L/d + U + A         one unit gathered at a time
    ddp           16·L + 4·L + A         everything whole on every dp rank, + DDP's gradient buckets (≈ 4·L)

Only ``fsdp`` and ``ddp`` are the issue's formulas; the other two follow from the same terms. Not in
them: the root, which FSDP keeps gathered from its forward to its backward, the unit's unsharded
gradients awaiting their reduce-scatter, FSDP's all-gather and reduce-scatter staging buffers, and the
fixed cost ``parallelize`` leaves behind.

A, the activations, is measured rather than estimated, in a launch of its own (``mmap`` setting) on the
same mesh: the TP-only model (no FSDP, no DDP, no optimizer) runs one warm-up training step, its gradients
are dropped, then its RSS is read before and after one more forward (the loss computed, backward not yet
run): A = RSS after − RSS before. FSDP does not change the activations (same per-replica batch, same TP
rewrite). Reported next to it as a check: the bytes autograd keeps for backward in that forward (every
storage a ``saved_tensors_hooks`` pack sees, once, the parameters' own left out: allocator-independent),
the same RSS difference on the cold first forward, and the peak over that forward and its backward.

Speed: a launch of its own (glibc as it comes) builds fsdp, fsdp_nopf and ddp side by side on each rank
and steps them in turns, ``--steps`` rounds (a barrier before each step, the order reversed every other
round), so that the three see the same machine load (the machine is shared and noisy: compare only
ratios from one run). A step (forward, backward, ``opt.step()``, ``zero_grad()``) is timed on every rank
from its barrier to its end, its time the slowest rank's; the median over rounds 2..``--steps`` (round 1
allocates Adam's state and first-call caches). The memory launches' own step times are reported too.

Writes ``OUT/fsdp.json`` and ``OUT/fsdp.md``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests" / "support")]

TP, DP = 2, 2
CONFIG = dict(n_layer=8, n_embd=1024, n_head=16, vocab_size=8192, block_size=128, dropout=0.0)
BATCH, SEQ = 2, 64  # per data-parallel replica
GOAL = 1.15  # measured / formula for fsdp
MiB = 2**20
CONFIGS = {  # name -> FSDPConfig kwargs (None: DDP), label
    "fsdp": ({}, "tp 2 × fsdp 2 (reshard after forward, prefetch)"),
    "fsdp_keep": ({"reshard_after_forward": False}, "tp 2 × fsdp 2, reshard_after_forward=False"),
    "fsdp_nopf": ({"prefetch": False}, "tp 2 × fsdp 2, prefetch=False"),
    "ddp": (None, "tp 2 × DDP (dp 2)"),
}


# -- memory probes ------------------------------------------------------------------------------------------

def rss() -> int:
    """Resident set size now, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak() -> int:
    """Peak resident set size since the process started or the last :func:`reset_peak`, bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> bool:
    """Set the kernel's high-water mark of this process back to its RSS now (Linux ≥ 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# -- on every rank ------------------------------------------------------------------------------------------

def _setup(opts: dict):
    """Mesh, this replica's batch, and the baseline: returns (mesh, (ids, targets), baseline RSS, reset ok)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torch._dynamo  # noqa: F401  what parallelize imports lazily, imported before the baseline
    import torch.distributed.fsdp  # noqa: F401
    import torch.export  # noqa: F401

    import autotp  # noqa: F401
    import nanogpt  # noqa: F401

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):  # the groups' first collective, before the baseline
        dist.all_reduce(torch.ones(1), group=mesh[dim].get_group())
    g = torch.Generator().manual_seed(1000 + mesh["dp"].get_local_rank())  # the same batch within a TP group
    batch = tuple(torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g) for _ in range(2))
    dist.barrier()
    gc.collect()
    base = rss()
    return mesh, batch, base, reset_peak()


def _build(opts: dict, mesh, batch, fsdp: dict | None):
    """The meta-built nanoGPT parallelized (FSDP with ``fsdp``'s options, else TP only), its local pieces
    initialised; returns (model, P: the unsharded model's parameter count)."""
    import torch

    import autotp
    from autotp.distributed.data_parallel import FSDPConfig
    from autotp.io.empty import mark_loaded
    from nanogpt import GPT, GPTConfig

    with autotp.empty_weights():
        model = GPT(GPTConfig(**{**CONFIG, "n_layer": opts["layers"]}))
    total = sum(p.numel() for p in model.parameters())  # a tied tensor once
    where = (dict(fsdp=FSDPConfig(**fsdp), mesh=mesh) if fsdp is not None
             else dict(tp_group=mesh["tp"].get_group()))
    model = autotp.parallelize(model, example_inputs=(batch, {}), **where)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).normal_(0, 0.02)
    mark_loaded(model)
    return model, total


def _tp_local(p) -> int:
    """Elements this TP rank holds of ``p``: an FSDP parameter is a DTensor over (dp, tp) whose global view
    is the TP shards side by side; a plain parameter is the TP shard itself."""
    if not hasattr(p, "placements"):
        return p.numel()
    return p.numel() // TP if p.placements[-1].is_shard() else p.numel()


def _accounting(model, fsdp: bool) -> dict:
    """L (TP-local elements) and, with FSDP, each unit's TP-local elements: FSDP's own parameter groups, one
    per ``fully_shard`` call (autotp's units, ``autotp.tp_state(model).units``, then the root, ``<root>``),
    labelled by the modules that share it."""
    from torch.distributed.fsdp import FSDPModule

    local = sum(_tp_local(p) for p in model.parameters())  # parameters() yields a tied tensor once
    units: dict[str, int] = {}
    if fsdp:
        groups: dict[int, list] = {}
        for name, m in model.named_modules():
            if not isinstance(m, FSDPModule):
                continue
            state = m._get_fsdp_state()
            group = state._fsdp_param_group
            if group is None:
                continue
            entry = groups.setdefault(id(state), [[], sum(_tp_local(fp.sharded_param) for fp in group.fsdp_params)])
            entry[0].append(name or "<root>")
        units = {"+".join(labels): n for labels, n in groups.values()}
    import autotp

    return {"local": local, "units": units, "autotp_units": list(autotp.tp_state(model).units or ())}


def _state_bytes(model, opt) -> dict:
    """Exact bytes of the training state this rank holds now (autotp.parallel.held: parameters' and gradients'
    local shards, AdamW's moments)."""
    from autotp.parallel.held import held_grads, held_params, held_state

    params = list(model.parameters())
    out = {"params": held_params(params).bytes, "grads": held_grads(params).bytes, "adam": held_state(opt).bytes}
    out["total"] = sum(out.values())
    return out


def train(name: str, opts: dict) -> dict:
    """One configuration on this rank: memory, state and step times."""
    import torch
    import torch.distributed as dist

    fsdp, _ = CONFIGS[name]
    mesh, (ids, targets), base, resettable = _setup(opts)
    t0 = time.perf_counter()
    model, total = _build(opts, mesh, (ids, targets), fsdp)
    acct = _accounting(model, fsdp is not None)
    if fsdp is None:
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["dp"].get_group())
    setup_s = time.perf_counter() - t0
    after_setup, setup_peak = rss(), peak()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, losses, state = [], [], None
    before_last = None
    for step in range(1, opts["steps"] + 1):
        if step == opts["mem_steps"]:
            before_last = peak()
            reset_peak()  # this step's own peak from here
        dist.barrier()
        t = time.perf_counter()
        loss = model(ids, targets)[1]
        loss.backward()
        opt.step()
        if step == opts["mem_steps"]:
            state = _state_bytes(model, opt)
        opt.zero_grad()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
        if step == opts["mem_steps"]:
            step_peak = peak()
            # the peak since the baseline: before this step's reset, or during this step
            cumulative = max(before_last, step_peak) if resettable else step_peak
    return {"baseline": base, "peak": cumulative - base, "step_peak": step_peak - base if resettable else None,
            "setup_peak": setup_peak - base, "after_setup": after_setup - base, "setup_s": setup_s,
            "state": state, "times": times, "losses": losses, "params": total, **acct}


TIMED = ("fsdp", "fsdp_nopf", "ddp")


def timing(opts: dict) -> dict:
    """Step times of the ``TIMED`` configurations, built side by side in this process and stepped in turns
    (a barrier before each step, the order reversed every other round), so that all see the same load."""
    import torch
    import torch.distributed as dist

    mesh, (ids, targets), base, _ = _setup(opts)
    runs = {}
    for name in TIMED:
        fsdp = CONFIGS[name][0]
        model, _ = _build(opts, mesh, (ids, targets), fsdp)
        if fsdp is None:
            model = torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["dp"].get_group())
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    times: dict[str, list[float]] = {name: [] for name in TIMED}
    for rnd in range(opts["steps"]):
        for name in (TIMED if rnd % 2 == 0 else TIMED[::-1]):
            model, opt = runs[name]
            dist.barrier()
            t = time.perf_counter()
            loss = model(ids, targets)[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            times[name].append(time.perf_counter() - t)
    return {"times": times, "peak": peak() - base}


def activations(opts: dict) -> dict:
    """A: the TP-only model's RSS growth over one forward (after a warm-up step), saved-for-backward bytes."""
    import torch

    mesh, (ids, targets), base, _ = _setup(opts)
    model, _ = _build(opts, mesh, (ids, targets), None)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out = {}
    for rnd in ("cold", "warm"):
        model.zero_grad(set_to_none=True)
        gc.collect()
        before = rss()
        reset_peak()
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                storages[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, targets)[1]
        after = rss()
        loss.backward()
        out[rnd] = {"forward": after - before, "saved": sum(storages.values()), "peak": peak() - before}
        del loss
    return out


# -- the report ---------------------------------------------------------------------------------------------

MALLOC = {  # environment of the ranks per allocator setting (glibc reads it at process start)
    "glibc": {},
    # every allocation of ≥ 128 KiB its own mapping, returned on free (no dynamic threshold, no retention)
    "mmap": {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)},
}


def formula(name: str, r: dict, act: float) -> dict:
    """The per-rank formula's terms for configuration ``name`` from rank result ``r``."""
    local = r["local"]
    largest = 4 * max(r["units"].values()) if r["units"] else 0
    if name == "ddp":
        terms = {"16·L": 16 * local, "buckets 4·L": 4 * local}
    else:
        gathered = {"fsdp": ("2·U", 2 * largest), "fsdp_keep": ("4·L", 4 * local), "fsdp_nopf": ("U", largest)}[name]
        terms = {"16·L/d": 16 * local / DP, gathered[0]: gathered[1]}
    terms["A"] = act
    return {"terms": terms, "total": sum(terms.values()), "largest_unit": largest}


def _mib(x: float) -> str:
    return f"{x / MiB:.0f}"


def _markdown(res: dict) -> str:
    o, rows, a = res["options"], res["rows"], res["activations"]
    modes = o["malloc"]
    head = {"glibc": "glibc default", "mmap": "≥128 KiB mmapped"}
    fs = next(r for r in rows if r["name"] == "fsdp")
    ddp = next(r for r in rows if r["name"] == "ddp")
    lines = [
        "# Tensor parallelism × FSDP2 vs × DDP: memory per rank and step time",
        "",
        f"nanoGPT {res['model']}: {res['params'] / 1e6:.1f}M parameters, L = {res['local'] / 1e6:.2f}M elements "
        f"per TP rank; batch {BATCH}×{SEQ} per replica, AdamW, fp32; {TP * DP} gloo ranks on a (dp {DP}, tp {TP}) "
        f"mesh, one thread each, {os.cpu_count()} cores. Peak per rank: ru_maxrss at the end of {o['mem_steps']} "
        "training steps − RSS just before the model is built, the largest over the ranks, with glibc's malloc as "
        "it comes and with MALLOC_MMAP_THRESHOLD_=131072 (each allocation of ≥ 128 KiB mapped on its own and "
        "unmapped when freed: the RSS then follows the live tensors instead of what malloc keeps). Step: "
        f"{', '.join(TIMED)} built side by side in one launch and stepped in turns, median of rounds 2..{o['steps']}, "
        f"each step's time the slowest rank's (that launch's peak RSS per rank: {res['timing_peak'] / MiB:.0f} MiB); "
        f"own launch: median of steps 2..{o['mem_steps']} of the memory launch (glibc), load not shared.",
        "",
        "| config | " + " | ".join(f"peak/rank MiB ({head[m]})" for m in modes) + " | formula MiB | "
        + " | ".join(f"measured / formula ({head[m]})" for m in modes)
        + " | peak vs DDP | step s (in turns) | step vs DDP | step s (own launch) |",
        "|---|" + "---|" * (2 * len(modes) + 5),
    ]
    for row in rows:
        lines.append(f"| {row['label']} | " + " | ".join(_mib(row["peak"][m]) for m in modes)
                     + f" | {_mib(row['formula'])} | " + " | ".join(f"{row['ratio'][m]:.3f}" for m in modes)
                     + " | " + " / ".join(f"{row['vs_ddp'][m]:.2f}" for m in modes)
                     + (f" | {row['step_s']:.2f} | {row['vs_ddp_step']:.2f}" if row["step_s"] is not None
                        else " | – | –")
                     + f" | {row['own_step_s']:.2f} |")
    nopf = next((r for r in rows if r["name"] == "fsdp_nopf"), None)
    lines += [
        "",
        "fsdp measured / formula: " + ", ".join(f"{fs['ratio'][m]:.3f} ({head[m]})" for m in modes)
        + f"; goal ≤ {GOAL}. Step time fsdp / ddp {fs['vs_ddp_step']:.2f}"
        + (f", fsdp with prefetch / without {fs['step_s'] / nopf['step_s']:.2f}." if nopf else "."),
        "",
        f"Formula terms, MiB (L: TP-local elements, d = {DP}; U: the largest unit's gathered bytes, "
        f"{fs['largest_unit'] / MiB:.1f} MiB ({max(fs['units'], key=fs['units'].get)}); A: activations). FSDP's "
        f"units, gathered MiB: " + ", ".join(f"{u} {4 * n / MiB:.1f}" for u, n in fs["units"].items())
        + f" (sum {4 * sum(fs['units'].values()) / MiB:.1f} = 4·L {4 * fs['local'] / MiB:.1f}). The root stays "
        "gathered from its forward to its backward (FSDP's default for the root), which the formula leaves out.",
        "",
        "| config | allocator | formula terms | state after a step: params + grads + Adam (exact) | "
        f"peak of step {o['mem_steps']} alone | RSS after setup | setup peak | setup s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for m in modes:
            d = row["detail"][m]
            st = d["state"]
            terms = " + ".join(f"{k} {_mib(v)}" for k, v in row["terms"].items())
            lines.append(f"| {row['name']} | {head[m]} | {terms} = {_mib(row['formula'])} | {_mib(st['params'])} + "
                         f"{_mib(st['grads'])} + {_mib(st['adam'])} = {_mib(st['total'])} | {_mib(d['step_peak'])} | "
                         f"{_mib(d['after_setup'])} | {_mib(d['setup_peak'])} | {d['setup_s']:.1f} |")
    lines += [
        "",
        "Activations A (the TP-only model, ≥128 KiB mmapped, largest over the ranks): RSS growth over a forward "
        f"after a warm-up step {a['warm']['forward'] / MiB:.1f} MiB (A in the formula); over the cold first forward "
        f"{a['cold']['forward'] / MiB:.1f} MiB; bytes autograd saves for backward {a['warm']['saved'] / MiB:.1f} MiB; "
        f"peak over forward and backward {a['warm']['peak'] / MiB:.1f} MiB.",
        "",
        "Notes:",
        "",
        *([f"- glibc's malloc as it comes: fsdp's peak is {fs['peak']['glibc'] / fs['peak']['mmap']:.2f}× its peak "
           f"with tensors mmapped, ddp's {ddp['peak']['glibc'] / ddp['peak']['mmap']:.2f}×. FSDP frees and allocates "
           "unit-sized buffers (gathered parameters, unsharded gradients, collective staging) several times a step; "
           "once glibc's dynamic mmap threshold has risen past their sizes they come from its heaps, which keep "
           "the freed memory and fragment."] if "mmap" in modes else []),
        "- prefetch=False sets no explicit prefetching; FSDP2 then still prefetches one unit in backward by default "
        "(``FSDPState._pre_backward``: default_prefetch when no backward prefetch is set), so two blocks are "
        "gathered at once in backward either way: the formula's U for fsdp_nopf counts one block fewer than "
        "backward holds.",
        "- Not in the formulas: the root kept gathered, the running unit's unsharded gradients before their "
        "reduce-scatter, FSDP's staging buffers, what parallelize leaves behind (RSS after setup − the parameters).",
        "",
        "Step times in turns, s (slowest rank per step): "
        + "; ".join(f"{r['name']} " + ", ".join(f"{t:.2f}" for t in r["times"]) for r in rows if r["times"]) + ".",
        *([f"Environment given to the ranks besides: {res['environment']}."] if res["environment"] else []),
        "",
        f"autotp: HEAD {res['source']['commit'][:12]} when the run began, sources digest {res['source']['sources']}"
        + (" (the sources changed during the run)." if res["source_changed_during_run"] else
           " (unchanged during the run)."),
        "",
        "Reproduce: `python benchmarks/fsdp.py" + "".join(
            f" --{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in o.items() if v != DEFAULTS[k])
        + f"` (this run: {res['wall_s']:.0f} s).",
    ]
    return "\n".join(lines) + "\n"


DEFAULTS = {"steps": 10, "mem_steps": 3, "layers": CONFIG["n_layer"], "malloc": list(MALLOC), "configs": list(CONFIGS)}


def _launch(mode: str, fn, *args) -> dict:
    """``fn(*args)`` on the ranks with allocator setting ``mode``."""
    from ranks import launch

    from autotp.distributed.launch import _environ  # the launcher's own: workers copy this environment

    with _environ(MALLOC[mode]):
        return launch(fn, TP * DP, *args)


def _source_version() -> dict:
    """The commit, and a digest of the package's sources as they are on disk (others may edit them meanwhile)."""
    import hashlib
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = ""
    digest = hashlib.sha1()
    for path in sorted([*ROOT.glob("autotp/**/*.py"), *ROOT.glob("passes/**/*.py")]):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return {"commit": commit, "sources": digest.hexdigest()[:12]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    ap.add_argument("--mem-steps", type=int, default=DEFAULTS["mem_steps"])
    ap.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    ap.add_argument("--malloc", nargs="+", choices=list(MALLOC), default=DEFAULTS["malloc"])
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=DEFAULTS["configs"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    if a.mem_steps < 2 or a.steps < 2:
        ap.error("need --mem-steps >= 2 and --steps >= 2")
    if not set(TIMED) <= set(a.configs) or "glibc" not in a.malloc:
        ap.error(f"--configs needs {', '.join(TIMED)}, --malloc needs glibc")
    opts = {"steps": a.steps, "mem_steps": a.mem_steps, "layers": a.layers,
            "malloc": [m for m in MALLOC if m in a.malloc], "configs": [c for c in CONFIGS if c in a.configs]}

    from rich.console import Console
    from rich.markdown import Markdown

    console = Console(width=160)
    start = time.perf_counter()
    source = _source_version()
    console.print("[bold]activations[/] (TP-only model) …")
    act_ranks = _launch("mmap", activations, opts)
    act = {rnd: {k: max(r[rnd][k] for r in act_ranks.values()) for k in act_ranks[0][rnd]}
           for rnd in ("cold", "warm")}
    console.print(f"  A = {act['warm']['forward'] / MiB:.1f} MiB (saved for backward {act['warm']['saved'] / MiB:.1f})")
    runs: dict[str, dict[str, dict]] = {}
    for name in opts["configs"]:
        for mode in opts["malloc"]:
            console.print(f"[bold]{name}[/] ({mode}): {CONFIGS[name][1]} …")
            ranks = runs.setdefault(name, {})[mode] = _launch(mode, train, name, {**opts, "steps": opts["mem_steps"]})
            console.print(f"  peak {max(r['peak'] for r in ranks.values()) / MiB:.0f} MiB, steps "
                          f"{', '.join(f'{t:.2f}' for t in ranks[0]['times'])} s, losses "
                          f"{', '.join(f'{x:.3f}' for x in ranks[0]['losses'])}")
    console.print(f"[bold]timing[/]: {', '.join(TIMED)} side by side, {opts['steps']} rounds …")
    timed_ranks = _launch("glibc", timing, opts)
    timed = {name: [max(r["times"][name][i] for r in timed_ranks.values()) for i in range(opts["steps"])]
             for name in TIMED}
    console.print("  " + "; ".join(f"{n} " + ", ".join(f"{t:.2f}" for t in ts) for n, ts in timed.items()))
    A = act["warm"]["forward"]
    rows = []
    for name in opts["configs"]:
        label = CONFIGS[name][1]
        per_mode = runs[name]
        r0 = per_mode["glibc"][0]
        f = formula(name, r0, A)
        detail = {}
        for mode, ranks in per_mode.items():
            steps = [max(r["times"][i] for r in ranks.values()) for i in range(len(ranks[0]["times"]))]
            detail[mode] = {
                "peak": max(r["peak"] for r in ranks.values()),
                "peak_per_rank": {str(k): r["peak"] for k, r in ranks.items()},
                "step_peak": max(r["step_peak"] or 0 for r in ranks.values()),
                "after_setup": max(r["after_setup"] for r in ranks.values()),
                "setup_peak": max(r["setup_peak"] for r in ranks.values()),
                "setup_s": max(r["setup_s"] for r in ranks.values()),
                "state": max((r["state"] for r in ranks.values()), key=lambda s: s["total"]),
                "times": steps, "step_s": statistics.median(steps[1:]), "losses": ranks[0]["losses"],
            }
        rows.append({"name": name, "label": label, "formula": f["total"], "terms": f["terms"],
                     "largest_unit": f["largest_unit"], "local": r0["local"], "units": r0["units"],
                     "autotp_units": r0["autotp_units"],
                     "peak": {m: d["peak"] for m, d in detail.items()},
                     "times": timed.get(name), "step_s": statistics.median(timed[name][1:]) if name in timed else None,
                     "own_step_s": detail["glibc"]["step_s"], "detail": detail})
    ddp = next(r for r in rows if r["name"] == "ddp")
    for row in rows:
        row["ratio"] = {m: p / row["formula"] for m, p in row["peak"].items()}
        row["vs_ddp"] = {m: p / ddp["peak"][m] for m, p in row["peak"].items()}
        row["vs_ddp_step"] = row["step_s"] / ddp["step_s"] if row["step_s"] is not None else None
        row["own_vs_ddp_step"] = row["own_step_s"] / ddp["own_step_s"]
    fs = next(r for r in rows if r["name"] == "fsdp")
    result = {
        "options": opts, "model": {**CONFIG, "n_layer": a.layers}, "batch": [BATCH, SEQ], "tp": TP, "dp": DP,
        "params": runs["fsdp"]["glibc"][0]["params"], "local": fs["local"],
        "root_gathered": 4 * fs["units"].get("<root>", 0), "activations": act,
        "activations_per_rank": {str(k): v for k, v in act_ranks.items()}, "rows": rows, "goal": GOAL,
        "goal_met": {m: r <= GOAL for m, r in fs["ratio"].items()}, "wall_s": time.perf_counter() - start,
        "environment": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "source": source, "source_changed_during_run": _source_version()["sources"] != source["sources"],
        "timing_peak": max(r["peak"] for r in timed_ranks.values()),
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fsdp.json").write_text(json.dumps(result, indent=2))
    (out / "fsdp.md").write_text(_markdown(result))
    console.print(Markdown(_markdown(result)))


if __name__ == "__main__":
    main()
