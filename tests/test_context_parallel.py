"""Context parallelism end to end on a captured forward: each rank runs its head-tail chunk of the sequence,
attention as torch's ring, positions and the loss global; exact against one device."""
from __future__ import annotations

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_training_matches_one_device(cp):
    """nanoGPT (SDPA, causal, learned positions) at cp 2 and 4: the loss, the gathered logits, the summed
    parameter gradients and 3 AdamW steps within 1e-5 of one device (fp32), with and without ignored
    targets. Collectives of a step: per layer one K/V all-gather forward, one all-gather and cp
    all-to-alls backward; the loss's sum and count (two all-reduces); the logits' gather."""
    from ranks import launch
    from context_workers import context_parities

    results = launch(context_parities, cp, 3, 32)
    for ignore in (False, True):
        for rank, by_case in results.items():
            r = by_case[ignore]
            assert max(r["errors"].values()) <= 1e-5, (cp, ignore, rank, r["errors"])
            plan = r["plan"]
            assert len(plan.attention) == 2 and len(plan.positions) == 1 and len(plan.losses) == 1
            kinds = [c[0] for c in r["calls"]]
            assert kinds.count("all_to_all_single") == 2 * cp, kinds
            assert kinds.count("all_reduce") == 2, kinds
