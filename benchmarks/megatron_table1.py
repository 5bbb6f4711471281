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

The search is run with the knobs Megatron had in 2021, set per row as NVIDIA's scripts for the table set
them (``examples/sc21/run_table_1.sh`` of NVIDIA/Megatron-LM: the micro-batch size, the interleaved schedule's
stages per rank, torch's DDP overlapping the all-reduce with the backward up to 18.4B and Megatron's local DDP
all-reducing after it from 39.1B), with full activation recomputation, the scatter/gather of the hidden state
between stages (§4.1), no FSDP and no sequence parallelism (Korthikanti et al. 2022 came a year later); the
search chooses (t, p). The predicted throughput is that of the paper's own configuration (its t, p, micro-batch
and schedule). The search runs once more with every knob (the micro-batch searched), reported alongside. Where
the chosen (t, p) is not the paper's, the results list both layouts' terms.

It then prices torchtitan's published 70B row (``docs/performance.md`` of pytorch/torchtitan, Table 4: Llama 3.1
70B on 256 H100s, FSDP 32 × TP 8, local batch 16 × 8192 tokens, full activation checkpointing) with the H100
preset and FSDP's bf16 mixed precision, against its published tokens/s per GPU.

    python benchmarks/megatron_table1.py            # all ten rows and the torchtitan row, ~30 minutes on 2 cores
    python benchmarks/megatron_table1.py --rows 1,10 --facts-cache /tmp/facts
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

from autotp.search.auto import Space, best_per_mesh, explain, search, tp_sizes
from autotp.search.cost import Candidate, Training, estimate
from autotp.search.model_costs import ModelCosts, capture_costs
from autotp.search.hardware import A100, H100

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_shaped import Config, LlamaShaped  # noqa: E402

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


@dataclass(frozen=True)
class Script:
    """The knobs each row ran with that Table 1 does not print: NVIDIA/Megatron-LM ``examples/sc21/
    run_table_1.sh`` (the scripts that produced the table, at the commit its README names)."""

    micro_batch: int  # MBS (--micro-batch-size)
    virtual: int  # stages per pipeline rank: layers per rank ÷ --num-layers-per-virtual-pipeline-stage (1: none)
    torch_ddp: bool  # DDP=torch (torch's DDP: the all-reduce beside the backward); False: DDP=local (Megatron's
    # own: the gradients all-reduced after the backward)


SCRIPTS = (
    Script(16, 1, True), Script(16, 1, True), Script(16, 1, True), Script(8, 1, True),
    Script(4, 1, False),
    Script(2, 3, False),  # 60 layers / pp 4 = 15 per rank, 5 per virtual stage
    Script(2, 2, False),  # 80 / 8 = 10, 5 per virtual stage
    Script(1, 2, False),  # 96 / 16 = 6, 3 per virtual stage
    Script(1, 3, False),  # 105 / 35 = 3, 1 per virtual stage
    Script(1, 1, False),
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
    passes = 1.0 if est.candidate.recompute else 0.75
    return paper_flops(row) * passes / est.step / row.gpus / 1e12


def cached_facts(cache: Path | None, key: str, build) -> ModelCosts:
    """``build()``'s facts, kept as JSON-free pickles under ``cache`` (the benchmark's own files) by ``key``."""
    import pickle

    path = cache / f"{key}.pkl" if cache is not None else None
    if path is not None and path.exists():
        return pickle.loads(path.read_bytes())
    facts = build()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(facts))
    return facts


def run_row(row: Row, script: Script, every_knob: bool, cache: Path | None = None) -> dict:
    def build() -> ModelCosts:
        with torch.device("meta"):
            net = GPT(row)
        ids = torch.zeros(1, SEQ, dtype=torch.long)
        return capture_costs(net, (ids, ids), {}, tp_sizes(row.gpus, GPUS_PER_NODE, row.heads), 1, SEQ)

    start = time.perf_counter()
    facts = cached_facts(cache, f"megatron-{row.params_b:g}b", build)
    captured = time.perf_counter() - start
    # the 2021 knobs as the row's script set them: its micro-batch, the interleaved schedule at its stages per
    # rank (or none), full recomputation; the search chooses t, p (and so dp and the micro-batches per step)
    megatron = Space(row.gpus, GPUS_PER_NODE, row.batch, micro_batch=script.micro_batch, fsdp=(False,), sp=(False,),
                     recompute=(True,), virtual=tuple(sorted({1, script.virtual})), context=False)
    # torch's DDP all-reduces beside the backward; Megatron's local DDP after it. Megatron-LM sent the hidden
    # state between stages with its scatter/gather (§4.1; Table 1 ran with it)
    of_2021 = Training(act_bytes=2, ddp_overlap=script.torch_ddp, scatter_gather=True)
    out = {"row": row.__dict__, "script": script.__dict__, "params": facts.params, "capture_and_plans_s": captured}
    for name, space, training in (("megatron_knobs", megatron, of_2021),
                                  ("every_knob", Space(row.gpus, GPUS_PER_NODE, row.batch), Training(act_bytes=2))):
        if name == "every_knob" and not every_knob:
            continue
        result = search(facts, A100, space, training)
        best = result.best
        if name == "megatron_knobs":  # the paper's own configuration, priced as it ran
            dp = row.gpus // (row.tp * row.pp)
            paper = estimate(facts, A100, Candidate(row.tp, dp, row.pp, script.micro_batch,
                                                 row.batch // (dp * script.micro_batch), script.virtual,
                                                 recompute=True), training)
        else:  # the fastest layout the search found at the paper's (t, p)
            paper = {(e.candidate.tp, e.candidate.pp): e for e in best_per_mesh(result) if e.candidate.cp == 1}.get(
                (row.tp, row.pp))
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


# pytorch/torchtitan docs/performance.md (commit eaea6f6, benchmarks of 2024-12-26), Table 4: "2D parallelism
# (FSDP + TP) + torch.compile + Float8. Llama 3.1 70B model. 256 GPUs (FSDP 32, TP 8). Local batch size 16, global
# batch size 512. Full activation checkpointing", row "2D": 829 TPS/GPU, 71.9 GiB (H100 96 GB HBM2e at 500 W). The
# table has no bf16 row: its figure is with Float8 linears and torch.compile.
TORCHTITAN_TPS = 829
TORCHTITAN = Config(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                    num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192)


def torchtitan_row(cache: Path | None = None) -> dict:
    """torchtitan's 70B layout priced as it ran: tp 8 with sequence parallelism, FSDP over 32 ranks gathering
    bf16 weights (param_dtype bf16, reduce_dtype fp32), one micro-batch of 16 sequences, every block recomputed."""
    seq = TORCHTITAN.max_position_embeddings

    def build() -> ModelCosts:
        with torch.device("meta"):
            net = LlamaShaped(TORCHTITAN)
        ids = torch.zeros(1, seq, dtype=torch.long)
        return capture_costs(net, (ids, ids), {}, (8,), 1, seq)

    facts = cached_facts(cache, "torchtitan-70b", build)
    lay = Candidate(tp=8, dp=32, pp=1, micro_batch=16, microbatches=1, fsdp=True, sp=True, recompute=True,
                 fsdp_dtype="bf16")
    est = estimate(facts, H100, lay, Training(act_bytes=2, seq=seq))
    return {"layout": est.to_dict(), "published_tokens_per_s_per_gpu": TORCHTITAN_TPS,
            "predicted_tokens_per_s_per_gpu": est.tokens_per_device,
            "ratio": est.tokens_per_device / TORCHTITAN_TPS, "params": facts.params,
            "source": "pytorch/torchtitan docs/performance.md, Table 4, row 2D (torch.compile + Float8)"}


def exact(r: dict, key: str) -> bool:
    """The search chose the paper's own (t, p)."""
    row, res = r["row"], r.get(key)
    return bool(res and res["best"]) and (res["best"]["layout"]["tp"], res["best"]["layout"]["pp"]) == (
        row["tp"], row["pp"])


def ratio(r: dict, key: str) -> float:
    """Predicted ÷ achieved TFLOP/s per GPU: the paper's configuration as priced, else the chosen layout."""
    res = r[key]
    return (res["paper_layout_tflops"] or res["predicted_tflops"]) / r["row"]["tflops"]


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
             "| predicted | ratio | exact t, p | t, p or ≤ 5% |", "|" + "---|" * 11]
    matched = within = n = same = 0
    for r in results:
        row, res = r["row"], r.get(key)
        if res is None or res["best"] is None:
            continue
        n += 1
        lay, slower = res["best"]["layout"], res["paper_layout_slower"]
        ok = (lay["tp"], lay["pp"]) == (row["tp"], row["pp"]) or (slower is not None and slower <= 0.05)
        pred = res["paper_layout_tflops"] or res["predicted_tflops"]
        matched += ok
        same += exact(r, key)
        within += abs(pred / row["tflops"] - 1) <= 0.1
        lines.append(f"| {row['params_b']:g}B | {row['gpus']} | {row['batch']} | {row['tp']}, {row['pp']} | "
                     f"{res['best']['label']} | {'-' if slower is None else f'+{slower:.1%}'} | {row['tflops']:g} | "
                     f"{pred:.0f} | {pred / row['tflops']:.2f} | {'yes' if exact(r, key) else 'no'} | "
                     f"{'yes' if ok else 'no'} |")
    lines.append(f"\nexact (t, p): {same} of {n}; (t, p) matched or predicted within 5%: {matched} of {n}; "
                 f"throughput within 10%: {within} of {n}.")
    return "\n".join(lines)


def _terms(est: dict) -> str:
    """``12.74 s: compute 10.36, tp comm 0.75, ...``: a priced layout's step and its non-zero terms."""
    terms = [(k[:-2].replace("_", " "), v) for k, v in est.items() if k.endswith("_s") and k != "step_s" and v]
    return f"{est['step_s']:.2f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in terms)


def differences(results: list[dict], key: str) -> str:
    """Each row whose chosen (t, p) is not the paper's: both layouts' terms, side by side (seconds per step)."""
    lines = []
    for r in results:
        res = r.get(key)
        if not res or not res["best"] or exact(r, key):
            continue
        row, best, paper = r["row"], res["best"], res["paper_layout"]
        lines.append(f"- {row['params_b']:g}B: chosen `{best['label']}` {_terms(best)}; paper's "
                     + (f"`{paper['label']}` {_terms(paper)}" if paper else "(t, p) not priced (memory)"))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=None, help="comma-separated row numbers (1-10), default all")
    ap.add_argument("--no-every-knob", action="store_true", help="only the 2021 knobs")
    ap.add_argument("--facts-cache", type=Path, default=None, help="keep each model's captured facts here (pickles "
                    "this script writes) and reuse them")
    ap.add_argument("--out", type=Path, default=RESULTS / "megatron_table1.json")
    a = ap.parse_args()
    picked = [int(i) - 1 for i in a.rows.split(",")] if a.rows else range(len(TABLE1))
    rows = [(TABLE1[i], SCRIPTS[i]) for i in picked]
    console = Console(width=200)
    results = []
    for row, script in rows:
        start = time.perf_counter()
        results.append(run_row(row, script, not a.no_every_knob, a.facts_cache))
        res = results[-1]["megatron_knobs"]
        console.print(f"{row.params_b:g}B: {time.perf_counter() - start:.1f} s; chosen {res['best']['label']}; "
                      + " ".join(res["why"][:1]), soft_wrap=True)
    titan = torchtitan_row(a.facts_cache)
    for key in ("megatron_knobs", "every_knob"):
        console.print(_table(results, key))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"hardware": A100.to_dict(), "command": " ".join(sys.argv), "rows": results,
                                 "torchtitan_70b": titan}, indent=1))
    md = a.out.with_suffix(".md")
    same = sum(exact(r, "megatron_knobs") for r in results)
    ratios = [ratio(r, "megatron_knobs") for r in results]
    exact_line = (f"exact (t, p): {same}/{len(results)} rows; predicted/achieved TFLOP/s min {min(ratios):.2f} "
                  f"max {max(ratios):.2f}")
    titan_line = (f"torchtitan 70B: predicted {titan['predicted_tokens_per_s_per_gpu']:.0f} tokens/s per GPU, "
                  f"published {TORCHTITAN_TPS}, ratio {titan['ratio']:.2f}")
    lay = titan["layout"]
    md.write_text("# Narayanan et al. 2021, Table 1, against autotp's layout search\n\n"
                  "A100 preset (`autotp/search/hardware.py`), bf16 activations; `python benchmarks/megatron_table1.py`. "
                  "Predicted TFLOP/s per GPU in the paper's measure (its equation 3) for the paper's own configuration "
                  "(2021 knobs: its t, p, micro-batch and schedule; every knob: the fastest layout at its (t, p) where "
                  "the search priced one, else the chosen layout). \"paper's t, p predicted\": how much slower the "
                  "model predicts that layout than the chosen one.\n\n"
                  "## The knobs Megatron had in 2021, per row as NVIDIA's `examples/sc21/run_table_1.sh` set them\n\n"
                  "Micro-batch 16, 16, 16, 8, 4, 2, 2, 1, 1, 1 (1.7B to 1T); torch's DDP (the all-reduce beside the "
                  "backward) to 18.4B, Megatron's local DDP (after it) from 39.1B; the interleaved schedule with 3, 2, 2 "
                  "and 3 stages per rank at 76.1B, 145.6B, 310.1B and 529.6B (the script's layers per virtual stage), "
                  "the plain 1F1B elsewhere; full recomputation, scatter/gather between stages; no FSDP, no sequence "
                  "parallelism. The search chooses (t, p), and so dp and the micro-batches per step. A layer's "
                  "memory-bound work is priced as its kept activations written and read once per pass (`TRAFFIC` in "
                  "autotp/search/cost.py, assumed); priced as crossing memory once, the rows whose all-reduce torch's DDP "
                  "hides (1.7B to 18.4B: a step of matmuls, elementwise work and tp collectives) read 1.09 to 1.15.\n\n"
                  + markdown(results, "megatron_knobs")
                  + "\n\nWhere the chosen (t, p) is not the paper's, the terms of both (seconds per step):\n\n"
                  + differences(results, "megatron_knobs") + "\n\n## Every knob\n\n" + markdown(results, "every_knob")
                  + "\n\n## torchtitan's 70B row\n\n"
                  "Source: pytorch/torchtitan `docs/performance.md` (commit eaea6f6, versions of 2024-12-26), Table 4, "
                  "\"2D parallelism (FSDP + TP) + torch.compile + Float8. Llama 3.1 70B model. 256 GPUs (FSDP 32, TP 8). "
                  "Local batch size 16, global batch size 512. Full activation checkpointing\", row 2D: "
                  f"**{TORCHTITAN_TPS} TPS/GPU**, 71.9 GiB, on H100 96 GB HBM2e at 500 W. Table 4 has no bf16 row: the "
                  "published figure is with Float8 linears and torch.compile; autotp prices bf16 on the H100 preset "
                  "(80 GB SXM datasheet; matmuls at the assumed curve of autotp/search/hardware.py, 72% of its 989 TFLOP/s at this size).\n\n"
                  f"Priced layout: `{lay['label']}` (FSDP gathers bf16, reduces fp32), step {lay['step_s']:.2f} s: "
                  + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.2f} s" for k, v in lay.items()
                              if k.endswith("_s") and k != "step_s" and v)
                  + f"; memory {lay['memory']['total'] / 2**30:.1f} GiB per GPU.\n\n"
                  + exact_line + "\n\n" + titan_line + "\n")
    console.print(f"wrote {a.out} and {md}")
    print(exact_line)
    print(titan_line)


if __name__ == "__main__":
    main()
