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

With recomputation (``--recompute``): the model checkpoints each block (``torch.utils.checkpoint``, non-
reentrant), and the peak of a whole training step is measured per rank at tp 2 × FSDP 2 (4 ranks) and at pp 2
(2 ranks, 1F1B, 2 micro-batches), with and without the checkpointing. :class:`ActivationPeak` counts every
storage an op of the rewritten graph allocates (each storage once, freed when it is), during the forward and
during a region's recomputation in the backward: so FSDP's gathered parameters, pipelining's receive buffers
and the backward's gradients are not activations. No dropout there, attention through SDPA. The figure it is
held to is the layout search's (:mod:`autotp.search.cost`): with recomputation each layer's input for every
micro-batch in flight, plus one layer's activations being recomputed,

    flight · (L/p) · s·b·h·4  +  layer(b)          (flight: 1 without a pipeline, min(m, p) on 1F1B's rank 0)

and without it flight · (L/p) · layer(b), layer() the fp32 formula above without its dropout terms (64·sbh
instead of 72: the two residual dropouts' noise; TP keeps 16 of it whole).

Writes ``OUT/activation_memory.json`` and ``OUT/activation_memory.md`` (``--recompute``:
``OUT/activation_recompute.json`` and ``.md``).
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


class ActivationPeak:
    """The peak, over the ops run inside it, of the bytes live in storages that ops of an autotp graph
    allocated: every op run inside a rewritten graph (an ``fx.GraphModule``: the whole graph, an FSDP unit's
    or a pipeline stage's piece, a checkpointed region recomputed in the backward) and the operators it
    calls, but not directly in a piece's call (:class:`~autotp.operators.pieces.PieceCall`), where FSDP
    gathers the unit's parameters. A storage counts once, from the op that allocated it (an output aliasing
    none of the op's inputs: views, in-place ops and a parameter's local shard allocate nothing) until it is
    freed. Parameters, FSDP's gathered parameters, the pipeline's receive buffers and the backward's
    gradients are not counted; what the forward keeps for the backward and what a recomputation makes are."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[object, int]] = {}  # storage -> (weak reference, bytes)
        self.peak = 0
        self.stack: list[str] = []  # per module being called: "graph", "piece" or "module"

    def counting(self) -> bool:
        return "graph" in self.stack and self.stack[-1] != "piece"

    def __enter__(self):
        import torch.fx as fx
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.utils._python_dispatch import TorchDispatchMode

        from autotp.operators.pieces import PieceCall

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if tracker.counting():
                    tracker._record((args, kwargs), out)
                return out

        def enter(module, args) -> None:
            self.stack.append("graph" if isinstance(module, fx.GraphModule) else
                              "piece" if isinstance(module, PieceCall) else "module")

        def leave(module, args, output) -> None:  # None: the output stays the module's
            self.stack.pop()

        self._hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave, always_call=True)]
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for h in self._hooks:
            h.remove()

    @staticmethod
    def _storages(tree) -> list:
        import torch
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_leaves

        out = []
        for t in tree_leaves(tree):
            if isinstance(t, DTensor):
                t = t._local_tensor
            if isinstance(t, torch.Tensor) and not t.is_meta:
                out.append(t.untyped_storage())
        return out

    def _record(self, inputs, out) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        read = {st._cdata for st in self._storages(inputs)}
        for st in self._storages(out):
            if st._cdata not in read and st._cdata not in self.live:
                self.live[st._cdata] = (StorageWeakRef(st), st.nbytes())
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))


def recompute_build(layers: int, seq: int, recompute: bool):
    """nanoGPT with SDPA attention and no dropout; with ``recompute`` each block's forward runs under
    ``torch.utils.checkpoint`` (non-reentrant), as a training script checkpoints its layers."""
    from torch.utils.checkpoint import checkpoint

    model = build(layers, "sdpa", seq, dropout=0.0)
    if recompute:
        for block in model.transformer.h:
            plain = type(block)
            block.__class__ = type("CheckpointedBlock", (plain,), {
                "forward": lambda self, x, plain=plain: checkpoint(plain.forward, self, x, use_reentrant=False)})
    return model


def recompute_worker(opts: dict) -> dict:
    """On each rank: the activation peak of one training step (after one untimed step: FSDP's buffers and
    the pieces' graphs made) with and without recomputation, tp 2 × FSDP 2 or pp 2."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autotp

    b, s, layers, layout = opts["batch"], opts["seq"], opts["layers"], opts["layout"]
    idx, targets = batch(b, s)
    out = {}
    for rc in (False, True):
        model = recompute_build(layers, s, rc)
        if layout == "fsdp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            d = mesh["dp"].get_local_rank()
            mine = (idx.chunk(2)[d], targets.chunk(2)[d])
            model = autotp.parallelize(model, example_inputs=mine, fsdp=True, mesh=mesh)

            def step():
                _, loss = model(*mine)
                loss.backward()
        else:
            mesh = init_device_mesh("cpu", (2, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
            pipe = autotp.pipeline(model, example_inputs=(idx, targets), microbatches=opts["microbatches"],
                                   schedule="1F1B", mesh=mesh)

            def step():
                pipe.step(idx, targets)
        step()
        peak = ActivationPeak()
        with peak:
            step()
        out["rc" if rc else "plain"] = peak.peak
        del model
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, out)
    return {"ranks": everyone}


def recompute_formulas(b: int, s: int, h: int, a: int, t: int, layers: int, pp: int, m: int,
                       rank: int = 0) -> dict[str, float]:
    """The layout search's activation figure (:func:`autotp.search.cost`'s ``_memory``, which prices the
    busiest rank, pipeline rank 0; here for pipeline rank ``rank``, in fp32 without dropout): each layer's
    input per micro-batch in flight plus one layer recomputed, and without recomputation every layer's
    activations per micro-batch in flight."""
    from autotp.reports.pipeline import in_flight

    sbh, asb, sb = s * b * h, a * s * b, s * b
    layer = 16 * sbh + 48 * sbh / t + 4 * asb / t + 16 * sb  # formulas()'s sdpa/tp less its dropout noise
    flight = 1 if pp == 1 else in_flight("1F1B", pp, 1, m, rank)
    held = flight * layers / pp
    return {"rc": held * sbh * 4 + layer, "plain": held * layer, "layer": layer, "input": sbh * 4, "held": held}


def _recompute_markdown(r: dict) -> str:
    o = r["options"]
    lines = [
        "# Activation peak per rank with recomputation: tp 2 × FSDP 2 and pp 2",
        "",
        f"nanoGPT, {o['layers']} layers, h={HIDDEN}, a={HEADS} heads, vocab {VOCAB}, SDPA, no dropout, fp32; each "
        f"block checkpointed (torch.utils.checkpoint, non-reentrant) or not. Peak over one training step of the "
        f"bytes in storages the rewritten graph's ops allocated (forward and recomputation; each storage once), "
        f"per rank, after one warm-up step (benchmarks/activation_memory.py --recompute, ActivationPeak).",
        "",
        "Formula: the layout search's (autotp/search/cost.py) in fp32 without dropout: with recomputation "
        "flight·(L/p)·s·b·h·4 + one layer's activations; without, flight·(L/p)·layer.",
        "",
        "| layout | batch per rank | rank | recompute MiB | formula MiB | recompute / formula | no recompute MiB "
        "| formula MiB | recompute / no recompute |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(f"| {row['layout']} | {row['micro']} | {row['rank']} | {row['rc'] / 2**20:.3f} | "
                     f"{row['formula_rc'] / 2**20:.3f} | {row['rc'] / row['formula_rc']:.3f} | "
                     f"{row['plain'] / 2**20:.3f} | {row['formula_plain'] / 2**20:.3f} | "
                     f"{row['rc'] / row['plain']:.3f} |")
    lines += ["", f"Every rank's peak with recomputation at most its formula + {TOLERANCE:.0%}: "
              f"{r['within_formula']}; below the peak without it: {r['below_plain']}.", "",
              "Not counted: what torch's pipelining allocates outside the graph (pp rank 1's receive buffer, one "
              "layer input per micro-batch in flight), FSDP's gathered parameters, the backward's gradients. "
              "Without recomputation the peak is also above the layers' formula by the embedding, the final "
              "norm, the logits and the loss's saved tensors, which the layout search prices apart. The formula "
              "for pp rank 1 counts 1F1B's one micro-batch in flight there (the search prices rank 0, the "
              "busiest)."]
    return "\n".join(lines) + "\n"


def recompute_main(a) -> None:
    from ranks import launch

    rows = []
    for layout, world, label in (("fsdp", 4, "tp 2 × fsdp 2"), ("pp", 2, "pp 2 (1F1B)")):
        opts = {"batch": 2 * a.batch, "seq": a.seq, "layers": a.layers, "layout": layout, "microbatches": 2}
        ranks = launch(recompute_worker, world, opts)[0]["ranks"]
        micro = a.batch  # fsdp: each replica's half of the batch; pp: each of 2 micro-batches
        tp, pp = (2, 1) if layout == "fsdp" else (1, 2)
        for rank, got in enumerate(ranks):
            f = recompute_formulas(micro, a.seq, HIDDEN, HEADS, tp, a.layers, pp, 2, rank if pp > 1 else 0)
            rows.append({"layout": label, "rank": rank, "micro": micro, "rc": got["rc"], "plain": got["plain"],
                         "formula_rc": f["rc"], "formula_plain": f["plain"]})
    result = {"options": {"batch": a.batch, "seq": a.seq, "layers": a.layers}, "rows": rows,
              "within_formula": all(r["rc"] <= (1 + TOLERANCE) * r["formula_rc"] for r in rows),
              "below_plain": all(r["rc"] < r["plain"] for r in rows)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "activation_recompute.json").write_text(json.dumps(result, indent=2))
    (out / "activation_recompute.md").write_text(_recompute_markdown(result))
    print(_recompute_markdown(result))


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
    ap.add_argument("--recompute", action="store_true",
                    help="the activation peak with and without recomputation at tp 2 × FSDP 2 and pp 2 instead")
    ap.add_argument("--layers", type=int, default=4, help="--recompute: the model's blocks")
    a = ap.parse_args()
    if a.recompute:
        recompute_main(a)
        return
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
