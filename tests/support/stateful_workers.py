"""Rank functions of tests/capture/test_capture_safety.py: each stateful spelling (tests/support/stateful_models.py) parallelized,
checked untouched, trained and sampled against the unsharded model; and a parallelize made to fail."""
from __future__ import annotations

import torch
import torch.distributed as dist

import autotp
from parity_workers import _local, _max_diff
from stateful_models import S, build, diff, snapshot

# what parallelize documents it changes: each module's parameters (this rank's shards, same names) and the
# state it keeps on the root (autotp.tp_state); the class is checked on its own
DOCUMENTED = ("_parameters", "_autotp")


def _greedy(model: torch.nn.Module, idx: torch.Tensor, steps: int) -> torch.Tensor:
    """nanoGPT's sampling loop, greedy: the forward called with ``targets=None`` on a growing context."""
    with torch.no_grad():
        for _ in range(steps):
            logits, _ = model(idx[:, -S:])
            idx = torch.cat((idx, logits[:, -1, :].argmax(-1, keepdim=True)), dim=1)
    return idx


def stateful_parity(styles: list[str], steps: int = 3) -> dict:
    tp = dist.get_world_size()
    out = {}
    for style in styles:
        ref, (x, y) = build(style)
        model = build(style)[0]
        before = snapshot(model)
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        model = autotp.parallelize(model, example_inputs=(x, y))
        changed = diff(before, snapshot(model), skip=DOCUMENTED)
        st = autotp.tp_state(model)
        same_names = names == [n for n, _ in model.named_parameters(remove_duplicate=False)]
        opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (model, ref))
        loss_diff = 0.0
        for _ in range(steps):
            got, want = model(x, y), ref(x, y)
            loss_diff = max(loss_diff, _max_diff(got[1], want[1]), _max_diff(got[0], want[0]))
            for o, (_, loss) in ((opt, got), (ropt, want)):
                o.zero_grad()
                loss.backward()
                o.step()
        rparams = dict(ref.named_parameters())
        prompt = x[:, :4]
        out[style] = {
            "changed": changed, "same_names": same_names, "loss_diff": loss_diff,
            "param_diff": max(_max_diff(p, _local(rparams[n], n, model)) for n, p in model.named_parameters()),
            "same_tokens": torch.equal(_greedy(model, prompt, 6), _greedy(ref, prompt, 6)),
            "fraction": sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in ref.parameters()),
            "replicated": [list(r) for c in st.graphs.values() for r in c.plan.replicated],
            "tp": tp,
        }
    return out
