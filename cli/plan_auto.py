"""``autotp plan --auto`` and ``autotp shard --auto``: capture the model once, plan it at every
tensor-parallel size a node allows, search the layouts (:mod:`autotp.search.auto`) and show the best.

The numbers are predictions of :mod:`autotp.search.cost` on a hardware profile: a preset (``--gpu a100`` or
``h100``, datasheet numbers) or a file ``autotp profile`` wrote on the machines themselves.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autotp.capture.modelfile import load_model_file, planning_batch
from autotp.cli.fit import FitTable
from autotp.cli.plan_command import Command, command
from autotp.cli.plan_format import fmt_size
from autotp.search.assumed import assumed_terms
from autotp.search.auto import Rejected, Search, Space, best_per_mesh, explain, mesh_name, search, tp_sizes
from autotp.search.cost import RESERVED, Estimate, Training
from autotp.search.model_costs import ModelCosts, capture_costs
from autotp.search.hardware import PRESETS, Hardware, resolve

DEFAULT_PROFILE = Path("autotp-profile.json")
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "bfloat16": 2, "float16": 2, "float32": 4}


class Auto(NamedTuple):
    costs: ModelCosts
    hardware: Hardware
    space: Space
    training: Training
    result: Search
    model: str = ""
    default_batch: bool = False  # the global batch is the default (one example batch per device)
    example_rows: int | None = None  # sequences in the model file's example batch (None: --batch replaced it)


def hardware(gpu: str | None) -> Hardware:
    """``--gpu``: a preset, a profile file, or (not given) ./autotp-profile.json when ``autotp profile`` wrote
    one. ValueError otherwise, naming what to give."""
    if gpu is not None:
        return resolve(gpu)
    if DEFAULT_PROFILE.exists():
        return resolve(str(DEFAULT_PROFILE))
    raise ValueError(f"--auto needs a hardware profile: give --gpu {'|'.join(PRESETS)}|PROFILE.json, or run "
                     f"`autotp profile` here first (it writes {DEFAULT_PROFILE})")


def act_bytes(hw: Hardware, autocast: str | None) -> int:
    """Bytes per activation element: the autocast asked for; else a profile's measured dtype; else bf16 on
    a GPU preset (GPU training runs under bf16 autocast)."""
    if autocast is not None:
        return _DTYPE_BYTES[autocast]
    return _DTYPE_BYTES.get(str(hw.extra.get("dtype", "bf16")), 2)


def run_search(model: str, world: int, gpus_per_node: int | None, hw: Hardware, batch: int | None,
               seq: int | None, global_batch: int | None, autocast: str | None, runnable: bool = False,
               max_micro_batch: int = 16, per_replica: bool = False) -> Auto:
    """Load and build MODEL_PY on meta, capture once, plan at each tp, search. ``global_batch`` None: one
    example batch per device (``world`` of them: one global batch for every layout compared); with
    ``per_replica``, one example batch per data-parallel replica (what ``autotp shard`` trains on)."""

    mf = load_model_file(model)
    with torch.device("meta"):
        net = mf.build()
    args, kwargs, b, s, _ = planning_batch(mf, net, batch, seq)
    g = gpus_per_node or min(world, hw.gpus_per_node)
    # every size a node allows: the heads are read from the graph, and the search keeps the sizes they allow
    costs = capture_costs(net, args, kwargs, tp_sizes(world, g, None), b, s)
    per_replica = per_replica and global_batch is None
    # autotp shard --auto runs what it chose and verifies it against the model's own dtype: no FSDP gathering
    # in a narrower one
    space = Space(world, g, b if per_replica else global_batch or world * b, max_micro_batch=max_micro_batch,
                  runnable=runnable, per_replica=per_replica, fsdp_mixed=(False,) if runnable else (False, True))
    act = act_bytes(hw, autocast)
    name = autocast or str(hw.extra.get("dtype", "bf16"))
    training = Training(act_bytes=act, seq=s, act_dtype={"bfloat16": "bf16", "float16": "fp16"}.get(name, name))
    return Auto(costs, hw, space, training, search(costs, hw, space, training), model,
                not per_replica and global_batch is None, b if batch is None else None)


def _gib(x: float) -> str:
    return fmt_size(int(x))


_SHORT = {"optimizer": "optim"}  # column headers of the terms


def top_table(auto: Auto, top: int) -> Table:
    hw, sp = auto.hardware, auto.space
    batch = f"{sp.batch} per replica" if sp.per_replica else f"global batch {sp.batch}" + (
        " (one example batch per device; --global-batch sets it)" if auto.default_batch else "")
    cap = _gib(auto.result.ranked[0].memory.capacity) if auto.result.ranked else "?"
    # the first columns say how fast and how full, the terms after "compute" what a step's time is made of
    table = FitTable(title=f"Layouts for {sp.world} devices ({sp.gpus_per_node} per node) on {hw.name}, {batch} × "
                           f"{auto.training.seq} tokens: predicted, best first (memory of {cap} usable per device)",
                     keys=2, breaks=(7,))
    shown = auto.result.ranked[:top]
    terms = [k for k in Estimate.TERMS if k != "cp comm" or any(e.candidate.cp > 1 for e in shown)]
    cols = ("#", "layout", "step", "tokens/s per dev", "TFLOP/s per dev", "% peak", "memory",
            *(_SHORT.get(k, k) for k in terms))
    for c in cols:  # a narrow console wraps a layout's label between its parts (tp4 dp2 ...), never a number
        table.add_column(c, justify="left" if c == "layout" else "right", no_wrap=c != "layout")
    for i, e in enumerate(shown, 1):
        mem = e.memory
        table.add_row(str(i), e.candidate.label(), _secs(e.step),
                      f"{e.tokens_per_device:,.0f}", f"{e.flops_per_device / 1e12:.1f}",
                      f"{e.flops_per_device / hw.peak_flops:.0%}", f"{_gib(mem.total)} ({mem.total / mem.capacity:.0%})",
                      *(_secs(e.terms()[k]) for k in terms))
    table.caption = ("layout: tp, cp (context parallel: each rank 1/cp of every sequence), dp (·fsdp: FSDP over "
                     "dp), pp (v: stages per rank), micro-batch × micro-batches per step, sp: sequence parallel, "
                     "rc: activations recomputed (the model's own checkpointing). Every layout listed is one autotp "
                     "runs. TFLOP/s: 3 × the forward's matmul FLOPs per step. memory: per rank (share of what is "
                     "usable). Terms per step; dp comm: the data-parallel collectives forward and backward do "
                     "not hide, with their buffer copies (each byte read and written once, at the copy rate "
                     "autotp profile measures, else at memory bandwidth). ·fsdp(bf16): FSDP gathers bf16 weights, "
                     "reduces in the model's dtype; keep: FSDP keeps weights gathered and gradients unsharded "
                     "through a step's micro-batches.")
    return table


def assumed_line(auto: Auto, top: int) -> str | None:
    """The terms of the rows shown that rest on numbers not measured on the device priced, said once each."""
    said: dict[str, str] = {}
    for e in auto.result.ranked[:top]:
        for term, why in assumed_terms(auto.hardware, e, auto.training).items():
            said.setdefault(term, why)
    if not said:
        return None
    if len(set(said.values())) == 1:
        return f"assumed, not measured on {auto.hardware.name}: {', '.join(said)} ({next(iter(said.values()))})"
    return f"assumed, not measured on {auto.hardware.name}: " + "; ".join(f"{k} ({v})" for k, v in said.items())


def _secs(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def rejected_table(auto: Auto, top: int = 5) -> Table | None:
    rejected = sorted(auto.result.rejected, key=lambda r: r.over)
    if not rejected:
        return None
    table = FitTable(title=f"{len(rejected)} of {auto.result.considered} layouts do not fit "
                           f"{_gib((1 - RESERVED) * auto.hardware.memory_bytes)} per device (the closest):")
    table.add_column("layout", no_wrap=True)
    table.add_column("why")
    for r in rejected[:top]:
        table.add_row(r.candidate.label(), r.reason)
    return table


def _duration(x: float) -> str:
    """Three significant digits in the unit that fits: a term's difference may be nanoseconds."""
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if x >= size:
            return f"{x / size:.3g} {unit}"
    return f"{x * 1e9:.3g} ns"


def beats_line(auto: Auto) -> str | None:
    """Why the best layout beats the best of another (tp, cp, pp): the terms that favour it, largest first, then
    those that favour the other. Per step when both train one global batch; per token when they do not (one
    example batch per data-parallel replica, autotp shard --auto), since their steps train different batches."""
    best, meshes = auto.result.best, best_per_mesh(auto.result)
    if best is None or len(meshes) < 2:
        return None
    other = meshes[1]
    s = auto.training.seq or 1
    same = best.tokens == other.tokens
    # seconds per step, or per token: every term over the tokens its step trains
    per = (lambda e, x: x) if same else (lambda e, x: x / e.tokens)
    diffs = {k: per(other, other.terms()[k]) - per(best, v) for k, v in best.terms().items()}
    eps = 1e-4 * per(best, best.step)  # a hundredth of a percent of the step: no term worth naming
    favour = sorted(((d, k) for k, d in diffs.items() if d > eps), reverse=True)
    against = sorted(((-d, k) for k, d in diffs.items() if d < -eps), reverse=True)
    unit = "per step" if same else "per token"
    batch = (f"both at {best.tokens // s:,} sequences per step" if same else
             f"its step trains {best.tokens // s:,} sequences, the other's {other.tokens // s:,}: compared per token")
    line = (f"{mesh_name(best.candidate)} beats the best {mesh_name(other.candidate)} layout ({other.candidate.label()}) by "
            f"{best.tokens_per_device / other.tokens_per_device - 1:.1%} tokens/s per device ({batch}): "
            + ", ".join(f"{k} {_duration(d)} less" for d, k in favour[:3]) + f" {unit}")
    if against:
        line += "; against it: " + ", ".join(f"{k} {_duration(d)} more" for d, k in against[:2])
    return line


def why(auto: Auto) -> list[str]:
    """The search's explanation, its line on the runner-up's mesh told by :func:`beats_line`."""
    mine = beats_line(auto)
    return [mine if mine is not None and " beats the best " in line else line for line in explain(auto.result)]


def render(console: Console, model: str, auto: Auto, top: int) -> None:
    f = auto.costs
    console.print(f"[bold]{escape(model)}[/bold]: {f.params:,} parameters, {f.layers} blocks, hidden {f.hidden}, "
                  f"heads {f.heads}, vocab {f.vocab}; planned at tp {', '.join(map(str, sorted(f.tps)))}; "
                  f"{auto.result.considered} layouts considered", soft_wrap=True)
    if auto.result.ranked:
        console.print(top_table(auto, top))
        assumed = assumed_line(auto, top)
        if assumed is not None:
            console.print(f"[dim]{escape(assumed)}[/dim]")  # wrapped to the console, as the tables fit it
    rej = rejected_table(auto)
    if rej is not None:
        console.print(rej)
    best = auto.result.best
    if best is not None:
        console.print(f"[bold green]best:[/bold green] {best.candidate.label()} — {_secs(best.step)} per step, "
                      f"{best.tokens_per_device:,.0f} tokens/s per device", soft_wrap=True)
    for line in why(auto):
        console.print(f"  {escape(line)}", soft_wrap=True)
    if best is not None:
        cmd = command(model, best.candidate, auto.space, auto.example_rows)
        if cmd.line is not None:
            console.print(f"[bold]run it:[/bold] {escape(cmd.line)}", soft_wrap=True)
        for note in cmd.notes:
            console.print(f"  {escape(note)}", soft_wrap=True)
        spelled = None if cmd.line is not None else spelled_best(auto)
        if spelled is not None:  # the best autotp shard spells, and what it costs against the best
            est, other = spelled
            console.print(f"[bold]run it:[/bold] the fastest layout autotp shard spells, {est.candidate.label()} "
                          f"({best.tokens_per_device / est.tokens_per_device - 1:.1%} slower): {escape(other.line)}",
                          soft_wrap=True)
            for note in other.notes:
                console.print(f"  {escape(note)}", soft_wrap=True)
    console.print(f"[dim]hardware: {escape(auto.hardware.source)}[/dim]", soft_wrap=True)


def spelled_best(auto: Auto) -> tuple[Estimate, Command] | None:
    """The fastest layout that ``autotp shard`` has a command line for, with it (None: none has one)."""
    for e in auto.result.ranked:
        cmd = command(auto.model, e.candidate, auto.space, auto.example_rows)
        if cmd.line is not None:
            return e, cmd
    return None


def to_dict(auto: Auto, top: int) -> dict:
    return {"hardware": auto.hardware.to_dict(), "space": auto.space.__dict__,
            "ranked": [{**e.to_dict(), "assumed": assumed_terms(auto.hardware, e, auto.training)}
                       for e in auto.result.ranked[:top]],
            # a rejected layout's terms rest on the same numbers as a ranked one's: labelled alike
            "rejected": [{**r.to_dict(), **({"assumed": assumed_terms(auto.hardware, r.estimate, auto.training)}
                                            if r.estimate is not None else {})}
                         for r in sorted(auto.result.rejected, key=_rejected_order)[:top]],
            "rejected_count": len(auto.result.rejected), "considered": auto.result.considered,
            "why": why(auto),
            "command": command(auto.model, auto.result.best.candidate, auto.space, auto.example_rows)._asdict()
            if auto.result.best
            else None, "spelled": _spelled_dict(auto)}


def _rejected_order(r: Rejected) -> float:
    """Fastest first (the JSON's order): one priced by tokens per second per device, one not priced last."""
    return -r.estimate.tokens_per_device if r.estimate is not None else 0.0


def _spelled_dict(auto: Auto) -> dict | None:
    """The fastest layout autotp shard spells, its command and its step (where the best has no command)."""
    best = auto.result.best
    if best is None or command(auto.model, best.candidate, auto.space).line is not None:
        return None
    spelled = spelled_best(auto)
    return None if spelled is None else {"label": spelled[0].candidate.label(), "step_s": spelled[0].step,
                                         "command": spelled[1]._asdict()}
