"""Benchmark (not a test): activation bytes per transformer layer and the K/V bytes each rank receives with
context parallelism, at a sequence long enough to matter (4096 tokens, tiny width), against the formulas.

    python benchmarks/context_parallel.py [--cp 2 4] [--seq 4096] [--batch 1] [--out benchmarks/results]

Activations are counted as benchmarks/activation_memory.py counts them: every storage autograd keeps for
backward in one forward (``saved_tensors_hooks``), each once, parameters out; a layer's bytes are (3 layers −
1 layer) / 2. The unsharded model runs in this process; ``autotp.parallelize(model, context_parallel=cp)`` on
cp gloo ranks (each rank measures its own; they agree). Two attentions: nanoGPT's SDPA path, and the example's
attention written out by hand, which the context rewrite runs as SDPA (its mask proven causal).

Formulas, per layer, fp32, no dropout (benchmarks/activation_memory.py derives the terms from Korthikanti et
al. 2022; its 72·sbh less the two residual-dropout masks' 8·sbh):

    unsharded (SDPA)   64·sbh + 4·asb + 16·sb           (4·asb: SDPA's log-sum-exp; 16·sb: LayerNorm statistics)
    cp ranks           (64·sbh + 4·asb + 16·sb) / cp    every saved tensor is of the rank's s/cp tokens

K/V received per layer by each rank: the forward's all-gather of K and V, 2·b·s·h_kv·4 bytes·(cp−1)/cp, and the
backward's as much again (it gathers K and V anew rather than keeping them: the ÷ cp above holds), counted
from the collectives a step runs.

Writes ``OUT/context_parallel.json`` and ``OUT/context_parallel.md``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "examples"), str(ROOT / "tests" / "support")]

import activation_memory  # noqa: E402 - its counting (saved_tensors_hooks, 3 layers − 1) and its model
from activation_memory import LAYERS, per_layer  # noqa: E402

HIDDEN, HEADS, VOCAB = 64, 4, 256
TOLERANCE = 0.10


def build(layers: int, attention: str, seq: int):
    return activation_memory.build(layers, attention, seq, HIDDEN, HEADS, VOCAB, dropout=0.0)


def batch(b: int, s: int):
    return activation_memory.batch(b, s, VOCAB)


def worker(opts: dict) -> dict:
    """On each rank: activation bytes per layer for both attentions, and the bytes one step gathers."""
    import torch.distributed as dist

    import autotp
    from ranks import CollectiveLog

    cp = dist.get_world_size()
    args = batch(opts["batch"], opts["seq"])
    out = {}
    for attention in ("sdpa", "matmul"):
        def make(n: int):
            return autotp.parallelize(build(n, attention, opts["seq"]), example_inputs=args, context_parallel=cp)
        out[attention] = per_layer(make, args)
        model = make(LAYERS[1])
        model(*args)[1].backward()  # the first call's input check is not a step's
        with CollectiveLog() as log:
            model(*args)[1].backward()
        gathered = sum(n for kind, _, n in log.calls if kind == "all_gather")  # elements, every rank's part
        out[f"{attention}/kv_received_per_layer"] = 4 * gathered * (cp - 1) / cp / LAYERS[1]
    everyone = [None] * cp
    dist.all_gather_object(everyone, out)
    return {"rank0": out, "ranks": everyone, "ranks_agree": all(o == out for o in everyone)}


def formula(b: int, s: int, h: int, a: int, cp: int) -> float:
    return (64 * s * b * h + 4 * a * s * b + 16 * s * b) / cp


def kv_formula(b: int, s: int, h: int, cp: int) -> float:
    """Bytes each rank receives per layer: K and V of the other ranks, forward and backward."""
    return 2 * (2 * b * s * h * 4 * (cp - 1) / cp)


def _markdown(r: dict) -> str:
    o = r["options"]
    lines = [
        "# Context parallelism: activation memory per layer and K/V traffic",
        "",
        f"nanoGPT, h={HIDDEN}, a={HEADS} heads, fp32, no dropout, batch {o['batch']}×{o['seq']}; bytes kept for "
        "backward (saved_tensors_hooks, each storage once, parameters out), per layer = (3 layers − 1 layer) / 2; "
        f"rank 0 of cp gloo ranks (all ranks agree: {all(v['ranks_agree'] for v in r['cp'].values())}). "
        "`matmul`: the example's attention written out, run as ring SDPA (its mask proven causal).",
        "",
        "| attention | cp | measured MiB | formula MiB | measured / formula | vs unsharded | K/V received / layer MiB "
        "| formula MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        kv = "-" if row["kv"] is None else f"{row['kv'] / 2**20:.3f}"
        kvf = "-" if row["kv"] is None else f"{row['kv_formula'] / 2**20:.3f}"
        lines.append(f"| {row['attention']} | {row['cp']} | {row['measured'] / 2**20:.3f} | "
                     f"{row['formula'] / 2**20:.3f} | {row['ratio']:.4f} | {row['vs_unsharded']:.3f} | {kv} | {kvf} |")
    lines += ["", f"Every measurement within {TOLERANCE:.0%} of its formula: {r['within_tolerance']}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    from ranks import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    opts = {"batch": a.batch, "seq": a.seq, "cp": a.cp}
    args = batch(a.batch, a.seq)
    unsharded = per_layer(lambda n: build(n, "sdpa", a.seq), args)
    cps = {str(c): launch(worker, c, opts)[0] for c in a.cp}
    rows = [{"attention": "sdpa", "cp": 1, "measured": unsharded, "kv": None}]
    for c in a.cp:
        for att in ("sdpa", "matmul"):
            rows.append({"attention": att, "cp": c, "measured": cps[str(c)]["rank0"][att],
                         "kv": cps[str(c)]["rank0"][f"{att}/kv_received_per_layer"],
                         "kv_formula": kv_formula(a.batch, a.seq, HIDDEN, c)})
    for row in rows:
        row["formula"] = formula(a.batch, a.seq, HIDDEN, HEADS, row["cp"])
        row["ratio"] = row["measured"] / row["formula"]
        row["vs_unsharded"] = row["measured"] / unsharded
    result = {"options": opts, "hidden": HIDDEN, "heads": HEADS, "rows": rows, "cp": cps,
              "within_tolerance": all(r["ratio"] <= 1 + TOLERANCE for r in rows)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "context_parallel.json").write_text(json.dumps(result, indent=2))
    (out / "context_parallel.md").write_text(_markdown(result))
    from rich.console import Console
    from rich.markdown import Markdown

    Console().print(Markdown(_markdown(result)))


if __name__ == "__main__":
    main()
