"""Rank functions of tests/runtime/test_value_checks.py and tests/analysis/test_moe_islands.py: each spelling of a model file in
tests/support (``build(style) -> (model, (x, y))``, the model returning ``(logits, loss)``) parallelized next to
the unsharded model, trained 3 AdamW steps, sampled, and its whole ``__dict__`` state compared after each."""
from __future__ import annotations

import importlib

import torch

import autotp
from parity_workers import _local, _max_diff
from written_state_workers import state_diff


def _greedy(model: torch.nn.Module, idx: torch.Tensor, steps: int, window: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(steps):
            logits, _ = model(idx[:, -window:])
            idx = torch.cat((idx, logits[:, -1, :].argmax(-1, keepdim=True)), dim=1)
    return idx


def forward_parity(models: str, styles: list[str], steps: int = 3) -> dict:
    """Per style: the largest differences of logits, losses, gradients (every step) and parameters (after
    ``steps`` AdamW steps), the ``__dict__`` differences, greedy tokens equal, this rank's parameter fraction,
    how many graphs were captured."""
    lib = importlib.import_module(models)
    out = {}
    for style in styles:
        ref, (x, y) = lib.build(style)
        model = autotp.parallelize(lib.build(style)[0], example_inputs=(x, y))
        opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (model, ref))
        r = {"logits": 0.0, "loss": 0.0, "grad": 0.0, "state": []}
        for step in range(steps):
            (got, loss), (want, rloss) = model(x, y), ref(x, y)
            r["logits"] = max(r["logits"], _max_diff(got, want))
            r["loss"] = max(r["loss"], _max_diff(loss, rloss))
            r["state"] += [f"step {step}: {d}" for d in state_diff(model, ref)]
            for o, m, lo in ((opt, model, loss), (ropt, ref, rloss)):
                o.zero_grad()
                lo.backward()
            rg = {n: p.grad for n, p in ref.named_parameters()}
            r["grad"] = max(r["grad"], max(_max_diff(p.grad, _local(rg[n], n, model))
                                           for n, p in model.named_parameters() if p.grad is not None))
            r["grad_missing"] = [n for n, p in model.named_parameters() if (p.grad is None) != (rg[n] is None)]
            opt.step()
            ropt.step()
        rparams = dict(ref.named_parameters())
        r["param"] = max(_max_diff(p, _local(rparams[n], n, model)) for n, p in model.named_parameters())
        window = x.shape[1]
        r["tokens"] = torch.equal(_greedy(model, x[:, :3], 5, window), _greedy(ref, x[:, :3], 5, window))
        r["state"] += [f"sampled: {d}" for d in state_diff(model, ref)]
        r["fraction"] = sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in ref.parameters())
        r["graphs"] = len(autotp.tp_state(model).graphs)
        out[style] = r
    return out
