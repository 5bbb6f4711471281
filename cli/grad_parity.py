"""The parity check's second half: gradients and one optimizer step, beside the loss and outputs.

A loss and logits that match say nothing of the backward: a model's own autograd Function run where its
backward cannot be right (a term built over the whole vocab, on a rank that holds a part of it) gives the
single-device loss and still trains apart. :func:`compare_grads` runs one forward and backward of the sharded
and the unsharded model on the example batch (eval mode: no dropout), compares every parameter's gradient
with the unsharded one cut to this rank's shard, then one AdamW step of each, and puts the sharded model back
as it was (parameters, no gradients), so training starts from the same place. The worst rank's difference
decides, with the parameter it is in.

Not compared (None): a model without a loss on the batch, FSDP (its parameters are DTensors of the data-
parallel group) and context parallelism (each rank's gradients cover its part of the sequence until the
gradient sync).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

import autotp
from autotp.capture.modelfile import find_loss


class GradParity(NamedTuple):
    grad_diff: float  # the largest |Δ| of any gradient element, over every rank
    grad_param: str  # the parameter it is in
    step_diff: float  # the largest |Δ| of any parameter after one AdamW step (lr 1e-3, eps 1e-3), every rank
    step_param: str


def _local(st, tpm: torch.nn.Module, name: str, whole: torch.Tensor) -> torch.Tensor:
    """``whole`` (the unsharded model's tensor for parameter ``name``) cut as this rank holds it."""
    shard = st.plan.param(name)
    if shard is None:  # a tied parameter: the plan names it once
        p = tpm.get_parameter(name)
        shard = next((st.plan.param(o) for o, q in tpm.named_parameters(remove_duplicate=False)
                      if q is p and st.plan.param(o) is not None), None)
    return whole if shard is None else shard.shard(whole, st.tp, st.rank)


def _worst(tpm: torch.nn.Module, reference: torch.nn.Module, st, read) -> tuple[float, str]:
    ref = dict(reference.named_parameters(remove_duplicate=False))
    worst, where = 0.0, ""
    for name, p in tpm.named_parameters():
        got, want = read(p), read(ref[name])
        if got is None or want is None:
            diff = 0.0 if got is None and want is None else float("inf")
        else:
            want = _local(st, tpm, name, want)
            diff = float("inf") if got.shape != want.shape else (got.double() - want.double()).abs().max().item()
        if diff > worst or not where:
            worst, where = diff, name
    return worst, where


def _everywhere(found: tuple[float, str]) -> tuple[float, str]:
    every: list[tuple[float, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, found)
    return max(every, key=lambda x: x[0])


def compare_grads(tpm: torch.nn.Module, reference: torch.nn.Module, args: tuple, kwargs: dict) -> GradParity | None:
    """Gradients and one AdamW step of ``tpm`` against ``reference`` on ``(args, kwargs)`` (see the module);
    ``tpm`` is left with the parameters it had and no gradients. Every rank calls it."""
    st = autotp.tp_state(tpm)
    if st.options.fsdp is not None or getattr(st.options, "context_parallel", 1) > 1:
        return None
    tpm.eval()
    reference.eval()
    try:
        got, want = find_loss(tpm(*args, **kwargs)), find_loss(reference(*args, **kwargs))
        if got is None or want is None or not got.requires_grad:
            return None
        tpm.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        got.backward()
        want.backward()
        grads = _everywhere(_worst(tpm, reference, st, lambda p: p.grad))
        before = [p.detach().clone() for p in tpm.parameters()]
        for m in (tpm, reference):
            # eps 1e-3: Adam's first step divides each gradient by its own size, which would blow the fp32
            # rounding of a gradient near zero (1e-10 on 1e-8) up to lr / 20; with this eps an update differs
            # by at most the gradient's difference
            torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-3).step()
        step = _everywhere(_worst(tpm, reference, st, lambda p: p.detach()))
        with torch.no_grad():
            for p, b in zip(tpm.parameters(), before):
                p.copy_(b)
    finally:
        tpm.zero_grad(set_to_none=True)
        tpm.train()
    return GradParity(grads[0], grads[1], step[0], step[1])
