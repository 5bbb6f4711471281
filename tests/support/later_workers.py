"""Ranks of tests/capture/test_later_signatures.py: a later call signature rewrites the exported blocks once and copies
them; it must compute, bit for bit and collective for collective, what rewriting the whole graph computes."""
from __future__ import annotations

import copy
import math
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

import autotp
import autotp.parallel.apply as par
from ranks import CollectiveLog
from small_models import llama, loss_and_logits

H, V = 32, 64


class Block(nn.Module):
    """Attention (global, or over the last ``window`` positions) with a dropout, then an MLP."""

    def __init__(self, window: int | None = None, wide: bool = False, dropout: float = 0.0):
        super().__init__()
        self.window = window
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.fc, self.out = nn.Linear(H, 8 * H if wide else 4 * H), nn.Linear(8 * H if wide else 4 * H, H)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 4, H // 4).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(H, dim=2))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        if self.window is not None:
            mask = mask & ~torch.ones(s, s, dtype=torch.bool, device=x.device).tril(-self.window)
        att = self.drop(((q @ k.transpose(-2, -1)) / math.sqrt(H // 4)).masked_fill(~mask, float("-inf")).softmax(-1))
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, H))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, H), nn.Embedding(16, H)
        self.h = nn.ModuleList(blocks)
        self.ln_f, self.head = nn.LayerNorm(H), nn.Linear(H, V, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _gpt(kinds: str, dropout: float = 0.0):
    """Blocks spelled by letter: g global attention, l local, w a wider MLP (a dense first block)."""
    torch.manual_seed(0)
    model = GPT([Block(window=4 if k == "l" else None, wide=k == "w", dropout=dropout) for k in kinds])
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, V, (2, 16), generator=g), torch.randint(0, V, (2, 16), generator=g)
    return model, (idx, targets), {}


MODELS = {
    "alternating": lambda: _gpt("glglgl"),  # local and global attention by turns: two kinds after block 0
    # block 0 differs (blocks 1 … 4 copy block 1), and dropout draws on both region streams
    "dense_first_dropout": lambda: _gpt("wgggg", dropout=0.1),
    "llama": lambda: llama(layers=5),
}


def _whole_first(st, planned, stacklevel):
    """parallelize's rewrite as the first signature runs it: the whole graph planned and rewritten."""
    return _rewrite(st, planned.whole() if planned.copies is not None else planned, stacklevel)


_rewrite = par.rewrite


def _run(model, calls, seed: int) -> tuple[list, list]:
    """Each call's flat outputs (and its gradients) and collectives; the default and region RNGs from ``seed``."""
    outs, logs = [], []
    st = autotp.tp_state(model)
    start = st.rng.get_state() if st.rng is not None else None
    for i, (args, kwargs, train) in enumerate(calls):
        model.train(train)
        torch.manual_seed(seed + i)
        if start is not None:
            st.rng.set_state(start)
        log = CollectiveLog()
        with log:
            loss, logits = loss_and_logits(model(*args, **kwargs))
            if train:
                loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if train]
        model.zero_grad(set_to_none=True)
        outs.append((_plain(loss), _plain(logits), grads))
        logs.append(log.calls)
    return outs, logs


def _plain(t: torch.Tensor | None) -> torch.Tensor:
    """A detached full tensor (vocab-parallel logits gathered); a missing loss as 0."""
    if t is None:
        return torch.zeros(())
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def later_signatures(name: str) -> dict:
    ref, args, kwargs = MODELS[name]()
    hf = bool(kwargs)
    if hf:  # the first signature is the training call; later: eval without a cache, and with one (per-block outputs)
        first = (args, kwargs, True)
        later = [(args, {**kwargs, "labels": None}, False),
                 (args, {k: v for k, v in kwargs.items() if k != "use_cache"}, False)]
    else:  # the first signature is parallelize's example (idx alone); later: the training call with targets, eval
        first = ((args[0],), {}, True)
        later = [(args, {}, True), (args, {}, False)]
    copied_model, whole_model = copy.deepcopy(ref), copy.deepcopy(ref)
    autotp.parallelize(copied_model, example_inputs=(first[0], first[1]))
    par.rewrite = _whole_first
    try:
        autotp.parallelize(whole_model, example_inputs=(first[0], first[1]))
        if autotp.tp_state(whole_model).rng is not None:  # the same region stream as the copied model's
            autotp.tp_state(whole_model).rng.set_state(autotp.tp_state(copied_model).rng.get_state())
        whole, whole_logs = _run(whole_model, later, seed=7)
    finally:
        par.rewrite = _rewrite
    got, got_logs = _run(copied_model, later, seed=7)
    st, wst = autotp.tp_state(copied_model), autotp.tp_state(whole_model)
    graphs = list(st.graphs.values())[1:]
    ops = [Counter(str(n.target) for n in c.module.graph.nodes if n.op == "call_function") for c in graphs]
    whole_ops = [Counter(str(n.target) for n in c.module.graph.nodes if n.op == "call_function")
                 for c in list(wst.graphs.values())[1:]]
    out = {
        "copied": [c.copied for c in graphs], "whole_copied": [c.copied for c in list(wst.graphs.values())[1:]],
        "same_ops": ops == whole_ops, "same_collectives": got_logs == whole_logs,
        "collectives": [len(log) for log in got_logs],
        "bitwise": all(torch.equal(a, b) for g, w in zip(got, whole) for a, b in zip(g[:2], w[:2]))
        and all(torch.equal(a, b) for g, w in zip(got, whole) for a, b in zip(g[2], w[2])),
        "planned_params": [len(c.plan.params) for c in graphs], "first_params": len(st.plan.params),
    }
    if "dropout" not in name:  # against the unsharded model (dropout draws differ by rank)
        ref_out, _ = _run_ref(ref, later, seed=7)
        out["logits_diff"] = max((g[1] - r[1]).abs().max().item() for g, r in zip(got, ref_out))
        out["loss_diff"] = max((g[0] - r[0]).abs().max().item() for g, r in zip(got, ref_out))
    return out


def _run_ref(model, calls, seed: int) -> tuple[list, list]:
    outs = []
    for i, (args, kwargs, train) in enumerate(calls):
        model.train(train)
        torch.manual_seed(seed + i)
        loss, logits = loss_and_logits(model(*args, **kwargs))
        outs.append((_plain(loss), _plain(logits), []))
    return outs, []
