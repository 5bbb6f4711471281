"""Ring attention (context parallelism's attention) and the load-balanced sequence chunks."""
from __future__ import annotations

import pytest
import torch

from autotp.operators.ring_attention import local_positions, shard_sequence, unshard_sequence


def test_head_tail_chunks():
    """Rank r of cp holds chunks r and 2·cp−1−r of 2·cp: every rank the same share of causal work."""
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert local_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    every = torch.cat([local_positions(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))


@pytest.mark.parametrize("cp", [2, 4])
def test_shard_then_unshard_is_the_identity(cp):
    x = torch.randn(2, 3, 16, 5)
    parts = [shard_sequence(x, 2, cp, r) for r in range(cp)]
    assert all(p.shape == (2, 3, 16 // cp, 5) for p in parts)
    assert torch.equal(unshard_sequence(parts, 2), x)


def test_a_sequence_not_divisible_by_twice_cp_is_named():
    with pytest.raises(ValueError, match=r"cp 4 needs a sequence length divisible by 8; got 12"):
        local_positions(12, 4, 0)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.extended)])  # 4 ranks: the extended run
def test_ring_attention_matches_one_device(cp):
    """Causal (load-balanced) and full attention, GQA and MQA, a given scale: the output and the q, k, v
    gradients of each rank's chunk are one device's SDPA within 1e-5 (fp32). Forward: one all-gather of
    K and V; backward: another, and the K/V gradients passed on cp times (all-to-alls)."""
    from ranks import launch
    from ring_workers import CASES, ring_cases

    results = launch(ring_cases, cp)
    for name, (b, hq, hkv, s, d, causal, scale) in CASES.items():
        for rank, by_case in results.items():
            r = by_case[name]
            assert max(r["errors"].values()) <= 1e-5, (name, rank, r["errors"])
            kv = 2 * b * hkv * s * d  # k and v with their own heads (GQA's are not repeated), whole sequence
            assert r["forward"] == [("all_gather", "", kv)], (name, r["forward"])
            kinds = [c[0] for c in r["backward"]]
            assert kinds.count("all_gather") == 1 and kinds.count("all_to_all_single") == cp, (name, kinds)
