"""Rank functions for tests/test_context_parallel.py: a captured forward run on each rank's sequence chunk
against the whole model on one device."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ranks import CollectiveLog


def _nanogpt_sdpa(layers: int):
    """nanoGPT's flash path (``F.scaled_dot_product_attention(..., is_causal=True)``), tests/scripts."""
    from nanogpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=layers, n_head=4, n_embd=64, block_size=64, vocab_size=128))


def context_parity(cp_steps: int = 3, seq: int = 32, ignore: bool = False) -> dict:
    """The graph rewritten for the world as one cp group: the loss, the logits (gathered) and, after the
    parameter gradients are summed over the group, ``cp_steps`` AdamW steps, against one device."""
    from autotp.analysis.context import find_context
    from autotp.capture.tracer import capture
    from autotp.plan.context import context_plan
    from autotp.passes.context_parallel import context_parallel

    cp, group = dist.get_world_size(), dist.group.WORLD
    model = _nanogpt_sdpa(2)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 128, (2, seq), generator=g), torch.randint(0, 128, (2, seq), generator=g))
               for _ in range(cp_steps)]
    if ignore:  # some targets not counted: the mean is over the counted ones of the whole group
        for _, t in batches:
            t[:, : seq // 3] = -1
    gm, _ = capture(model, batches[0], {})
    plan = context_plan(gm, find_context(gm, cp), cp)
    gm = context_parallel(gm, plan)
    gm.graph.lint()
    gm.recompile()
    for m in gm.modules():
        if hasattr(m, "bind") and m is not gm:
            m.bind(group)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (gm, ref))
    errors = {"loss": 0.0, "logits": 0.0, "grads": 0.0, "params": 0.0}
    calls = None
    for step, (idx, targets) in enumerate(batches):
        with CollectiveLog() as log:
            logits, loss = gm(idx, targets)
            loss.backward()
        if step == 0:
            calls = log.calls
        for p in gm.parameters():  # each rank's gradient covers its own tokens: summed over the group
            dist.all_reduce(p.grad, group=group)
        want_logits, want = ref(idx, targets)
        want.backward()
        errors["loss"] = max(errors["loss"], abs(loss.item() - want.item()))
        errors["logits"] = max(errors["logits"], (logits - want_logits).abs().max().item())
        mine, theirs = dict(gm.named_parameters()), dict(ref.named_parameters())
        errors["grads"] = max(errors["grads"], max((mine[k].grad - theirs[k].grad).abs().max().item() for k in mine))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        errors["params"] = max(errors["params"], max((mine[k] - theirs[k]).abs().max().item() for k in mine))
    return {"errors": errors, "calls": calls, "plan": plan}


def context_parities(steps: int = 3, seq: int = 32) -> dict[bool, dict]:
    """:func:`context_parity` without and with ignored targets, in one launch."""
    return {ignore: context_parity(steps, seq, ignore) for ignore in (False, True)}
