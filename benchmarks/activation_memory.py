"""Benchmark (not a test): activation bytes saved for backward per transformer layer, unsharded vs tensor
parallel (TP) vs tensor + sequence parallel (TP+SP), against Korthikanti et al. 2022.

    python benchmarks/activation_memory.py [--tp 2 4] [--batch 2] [--seq 256] [--out benchmarks/results]

Counted with ``torch.autograd.graph.saved_tensors_hooks`` on the CPU: every tensor autograd keeps for
backward in one forward of the training call, each storage once (q, k and v are views of one projection),
parameters left out. A layer's bytes are the difference between a 3-layer and a 1-layer model, halved, so
the embedding, LM head and loss drop out. TP and TP+SP run on ``tp`` gloo ranks (each rank measures its
own; they agree); unsharded runs the plain model in this process.

The paper counts 16-bit activations with 1-byte dropout masks; its per-layer bytes, a = heads:

    unsharded   s·b·h·(34 + 5·a·s/h)
    TP          s·b·h·(10 + 24/t + 5·a·s/(h·t))
    TP + SP     s·b·h·(34 + 5·a·s/h) / t

34 = 2-byte terms: 4 (two LayerNorm inputs) + 2 (QKV input) + 4 (Q, K) + 2 (V) + 2 (projection input) + 2 (MLP
input) + 8 (GeLU input) + 8 (GeLU output) = 32, and 1-byte masks of the two residual dropouts = 2.
5·a·s/h: softmax output 2 + its dropout mask 1 + dropout output 2, per a·s²·b.
TP splits everything but the LayerNorm inputs, the QKV and MLP inputs and the residual-dropout masks (10).

Recomputed here for what is measured (:func:`formulas`):
- fp32: every 2-byte term doubles;
- dropout p = 0.1 on the residual path (embedding, attention output, MLP output): PyTorch's CPU dropout
  keeps the scaled float noise for backward, 4 bytes per element (CUDA's native_dropout keeps a 1-byte mask);
- ``sdpa``: nanoGPT with ``F.scaled_dot_product_attention(is_causal=True)`` (attention dropout 0: CPU's fused
  kernel has none and falls back to the math path with it), which keeps no s×s scores: the 5·a·s/h term
  goes, and it keeps its output O and the log-sum-exp (4·a·s·b) instead. O is laid out (b, s, a, d), so
  ``y.transpose(1, 2).contiguous().view(B, T, C)`` copies nothing and the output projection's input is O
  itself: the paper's projection-input term covers it;
- ``matmul``: the example nanoGPT (attention written out, attention dropout 0.1): softmax output, dropout
  noise and dropout output, 4 + 4 + 4 = 12·a·s²·b, plus the bool causal mask masked_fill keeps (s² bytes,
  built in each layer, replicated);
- LayerNorm keeps mean and rstd (2 · 4·s·b per norm), which the paper leaves out: included.

So per layer, fp32, t ranks (72 = 2·32 + 4·2: the paper's 34 with its 2-byte terms doubled and its two
masks at 4 bytes; TP keeps 24 = 2·8 + 4·2 of it whole, the paper's 10, and splits 48 = 2·24, its 24/t):

    sdpa     unsharded  72·sbh + 4·asb + 16·sb
             TP         24·sbh + 48·sbh/t + 4·asb/t + 16·sb
             TP + SP    (72·sbh + 4·asb + 16·sb) / t
    matmul   unsharded  72·sbh + 12·as²b + s² + 16·sb
             TP         24·sbh + 48·sbh/t + 12·as²b/t + s² + 16·sb
             TP + SP    (72·sbh + 12·as²b + 16·sb) / t + s²

Writes ``OUT/activation_memory.json`` and ``OUT/activation_memory.md``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests" / "support")]

HIDDEN, HEADS, VOCAB, DROPOUT = 256, 8, 512, 0.1
LAYERS = (1, 3)  # per layer = (bytes at 3 layers − bytes at 1) / 2
TOLERANCE = 0.10


def build(layers: int, attention: str, seq: int, hidden: int = HIDDEN, heads: int = HEADS, vocab: int = VOCAB,
          dropout: float = DROPOUT):
    """nanoGPT (examples/nanogpt.py) with ``layers`` blocks; ``sdpa``: its attention through
    scaled_dot_product_attention, as nanoGPT does when flash attention is available."""
    import torch
    import torch.nn.functional as F
    from nanogpt import GPT, CausalSelfAttention, GPTConfig

    class FlashAttention(CausalSelfAttention):
        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
            q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # keeps no (T, T) scores
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.resid_dropout(self.c_proj(y))

    torch.manual_seed(0)
    cfg = GPTConfig(block_size=seq, vocab_size=vocab, n_layer=layers, n_head=heads, n_embd=hidden, dropout=dropout)
    model = GPT(cfg)
    if attention == "sdpa":
        for block in model.transformer.h:
            attn = FlashAttention(cfg)
            attn.load_state_dict(block.attn.state_dict())
            block.attn = attn
    return model


def saved_bytes(model, args: tuple) -> int:
    """Bytes of every storage autograd keeps for backward in one forward of ``model(*args)``, parameters out."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*args)
    total = sum(storages.values())
    del out  # the saved tensors were alive until now: no storage was reused while counting
    return total


def batch(b: int, s: int, vocab: int = VOCAB):
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (b, s), generator=g), torch.randint(0, vocab, (b, s), generator=g)


def per_layer(make, args: tuple) -> float:
    lo, hi = (saved_bytes(make(n), args) for n in LAYERS)
    return (hi - lo) / (LAYERS[1] - LAYERS[0])


def worker(opts: dict) -> dict:
    """On each rank: bytes per layer with TP and with TP+SP, for both attentions."""
    import torch.distributed as dist

    import autotp

    args = batch(opts["batch"], opts["seq"])
    out = {}
    for attention in ("sdpa", "matmul"):
        for sp in (False, True):
            def make(n: int):
                return autotp.parallelize(build(n, attention, opts["seq"]), example_inputs=args, sequence_parallel=sp)
            out[f"{attention}/{'tp+sp' if sp else 'tp'}"] = per_layer(make, args)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, out)
    return {"rank0": out, "ranks_agree": all(o == out for o in everyone)}


def formulas(b: int, s: int, h: int, a: int, t: int) -> dict[str, float]:
    """Per-layer bytes of the paper, recomputed for fp32, CPU dropout noise, fused or written-out attention
    (see the module docstring); t = 1 is the unsharded model."""
    sbh, asb, sb = s * b * h, a * s * b, s * b
    sdpa_all = 72 * sbh + 4 * asb + 16 * sb
    matmul_all = 72 * sbh + 12 * a * s * s * b + 16 * sb
    return {
        "sdpa/unsharded": sdpa_all,
        "sdpa/tp": 24 * sbh + 48 * sbh / t + 4 * asb / t + 16 * sb,
        "sdpa/tp+sp": sdpa_all / t,
        "matmul/unsharded": matmul_all + s * s,
        "matmul/tp": 24 * sbh + 48 * sbh / t + 12 * a * s * s * b / t + s * s + 16 * sb,
        "matmul/tp+sp": matmul_all / t + s * s,
    }


def paper(b: int, s: int, h: int, a: int, t: int) -> dict[str, float]:
    """The paper's own formulas (16-bit, 1-byte masks, attention written out), for reference."""
    base = s * b * h
    return {"unsharded": base * (34 + 5 * a * s / h), "tp": base * (10 + 24 / t + 5 * a * s / (h * t)),
            "tp+sp": base * (34 + 5 * a * s / h) / t}


def _markdown(r: dict) -> str:
    o = r["options"]
    lines = [
        "# Activation memory per transformer layer: unsharded vs TP vs TP + SP",
        "",
        f"nanoGPT, h={HIDDEN}, a={HEADS} heads, fp32, dropout {DROPOUT} on the residual path, batch "
        f"{o['batch']}×{o['seq']}; bytes kept for backward (saved_tensors_hooks, each storage once, parameters "
        f"out), per layer = (3 layers − 1 layer) / 2; rank 0 of tp gloo ranks (all ranks agree: "
        f"{all(r['tp'][str(t)]['ranks_agree'] for t in o['tp'])}).",
        "",
        "Formulas: Korthikanti et al. 2022 recomputed for fp32, PyTorch's CPU dropout (4-byte noise), and the "
        "attention used (benchmarks/activation_memory.py's docstring derives each term).",
        "",
        "| attention | t | mode | measured MiB | formula MiB | measured / formula | vs unsharded |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(f"| {row['attention']} | {row['t']} | {row['mode']} | {row['measured'] / 2**20:.3f} | "
                     f"{row['formula'] / 2**20:.3f} | {row['ratio']:.4f} | {row['vs_unsharded']:.3f} |")
    lines += ["", f"Every measurement within {TOLERANCE:.0%} of its formula: {r['within_tolerance']}. "
              f"TP + SP ≈ 1/t of unsharded (sdpa): "
              + ", ".join(f"t={t}: {x:.3f} (1/t = {1 / int(t):.3f})" for t, x in r["sp_fraction"].items()) + ".",
              "", "The paper's own numbers (16-bit, 1-byte masks, attention written out) for these sizes, MiB:", "",
              "| t | unsharded | TP | TP + SP |", "|---|---|---|---|"]
    for t, p in r["paper"].items():
        lines.append(f"| {t} | {p['unsharded'] / 2**20:.3f} | {p['tp'] / 2**20:.3f} | {p['tp+sp'] / 2**20:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from ranks import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    opts = {"batch": a.batch, "seq": a.seq, "tp": a.tp}
    args = batch(a.batch, a.seq)
    unsharded = {att: per_layer(lambda n, att=att: build(n, att, a.seq), args) for att in ("sdpa", "matmul")}
    tp = {str(t): launch(worker, t, opts)[0] for t in a.tp}
    rows = []
    for att in ("sdpa", "matmul"):
        f1 = formulas(a.batch, a.seq, HIDDEN, HEADS, 1)
        rows.append({"attention": att, "t": 1, "mode": "unsharded", "measured": unsharded[att],
                     "formula": f1[f"{att}/unsharded"]})
        for t in a.tp:
            f = formulas(a.batch, a.seq, HIDDEN, HEADS, t)
            for mode in ("tp", "tp+sp"):
                rows.append({"attention": att, "t": t, "mode": mode, "measured": tp[str(t)]["rank0"][f"{att}/{mode}"],
                             "formula": f[f"{att}/{mode}"]})
    for row in rows:
        row["ratio"] = row["measured"] / row["formula"]
        row["vs_unsharded"] = row["measured"] / unsharded[row["attention"]]
    result = {
        "options": opts, "hidden": HIDDEN, "heads": HEADS, "dropout": DROPOUT, "rows": rows, "tp": tp,
        "within_tolerance": all(abs(r["ratio"] - 1) <= TOLERANCE for r in rows),
        "sp_fraction": {str(r["t"]): r["vs_unsharded"] for r in rows
                        if r["attention"] == "sdpa" and r["mode"] == "tp+sp"},
        "paper": {str(t): paper(a.batch, a.seq, HIDDEN, HEADS, t) for t in a.tp},
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "activation_memory.json").write_text(json.dumps(result, indent=2))
    (out / "activation_memory.md").write_text(_markdown(result))
    from rich.console import Console
    from rich.markdown import Markdown

    Console().print(Markdown(_markdown(result)))


if __name__ == "__main__":
    main()
