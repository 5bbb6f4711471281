"""The layout search against Megatron's published choices: Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM" (SC '21, arXiv:2104.04473), Table 1.

Each row of the table is a GPT (vocabulary 51,200, sequence 2,048, nodes of eight 80 GB A100s) with its
size, the GPUs and global batch it ran on, the tensor- and pipeline-parallel sizes Megatron chose, and the
throughput it reached per GPU. For each row this script builds the model on the meta device (a
Megatron-style GPT: learned positions, pre-LayerNorm blocks, attention scores materialised as Megatron's
fused softmax keeps them, GeLU MLP, the embedding tied to the LM head), captures it once, plans it at each
tensor-parallel size, and runs the layout search with the A100 preset. It reports the chosen (t, p) against
the paper's, how much slower the model predicts the paper's own (t, p) to be, and the predicted throughput
against the paper's in the paper's own measure: F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) FLOPs per step
(its equation 3, which counts the recomputed forward) over the predicted step time and the GPUs.

The search is run with the knobs Megatron had in 2021 (full activation recomputation, the interleaved
schedule, no FSDP, no sequence parallelism: Korthikanti et al. 2022 came a year later), and once more with
every knob, reported alongside.

    python benchmarks/megatron_table1.py            # all ten rows, ~3 minutes on 2 cores
    python benchmarks/megatron_table1.py --rows 1,10
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from autotp.layout.auto import Space, best_per_mesh, explain, search, tp_sizes
from autotp.layout.cost import Training
from autotp.layout.facts import capture_facts
from autotp.layout.hardware import A100

RESULTS = Path(__file__).parent / "results"
VOCAB, SEQ, GPUS_PER_NODE = 51200, 2048, 8


@dataclass(frozen=True)
class Row:
    """One row of Narayanan et al. 2021, Table 1 ("Weak-scaling throughput for GPT models ranging from 1
    billion to 1 trillion parameters")."""

    params_b: float  # "Number of parameters (billion)"
    heads: int  # "Attention heads"
    hidden: int  # "Hidden size"
    layers: int  # "Number of layers"
    tp: int  # "Tensor model-parallel size"
    pp: int  # "Pipeline model-parallel size"
    gpus: int  # "Number of GPUs"
    batch: int  # "Batch size"
    tflops: float  # "Achieved teraFLOP/s per GPU"
    peak: float  # "Percentage of theoretical peak FLOP/s"
    pflops: float  # "Achieved aggregate petaFLOP/s"


# arXiv:2104.04473 (v5), Table 1; the parameter counts agree with the paper's formula
# P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)) for every row.
TABLE1 = (
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 0.44, 4.4),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 0.44, 8.8),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 0.46, 18.2),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 0.43, 34.6),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 0.44, 70.8),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 0.45, 143.8),
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 0.47, 227.1),
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 0.50, 297.4),
    Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 0.52, 410.2),
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 0.52, 502.0),
)


class Block(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(h, dim=2)
        q, k, v = (y.view(b, s, self.heads, h // self.heads).transpose(1, 2) for y in (q, k, v))  # (b, a, s, d)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(h // self.heads)  # (b, a, s, s), kept for backward
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = F.dropout(scores.masked_fill(~mask, float("-inf")).softmax(-1), 0.1, self.training)
        x = x + F.dropout(self.proj((att @ v).transpose(1, 2).reshape(b, s, h)), 0.1, self.training)
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln_2(x)))), 0.1, self.training)


class GPT(nn.Module):
    def __init__(self, row: Row):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, row.hidden), nn.Embedding(SEQ, row.hidden)
        self.blocks = nn.ModuleList(Block(row.hidden, row.heads) for _ in range(row.layers))
        self.ln_f = nn.LayerNorm(row.hidden)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied, as Megatron's GPT
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def paper_flops(row: Row) -> float:
    """Equation 3 of the paper: FLOPs of one step with activation recomputation."""
    B, s, l, h, V = row.batch, SEQ, row.layers, row.hidden, VOCAB
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def paper_measure(row: Row, est) -> float:
    """Predicted TFLOP/s per GPU as the paper counts them: equation 3 counts four passes (the recomputed
    forward too); a layout that does not recompute runs three of them."""
    passes = 1.0 if est.layout.recompute else 0.75
    return paper_flops(row) * passes / est.step / row.gpus / 1e12


def run_row(row: Row, every_knob: bool) -> dict:
    with torch.device("meta"):
        net = GPT(row)
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    start = time.perf_counter()
    facts = capture_facts(net, (ids, ids), {}, tp_sizes(row.gpus, GPUS_PER_NODE, row.heads), 1, SEQ)
    captured = time.perf_counter() - start
    megatron = Space(row.gpus, GPUS_PER_NODE, row.batch, fsdp=(False,), sp=(False,), recompute=(True,),
                     context=False)
    out = {"row": row.__dict__, "params": facts.params, "capture_and_plans_s": captured}
    for name, space in (("megatron_knobs", megatron), ("every_knob", Space(row.gpus, GPUS_PER_NODE, row.batch))):
        if name == "every_knob" and not every_knob:
            continue
        result = search(facts, A100, space, Training(act_bytes=2))
        best = result.best
        meshes = {(e.layout.tp, e.layout.pp): e for e in best_per_mesh(result) if e.layout.cp == 1}
        paper = meshes.get((row.tp, row.pp))
        out[name] = {
            "considered": result.considered, "fit": len(result.ranked),
            "best": best.to_dict() if best else None,
            "paper_layout": paper.to_dict() if paper else None,
            "paper_layout_slower": (paper.step / best.step - 1) if paper and best else None,
            "predicted_tflops": paper_measure(row, best) if best else None,
            "paper_layout_tflops": paper_measure(row, paper) if paper else None,
            "why": explain(result),
        }
    return out


def _table(results: list[dict], key: str) -> Table:
    t = Table(title=f"Narayanan et al. 2021, Table 1 vs autotp's layout search (A100 preset, {key.replace('_', ' ')})")
    for col in ("params", "GPUs", "batch", "paper t,p", "chosen t,p (layout)", "paper's t,p predicted",
                "paper TFLOP/s", "predicted", "ratio", "match"):
        t.add_column(col, justify="left" if col.startswith("chosen") else "right")
    for r in results:
        row, res = r["row"], r.get(key)
        if res is None or res["best"] is None:
            continue
        lay = res["best"]["layout"]
        slower = res["paper_layout_slower"]
        same = (lay["tp"], lay["pp"]) == (row["tp"], row["pp"])
        ok = same or (slower is not None and slower <= 0.05)
        pred = res["paper_layout_tflops"] if res["paper_layout_tflops"] else res["predicted_tflops"]
        t.add_row(f"{row['params_b']:g}B", str(row["gpus"]), str(row["batch"]), f"{row['tp']},{row['pp']}",
                  f"{lay['tp']},{lay['pp']} ({res['best']['label']})",
                  "-" if slower is None else f"+{slower:.1%}", f"{row['tflops']:g}", f"{pred:.0f}",
                  f"{pred / row['tflops']:.2f}", "yes" if ok else "no")
    return t


def markdown(results: list[dict], key: str) -> str:
    """The comparison as a markdown table, with the count of rows that meet the goals."""
    lines = ["| params | GPUs | batch | paper t, p | chosen layout | paper's t, p predicted | paper TFLOP/s/GPU "
             "| predicted | ratio | t, p matched (or ≤ 5%) |", "|" + "---|" * 10]
    matched = within = n = 0
    for r in results:
        row, res = r["row"], r.get(key)
        if res is None or res["best"] is None:
            continue
        n += 1
        lay, slower = res["best"]["layout"], res["paper_layout_slower"]
        ok = (lay["tp"], lay["pp"]) == (row["tp"], row["pp"]) or (slower is not None and slower <= 0.05)
        pred = res["paper_layout_tflops"] or res["predicted_tflops"]
        matched += ok
        within += abs(pred / row["tflops"] - 1) <= 0.2
        lines.append(f"| {row['params_b']:g}B | {row['gpus']} | {row['batch']} | {row['tp']}, {row['pp']} | "
                     f"{res['best']['label']} | {'-' if slower is None else f'+{slower:.1%}'} | {row['tflops']:g} | "
                     f"{pred:.0f} | {pred / row['tflops']:.2f} | {'yes' if ok else 'no'} |")
    lines.append(f"\n(t, p) matched or predicted within 5%: {matched} of {n}; throughput within 20%: {within} of {n}.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=None, help="comma-separated row numbers (1-10), default all")
    ap.add_argument("--no-every-knob", action="store_true", help="only the 2021 knobs")
    ap.add_argument("--out", type=Path, default=RESULTS / "megatron_table1.json")
    a = ap.parse_args()
    rows = [TABLE1[int(i) - 1] for i in a.rows.split(",")] if a.rows else list(TABLE1)
    console = Console(width=200)
    results = []
    for row in rows:
        start = time.perf_counter()
        results.append(run_row(row, not a.no_every_knob))
        res = results[-1]["megatron_knobs"]
        console.print(f"{row.params_b:g}B: {time.perf_counter() - start:.1f} s; chosen {res['best']['label']}; "
                      + " ".join(res["why"][:1]), soft_wrap=True)
    for key in ("megatron_knobs", "every_knob"):
        console.print(_table(results, key))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"hardware": A100.to_dict(), "command": " ".join(sys.argv), "rows": results},
                                indent=1))
    md = a.out.with_suffix(".md")
    md.write_text("# Narayanan et al. 2021, Table 1, against autotp's layout search\n\n"
                  "A100 preset (`autotp/layout/hardware.py`), bf16 activations; `python benchmarks/megatron_table1.py`. "
                  "Predicted TFLOP/s per GPU in the paper's measure (its equation 3, for the paper's own (t, p) where "
                  "the search priced it, else for the chosen layout). \"paper's t, p predicted\": how much slower the "
                  "model predicts the best layout with the paper's (t, p) than the chosen one.\n\n"
                  "## The knobs Megatron had in 2021 (recomputation, interleaving; no FSDP, no sequence parallelism)\n\n"
                  + markdown(results, "megatron_knobs") + "\n\n## Every knob\n\n" + markdown(results, "every_knob")
                  + "\n")
    console.print(f"wrote {a.out} and {md}")


if __name__ == "__main__":
    main()
