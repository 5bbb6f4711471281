"""What runs inside each gloo rank of the activation-checkpointing tests (tests/support/recompute_models.py)."""
from __future__ import annotations

import copy

import torch

import autotp
from parity_workers import _local
from recompute_models import build, loss_of


def _example(style: str, idx: torch.Tensor, targets: torch.Tensor):
    if style == "hf_llama":
        return (), {"input_ids": idx, "labels": targets, "use_cache": False}
    return (idx, targets), {}


def recompute_parity(styles: list[str], steps: int = 3) -> dict:
    """Per style: loss, gradients and AdamW steps of the parallelized checkpointing model against the unsharded
    one (checkpointing too; no dropout) or, with dropout, against the parallelized model without checkpointing
    on the same seed (the recomputation must draw the forward's masks); the regions recomputed."""
    out = {}
    for style in styles:
        ref, (idx, targets) = build(style, recompute=style != "dropout")
        model, _ = build(style, recompute=True)
        tpm = autotp.parallelize(model, example_inputs=_example(style, idx, targets))
        if style == "dropout":  # the same sharded model without checkpointing is the reference
            ref = autotp.parallelize(copy.deepcopy(build(style, recompute=False)[0]),
                                     example_inputs=_example(style, idx, targets))
        regions = sum(1 for c in autotp.tp_state(tpm).graphs.values()
                      for name, _ in c.module.named_children() if name.startswith("autotp_recompute_"))
        opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (tpm, ref))
        diffs = {"loss": 0.0, "grad": 0.0}
        for step in range(steps):
            torch.manual_seed(100 + step)  # the same dropout draws for both models
            loss = loss_of(tpm, style, idx, targets)
            loss.backward()
            torch.manual_seed(100 + step)
            rloss = loss_of(ref, style, idx, targets)
            rloss.backward()
            rp = dict(ref.named_parameters())
            local = (lambda n, t: t) if style == "dropout" else (lambda n, t: _local(t, n, tpm))
            diffs["loss"] = max(diffs["loss"], (loss - rloss).abs().item())
            diffs["grad"] = max([diffs["grad"]] + [(p.grad - local(n, rp[n].grad)).abs().max().item()
                                                   for n, p in tpm.named_parameters()])
            for o in (opt, ropt):
                o.step()
                o.zero_grad()
        rp = dict(ref.named_parameters())
        local = (lambda n, t: t) if style == "dropout" else (lambda n, t: _local(t, n, tpm))
        diffs["param"] = max((p - local(n, rp[n])).abs().max().item() for n, p in tpm.named_parameters())
        out[style] = {**diffs, "regions": regions}
    return out
