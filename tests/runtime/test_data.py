"""The ranks of one tensor-parallel group see the same batch: a fingerprint check, Megatron's broadcast,
and sampling over the data-parallel group only."""
from __future__ import annotations

import pytest

import torch

from data_workers import dp_sampling, mismatch_and_broadcast
from ranks import launch

from autotp.parallel.data import _fingerprint


def test_fingerprints_are_bit_exact_and_order_sensitive():
    x = torch.randn(4, 8)
    assert _fingerprint(x) == _fingerprint(x.clone())
    assert _fingerprint(x) != _fingerprint(x.flip(0))  # a shuffled batch is another batch
    y = x.clone()
    y.view(-1)[5] = torch.nextafter(y.view(-1)[5], torch.tensor(1e9))  # one ulp
    assert _fingerprint(x) != _fingerprint(y)
    assert _fingerprint(torch.zeros(2, 3)) != _fingerprint(torch.zeros(3, 2))
    assert _fingerprint(3) != _fingerprint(4) and _fingerprint(None) == _fingerprint(None)


@pytest.mark.slow
def test_mismatched_tp_inputs_are_refused_and_broadcast_fixes_them():
    for rank, r in launch(mismatch_and_broadcast, 2).items():
        assert r["same_ok"]
        assert "kwargs['batch']['extra'][1]" in r["differs"] and "group ranks [1]" in r["differs"], r["differs"]
        assert "args[0]" in r["order"]
        assert r["broadcast_equal"]
        assert "args[0]" in r["model_refuses"] and "broadcast_batch" in r["model_refuses"], r["model_refuses"]
        assert r["untouched"]
        assert r["loss_diff"] <= 1e-5, r


@pytest.mark.slow
@pytest.mark.extended
def test_dp_sampler_and_broadcast_follow_the_layout():
    r = launch(dp_sampling, 4)
    # tp innermost: TP groups [0,1] [2,3]; DP groups [0,2] [1,3]
    assert [r[i]["tp_members"] for i in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [(r[i]["dp_rank"], r[i]["dp_size"]) for i in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert r[0]["indices"] == r[1]["indices"] and r[2]["indices"] == r[3]["indices"]
    assert not set(r[0]["indices"]) & set(r[2]["indices"]) and len(r[0]["indices"]) == 8
    assert [r[i]["got"] for i in range(4)] == [[0.0, 0.0], [0.0, 0.0], [2.0, 2.0], [2.0, 2.0]]
