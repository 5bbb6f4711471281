"""Rank-side code for tests/capture/test_custom_functions.py: the command line's gradient parity check."""
from __future__ import annotations

import torch

import autotp


def grad_parity_catches(kind: str, wrong: str) -> dict:
    """``compare_grads`` (the gradient half of ``autotp shard``'s parity check) on helper_models' ``kind``:
    as sharded, then with ``wrong``'s gradient negated on every rank (a wrong backward); and whether
    the sharded model came back with its parameters and no gradients."""
    from autotp.cli.grad_parity import compare_grads
    from helper_models import build

    ref, args, _ = build(kind)
    model = autotp.parallelize(build(kind)[0], example_inputs=args)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    right = compare_grads(model, ref, args, {})
    kept = all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())
    model.get_parameter(wrong).register_hook(lambda g: -g)
    bad = compare_grads(model, build(kind)[0], args, {})
    return {"right": tuple(right), "wrong": tuple(bad), "kept": kept}
