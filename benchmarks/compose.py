"""Benchmark (not a test): the composition matrix. Where two dimensions meet, does each still do what it is for?
Every supported pair, and every dimension at once as far as this machine's ranks go, checked for six effects:

    (a) exact         the loss of each step, every gradient (last step) and every parameter after the AdamW
                      steps equal the unsharded model's on the whole batch (fp32, within 1e-5)
    (b) held          per rank, the parameters, gradients and AdamW moments it holds (autotp.parallel.held,
                      the summary's accessor) equal the formula: over the ranks that share one (pp, tp) place,
                      copies × Σ of that place's tp shards (P/t for a sharded tensor, P for one kept whole),
                      copies = dp·cp replicas under DDP and 1 under FSDP (which shards over them); so the sum
                      over one replica's ranks is P_sharded + t·P_replicated; gradients = parameters,
                      moments = 2 × parameters
    (c) recompute     with activation checkpointing, the activation peak of a training step
                      (benchmarks/activation_memory.py's ActivationPeak) below the same layout's without it
    (d) replicas      after the steps, every tensor two ranks should hold alike is bit-identical: over dp and
                      cp under DDP (replicas), and a tensor the tp group keeps whole over tp
    (e) collectives   one step's collectives, counted per group, equal the plan's: over tp the plan's
                      collectives (× micro-batches through a pipeline, summed over its stages; a checkpointed
                      block's forward ones once more in the backward, all but its output's reduction, which
                      torch's recomputation stops before); over dp DDP's all-reduces carry each
                      gradient element once, FSDP's all-gathers and reduce-scatters are
                      autotp.reports.sharding.fsdp_report's (one of each per stage and step through a pipeline);
                      over cp one all-reduce of the gradients (without FSDP), the loss's sum and count (one
                      element each), and each ring attention's K and V,
                      2·b·s·h_kv elements gathered forward and again backward; over pp each micro-batch's
                      hidden state sent to the next stage and its gradient back, (b/m)·s·h elements (/t with
                      sequence parallelism)
    (f) FLOPs / MFU   the FLOPs ``autotp shard``'s summary prints (cli/shard.py's preflight, the same call, for
                      the row's layout) counted, and its MFU from them, the row's median step and an H100's peak
                      (``--shard``: from the summary.json of a real ``autotp shard`` run of the row instead)

Model: benchmarks/compose_models.py (a 4-block GPT, width 32, that checkpoints its blocks when the row
recomputes; the expert row a 4-expert MoE LM), batch 4 × 12 split over the dp replicas, pipelines in 2
micro-batches (1F1B), AdamW lr 1e-3, gloo ranks on this machine, one launch per world size
(tests/support/ranks.py), each row a job of its own.

    python benchmarks/compose.py [--quick] [--shard] [--rows NAME ...] [--evaluate JSON] [--out benchmarks/results]

``--quick`` leaves out the 8-rank row. Writes ``OUT/compose.json`` (with what each rank recorded, which
``--evaluate`` checks again without launching) and ``OUT/compose.md``; a failing check is written as failing,
with its number.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests" / "support")]

STEPS, LR, EPS, TOL, MICRO = 2, 1e-3, 1e-6, 1e-5, 2
MODELS = ROOT / "benchmarks" / "compose_models.py"
PEAK = "h100"  # the device MFU is reported against (a CPU run is far below it: the check is that it is there)


@dataclass(frozen=True)
class Row:
    name: str
    world: int
    tp: int = 1
    dp: int = 1
    pp: int = 1
    cp: int = 1
    fsdp: bool = False
    sp: bool = False
    ep: bool = False
    rc: bool = False
    compile: bool = False

    def flags(self) -> list[str]:
        """The row as ``autotp shard`` options."""
        out = ["--tp", str(self.tp), "--dp", str(self.dp)]
        out += ["--pp", str(self.pp)] if self.pp > 1 else []
        out += ["--cp", str(self.cp)] if self.cp > 1 else []
        for on, flag in ((self.fsdp, "--fsdp"), (self.sp, "--sequence-parallel"), (self.ep, "--expert-parallel"),
                         (self.compile, "--compile")):
            out += [flag] if on else []
        return out


ROWS = (
    Row("tp × dp (DDP)", 4, tp=2, dp=2),
    Row("tp × fsdp", 4, tp=2, dp=2, fsdp=True),
    Row("tp × sp", 2, tp=2, sp=True),
    Row("tp × pp", 4, tp=2, pp=2),
    Row("tp × cp", 4, tp=2, cp=2),
    Row("tp × ep", 2, tp=2, ep=True),
    Row("fsdp × recompute", 2, dp=2, fsdp=True, rc=True),
    Row("pp × recompute", 2, pp=2, rc=True),
    Row("cp × sp", 4, tp=2, cp=2, sp=True),
    Row("cp × compile", 2, cp=2, compile=True),
    Row("tp × fsdp × pp × sp × recompute", 8, tp=2, dp=2, pp=2, fsdp=True, sp=True, rc=True),
)


# -- on every rank -----------------------------------------------------------------------------------------

def _group_log(dims: dict[str, tuple[int, ...]]):
    """A dispatch mode recording every collective as (group, direction, kind, op, elements): group the mesh
    dim whose ranks it ran over ("tp", "dp", "cp", "pp", or the ranks), direction "backward" inside autograd's
    backward. An all-gather counts its output, a reduce-scatter its input: the whole tensor."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.utils._python_dispatch import TorchDispatchMode

    by_ranks = {ranks: dim for dim, ranks in dims.items()}
    ops = {0: "sum", 1: "avg", 2: "product", 3: "min", 4: "max"}

    def group(pg) -> str:
        ranks = tuple(dist.get_process_group_ranks(pg))
        return by_ranks.get(ranks, str(ranks))

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, str, str, str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name, ns = func.__name__.split(".")[0].rstrip("_"), func.namespace
            found = None
            if ns == "_c10d_functional" and name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor",
                                                     "all_to_all_single"):
                pg = _resolve_process_group(args[-1])
                kind = {"reduce_scatter_tensor": "reduce_scatter", "all_gather_into_tensor": "all_gather"}.get(name, name)
                n = args[0].numel() * (args[1] if kind == "all_gather" else 1)
                found = (group(pg), kind, args[1] if kind in ("all_reduce", "reduce_scatter") else "", n)
            elif ns == "c10d" and name == "allreduce":
                found = (group(dist.ProcessGroup.unbox(args[1])), "all_reduce", ops.get(args[2].op(), "?"),
                         sum(t.numel() for t in args[0]))
            elif ns == "c10d" and name == "_reduce_scatter_base":
                found = (group(dist.ProcessGroup.unbox(args[2])), "reduce_scatter", ops.get(args[3].op(), "?"),
                         args[1].numel())
            elif ns == "c10d" and name == "_allgather_base" and args[0].is_floating_point():
                found = (group(dist.ProcessGroup.unbox(args[2])), "all_gather", "", args[0].numel())
            elif ns == "c10d" and name == "send":  # a pipeline stage's activations or gradients
                found = (group(dist.ProcessGroup.unbox(args[1])), "send", "", sum(t.numel() for t in args[0]))
            if found is not None:
                backward = torch._C._current_graph_task_id() != -1
                self.calls.append((found[0], "backward" if backward else "forward", *found[1:]))
            return func(*args, **(kwargs or {}))

    return Log()


def _digest(t) -> str:
    from torch.distributed.tensor import DTensor

    local = (t.to_local() if isinstance(t, DTensor) else t).detach().contiguous()
    return hashlib.sha1(local.numpy().tobytes()).hexdigest()


def row_job(spec: dict) -> dict:
    """One row on this rank: the sharded model and the unsharded one trained side by side (see the module)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    import compose_models as cm
    from activation_memory import ActivationPeak
    from autotp.distributed.data_parallel import FSDPConfig
    from autotp.parallel.held import held_grads, held_params, held_state
    from autotp.reports.sharding import fsdp_report
    from recompute_workers import _expected, _full_or_local

    row = Row(**spec)
    torch.set_num_threads(1)
    if row.pp > 1:
        sizes, names = (row.pp, row.dp, row.tp), ("pp", "dp", "tp")
    elif row.cp > 1:
        sizes, names = (row.dp, row.cp, row.tp), ("dp", "cp", "tp")
    else:
        sizes, names = (row.dp, row.tp), ("dp", "tp")
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    coords = {n: mesh.get_local_rank(n) for n in names}
    dims = {n: tuple(dist.get_process_group_ranks(mesh[n].get_group())) for n in names}
    idx, targets = cm.example_batch()
    d = coords["dp"]
    mine = (idx.chunk(row.dp)[d].contiguous(), targets.chunk(row.dp)[d].contiguous())

    def build(recompute: bool):
        return cm.build_moe() if row.ep else cm.build_model() if recompute else cm.build_plain()

    def make(recompute: bool):
        model = build(recompute)
        if row.pp > 1:
            pipe = autotp.pipeline(model, example_inputs=mine, microbatches=MICRO, schedule="1F1B", mesh=mesh,
                                   compile=row.compile, fsdp=row.fsdp, sequence_parallel=row.sp,
                                   expert_parallel=row.ep)
            return model, pipe, lambda: pipe.step(*mine), dict(pipe.named_parameters())
        extra = {"context_parallel": row.cp} if row.cp > 1 else {}
        model = autotp.parallelize(model, example_inputs=mine, mesh=mesh, compile=row.compile,
                                   fsdp=FSDPConfig() if row.fsdp else False, sequence_parallel=row.sp,
                                   expert_parallel=row.ep, **extra)

        def step():
            loss = model(*mine)[1]
            loss.backward()
            return loss
        return model, model, step, dict(model.named_parameters())

    t0 = time.perf_counter()
    model, runner, step, named = make(row.rc)
    build_s = time.perf_counter() - t0
    st = autotp.tp_state(model)
    ref = build(row.rc)
    ref_named = dict(ref.named_parameters())
    params = list(named.values())
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    out: dict = {"coords": coords, "loss": 0.0, "grad": 0.0, "times": []}
    calls: list = []
    for s in range(STEPS):
        log = _group_log(dims) if s == STEPS - 1 else contextlib.nullcontext()
        dist.barrier()
        begin = time.perf_counter()
        with log:
            loss = step()
        out["times"].append(time.perf_counter() - begin)
        if s == STEPS - 1:
            calls = log.calls
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=mesh["dp"].get_group())  # the replicas' means: the whole batch's
        loss /= row.dp
        ref_loss = ref(idx, targets)[1]
        ref_loss.backward()
        out["loss"] = max(out["loss"], (loss - ref_loss.detach()).abs().item())
        if s == STEPS - 1:
            for n, p in named.items():
                want = ref_named[n].grad
                got = None if p.grad is None else _full_or_local(p.grad)
                if got is None or want is None:
                    out["grad"] = max(out["grad"], 0.0 if got is None and want is None else float("inf"))
                    continue
                out["grad"] = max(out["grad"], (got - _expected(want, n, model, row.fsdp)).abs().max().item())
            out["held"] = {"params": held_params(params).elements, "grads": held_grads(params).elements}
        opt.step()
        ref_opt.step()
        if s == STEPS - 1:
            out["held"]["state"] = held_state(opt).elements
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    out["param"] = max((_full_or_local(p) - _expected(ref_named[n], n, model, row.fsdp)).abs().max().item()
                       for n, p in named.items())
    # (b): this place's tp shards, from the plan and the unsharded sizes
    out["place"] = sum(st.shards[n].shard(ref_named[n], st.tp, st.rank).numel() if n in st.shards
                       else ref_named[n].numel() for n in named)
    out["unsharded"] = sum(p.numel() for p in ref.parameters())
    out["replicated"] = sum(p.numel() for n, p in ref_named.items() if n not in st.shards)
    # (d): what each rank holds, and whether the tp group keeps it whole
    out["digests"] = {n: (_digest(p), n not in st.shards) for n, p in named.items()}
    # (e): what was counted, and the plan's
    out["calls"] = calls
    out["plan"] = [(c.direction, c.kind, c.op, c.module) for c in st.plan.collectives]
    if row.fsdp and row.pp == 1:
        rep = fsdp_report(st.plan, ref.named_parameters(remove_duplicate=False), row.dp * row.cp)
        out["fsdp"] = [(t.direction, t.kind, t.count) for t in rep.traffic]
    out["stages"] = len(getattr(runner, "stages", ())) if row.pp > 1 else 0
    ctx = st.plan.context
    out["rings"] = [] if ctx is None else [r.node for r in ctx.attention]
    out["cp_losses"] = 0 if ctx is None else len(ctx.losses)  # each: its sum and its count all-reduced
    # each ring's K and V gathered whole: (b, h_kv / t, s, d) each, 2·b·s·h_kv / t elements
    out["kv"] = len(out["rings"]) * 2 * mine[0].shape[0] * cm.SEQ * cm.WIDTH // row.tp
    out["build_s"] = build_s
    # a micro-batch's hidden state, (b / m, s, h), s / t of it per rank with sequence parallelism
    out["micro_hidden"] = mine[0].shape[0] // MICRO * cm.SEQ * cm.WIDTH // (row.tp if row.sp else 1)
    # (c): the activation peak of one step, with the row's recomputation and without (a warm step first)
    if row.rc:
        peaks = {}
        plain_step = make(False)[2]
        for label, fn in (("rc", step), ("plain", plain_step)):
            fn()  # warm: FSDP's buffers, the pieces' graphs
            peak = ActivationPeak()
            with peak:
                fn()
            peaks[label] = peak.peak
            for p in [*params]:
                p.grad = None
        out["peaks"] = peaks
    return out


# -- in the launching process --------------------------------------------------------------------------------

def _check_exact(ranks: dict) -> tuple[bool, str]:
    worst = {k: max(r[k] for r in ranks.values()) for k in ("loss", "grad", "param")}
    ok = all(v <= TOL for v in worst.values())
    return ok, f"loss {worst['loss']:.1e}, grad {worst['grad']:.1e}, param {worst['param']:.1e}"


def _check_held(row: Row, ranks: dict) -> tuple[bool, str]:
    """Per (pp, tp) place: Σ over its ranks of what they hold = copies × the place's tp shards."""
    copies = 1 if row.fsdp else row.dp * row.cp
    places: dict[tuple, list] = defaultdict(list)
    for r in ranks.values():
        places[(r["coords"].get("pp", 0), r["coords"]["tp"])].append(r)
    bad = []
    for place, rs in places.items():
        want = copies * rs[0]["place"]
        got = {k: sum(r["held"][k] for r in rs) for k in ("params", "grads", "state")}
        if got["params"] != want or got["grads"] != want or got["state"] != 2 * want:
            bad.append(f"{place}: {got} vs {want}")
    r0 = next(iter(ranks.values()))
    # one replica: each place once (a tensor the tp group keeps whole on each of its t ranks)
    replica = sum(rs[0]["place"] for rs in places.values())
    formula = r0["unsharded"] + (row.tp - 1) * r0["replicated"]
    if replica != formula:
        bad.append(f"one replica {replica} vs P_sharded + t·P_replicated {formula}")
    held = [r["held"]["params"] for r in ranks.values()]
    what = f"{min(held)}–{max(held)} of {r0['unsharded']} elements per rank"
    return not bad, what if not bad else "; ".join(bad)


def _check_recompute(ranks: dict) -> tuple[bool | None, str]:
    if not all("peaks" in r for r in ranks.values()):
        return None, "n/a"
    worst = max(ranks.values(), key=lambda r: r["peaks"]["rc"] / max(1, r["peaks"]["plain"]))["peaks"]
    ok = all(r["peaks"]["rc"] < r["peaks"]["plain"] for r in ranks.values())
    return ok, f"{worst['rc'] / 1024:.1f} vs {worst['plain'] / 1024:.1f} KiB ({worst['rc'] / worst['plain']:.2f})"


def _check_replicas(row: Row, ranks: dict) -> tuple[bool | None, str]:
    """Tensors that must be alike: same name, same pp stage, same tp rank unless kept whole over tp, same dp
    and cp ranks under FSDP (whose shards differ)."""
    alike: dict[tuple, list] = defaultdict(list)
    for r in ranks.values():
        c = r["coords"]
        for name, (digest, whole) in r["digests"].items():
            key = (name, c.get("pp", 0), None if whole else c["tp"],
                   (c["dp"], c.get("cp", 0)) if row.fsdp else None)
            alike[key].append(digest)
    groups = [v for v in alike.values() if len(v) > 1]
    if not groups:
        return None, "n/a (no rank holds another's copy)"
    differ = sum(len(set(v)) > 1 for v in groups)
    return differ == 0, f"{differ} of {len(groups)} tensors held by several ranks differ"


def _check_collectives(row: Row, ranks: dict) -> tuple[bool, str]:
    bad, seen = [], Counter()
    r0 = ranks[0]
    # tp: the plan's, per micro-batch through each stage; a checkpointed block's forward ones again in backward
    if row.tp > 1:
        want = Counter((direction, kind, op) for direction, kind, op, _ in r0["plan"])
        if row.rc:  # a checkpointed block's forward collectives run again in its backward, all but the
            # reduction of its output (the last row-parallel sum, an all-reduce, or a reduce-scatter with sequence
            # parallelism): torch's recomputation stops once it has remade what the backward saved (early
            # stop), and the block's output is none of that
            blocks: dict[str, Counter] = defaultdict(Counter)
            for direction, kind, op, module in r0["plan"]:
                if direction == "forward" and module.startswith("blocks."):
                    blocks[".".join(module.split(".")[:2])][(kind, op)] += 1
            for found in blocks.values():
                found[("reduce_scatter" if row.sp else "all_reduce", "sum")] -= 1
                for (kind, op), n in found.items():
                    want[("backward", kind, op)] += n
        if row.pp > 1:
            want = Counter({k: v * MICRO for k, v in want.items()})
        mine = [r for r in ranks.values() if r["coords"]["tp"] == 0 and r["coords"]["dp"] == 0
                and r["coords"].get("cp", 0) == 0]  # one rank of each stage's tp group
        got = Counter((d, k, o) for r in mine for g, d, k, o, n in r["calls"] if g == "tp")
        seen["tp"] = sum(got.values())
        if got != want:
            bad.append(f"tp {dict(got)} vs plan {dict(want)}")
    for rank, r in ranks.items():
        grads = r["held"]["grads"]
        dp = [(k, n) for g, d, k, o, n in r["calls"] if g == "dp"]
        if row.dp > 1 and not row.fsdp:  # DDP: each gradient element once
            if sum(n for k, n in dp if k == "all_reduce") != grads or any(k != "all_reduce" for k, _ in dp):
                bad.append(f"rank {rank} dp {dp} vs {grads} gradient elements once")
        if row.fsdp:
            got = Counter(k for k, _ in dp)
            want = Counter({"all_gather": r["stages"], "reduce_scatter": r["stages"]}) if row.pp > 1 else \
                _fsdp_want(r)
            if got != want:
                bad.append(f"rank {rank} dp {dict(got)} vs FSDP's {dict(want)}")
        seen["dp"] += len(dp)
        if row.cp > 1:
            cp = [(d, k, n) for g, d, k, o, n in r["calls"] if g == "cp"]
            losses = [n for d, k, n in cp if k == "all_reduce" and d == "forward"]
            sums = [n for d, k, n in cp if k == "all_reduce" and d == "backward"]
            gathers = {d: sum(n for dd, k, n in cp if dd == d and k == "all_gather") for d in ("forward", "backward")}
            kv = r["kv"]
            if losses != [1] * (2 * r["cp_losses"]):
                bad.append(f"rank {rank} cp loss all-reduces {losses} vs {2 * r['cp_losses']} of one element")
            if not row.fsdp and sum(sums) != grads:
                bad.append(f"rank {rank} cp sums {sums} vs {grads} gradient elements")
            if kv is not None and gathers != {"forward": kv, "backward": kv}:
                bad.append(f"rank {rank} cp K/V gathered {gathers} vs {kv} each way")
            seen["cp"] += len(cp)
        if row.pp > 1:  # each micro-batch's hidden state to the next stage, its gradient back to the previous
            sends = [n for g, d, k, o, n in r["calls"] if g == "pp" and k == "send"]
            first, last = r["coords"]["pp"] == 0, r["coords"]["pp"] == row.pp - 1
            hidden = r["micro_hidden"]
            want = [hidden] * (MICRO * ((not last) + (not first)))
            if sorted(sends) != want:
                bad.append(f"rank {rank} pp sends {sends} vs {want}")
            seen["pp sends"] += len(sends)
    what = ", ".join(f"{g} {n}" for g, n in seen.items() if n) or "none"
    return not bad, (what + " per step, as planned") if not bad else "; ".join(bad)


def _fsdp_want(r: dict) -> Counter:
    want = Counter()
    for _, kind, count in r["fsdp"]:
        want[kind] += count
    return want


def _flops(row: Row, ranks: dict, shard: bool) -> tuple[bool, str, dict]:
    """The summary's FLOPs for the row's layout and its MFU (see the module)."""
    from autotp.capture.modelfile import load_model_file
    from autotp.cli.plan_auto import hardware
    from autotp.cli.shard import preflight
    from autotp.cli.train_log import mfu

    peak = hardware(PEAK).peak_flops
    if shard:
        summary = _shard_summary(row)
        flops, got = summary.get("step_flops"), summary.get("mfu")
    else:
        spec = f"{MODELS}:build_moe" if row.ep else str(MODELS)
        stages = (row.pp, MICRO) if row.pp > 1 else None
        flops = preflight(load_model_file(spec), row.tp, None, row.sp, row.ep, stages, row.cp)
        median = statistics.median(max(r["times"][i] for r in ranks.values()) for i in range(1, STEPS))
        # the replica's FLOPs per rank: a replica spans tp · pp · cp ranks
        got = mfu(flops / (row.tp * row.pp * row.cp) if flops else None, median, peak)
    ok = bool(flops) and got is not None and got > 0
    return ok, (f"{flops:.3g} FLOPs/step, MFU {100 * got:.1e}%" if ok else f"FLOPs {flops}, MFU {got}"), \
        {"flops": flops, "mfu": got}


def _shard_summary(row: Row) -> dict:
    """summary.json of ``autotp shard`` run on the row's layout (2 steps, no parity run)."""
    spec = f"{MODELS}:build_moe" if row.ep else str(MODELS)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "autotp.cli", "shard", spec, *row.flags(), "--steps", "2", "--no-verify",
               "--gpu", PEAK, "--out", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        path = Path(tmp) / "summary.json"
        if proc.returncode or not path.exists():
            return {"error": (proc.stdout + proc.stderr)[-2000:]}
        return json.loads(path.read_text())


def evaluate(row: Row, ranks: dict, shard: bool) -> dict:
    checks = {"exact": _check_exact(ranks), "held": _check_held(row, ranks), "recompute": _check_recompute(ranks),
              "replicas": _check_replicas(row, ranks), "collectives": _check_collectives(row, ranks)}
    ok, what, numbers = _flops(row, ranks, shard)
    checks["flops"] = (ok, what)
    step = statistics.median(max(r["times"][i] for r in ranks.values()) for i in range(1, STEPS))
    return {"row": asdict(row), "checks": {k: {"ok": v[0], "what": v[1]} for k, v in checks.items()},
            "step_s": step, **numbers}


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else "pass" if ok else "**FAIL**"


def _markdown(res: dict) -> str:
    names = ("exact", "held", "recompute", "replicas", "collectives", "flops")
    lines = [
        "# Where dimensions meet: each pairing checked for its effect",
        "",
        "benchmarks/compose_models.py's GPT (4 blocks, width 32, vocab 64; the expert row a 4-expert MoE LM), "
        f"batch 4 × 12 split over the dp replicas, pipelines {MICRO} micro-batches (1F1B), {STEPS} AdamW steps "
        f"against the unsharded model on the whole batch, gloo ranks on {res['cores']} CPU cores. "
        "(a) exact: loss, gradients, parameters (tol 1e-5); (b) held: parameters, gradients, AdamW moments per "
        "rank = copies × the place's tp shards; (c) recompute: activation peak with / without; (d) replicas "
        "bit-identical; (e) collectives per group = the plan's; (f) the summary's FLOPs and MFU "
        f"(against {PEAK}: {'autotp shard runs' if res['shard'] else 'preflight, as the summary counts them'}).",
        "",
        "| pairing | world | (a) exact | (b) held | (c) recompute | (d) replicas | (e) collectives | (f) FLOPs/MFU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        c = r["checks"]
        cells = [f"{_mark(c[n]['ok'])}: {c[n]['what']}" if c[n]["ok"] is not None else "n/a" for n in names]
        lines.append(f"| {r['row']['name']} | {r['row']['world']} | " + " | ".join(cells) + " |")
    failing = [f"{r['row']['name']} ({n})" for r in res["rows"] for n in names if r["checks"][n]["ok"] is False]
    lines += ["", f"Failing: {', '.join(failing)}." if failing else "Every check of every row passes.", "",
              f"autotp: HEAD {res['commit'][:12]}. Reproduce: `python benchmarks/compose.py"
              + (" --quick" if res["quick"] else "") + (" --shard" if res["shard"] else "")
              + f"` (this run: {res['wall_s']:.0f} s)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="leave out the 8-rank row")
    ap.add_argument("--shard", action="store_true", help="(f) from real `autotp shard` runs (slow)")
    ap.add_argument("--rows", nargs="*", default=None, help="only the rows whose name contains one of these")
    ap.add_argument("--evaluate", default=None, metavar="JSON", help="check again what a run's compose.json "
                    "recorded on its ranks, launching nothing")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    start = time.perf_counter()
    rows = [r for r in ROWS if not (a.quick and r.world > 4) and (a.rows is None or any(s in r.name for s in a.rows))]
    if a.evaluate:
        recorded = {x["row"]["name"]: {int(k): v for k, v in x["ranks"].items()}
                    for x in json.loads(Path(a.evaluate).read_text())["rows"]}
        rows = [r for r in rows if r.name in recorded]
    results = []
    for world in sorted({r.world for r in rows}):
        mine = [r for r in rows if r.world == world]
        if a.evaluate:
            ranks = {rank: {r.name: recorded[r.name][rank] for r in mine} for rank in range(world)}
        else:
            from ranks import launch, run_jobs

            print(f"{world} ranks: {', '.join(r.name for r in mine)} …", flush=True)
            ranks = launch(run_jobs, world, {r.name: (row_job, asdict(r)) for r in mine})
        for r in mine:
            by_rank = {rank: jobs[r.name] for rank, jobs in ranks.items()}
            got = {**evaluate(r, by_rank, a.shard), "ranks": by_rank}
            results.append(got)
            print(f"  {r.name}: " + ", ".join(f"{k} {_mark(v['ok'])} ({v['what']})" for k, v in got["checks"].items()),
                  flush=True)
    order = {r.name: i for i, r in enumerate(ROWS)}
    results.sort(key=lambda x: order[x["row"]["name"]])
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    res = {"rows": results, "cores": os.cpu_count(), "quick": a.quick, "shard": a.shard, "commit": commit,
           "wall_s": time.perf_counter() - start}
    if a.evaluate:  # the run's own time and commit: nothing ran now
        before = json.loads(Path(a.evaluate).read_text())
        res.update(wall_s=before["wall_s"], commit=before["commit"], quick=before["quick"])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compose.json").write_text(json.dumps(res, separators=(",", ":"), default=str) + "\n")  # ranks included
    (out / "compose.md").write_text(_markdown(res))
    print(_markdown(res))


if __name__ == "__main__":
    main()
