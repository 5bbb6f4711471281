"""Sampling loops that feed back their own tokens give the unsharded model's tokens under a fixed seed,
for models whose causal mask is a buffer sliced to the sequence (export guards T == block_size apart)."""
from __future__ import annotations

import pytest
import torch

from ranks import launch
from sampling_workers import BLOCK, CASES, MaskConfig, MaskedGPT, sampling_loops


def _check(results: dict[int, dict], names: list[str], world: int) -> None:
    assert sorted(results) == list(range(world))
    for rank, r in results.items():
        assert r["tp"] == world
        assert sorted(r["cases"]) == sorted(names)
        for name in names:
            case, got = CASES[name], r["cases"][name]
            assert got["tp"] == got["ref"], (rank, name, got)
            assert len(got["ref"]) == case.batch and len(got["ref"][0]) == case.prompt + case.steps
        # every rank samples the same tokens: the logits each rank reads are the same gathered tensor
        assert r["cases"] == results[0]["cases"]


@pytest.mark.slow
def test_sampling_loops_tp2():
    names = list(CASES)
    results = launch(sampling_loops, 2, names)
    _check(results, names, 2)
    for r in results.values():
        # the mask-buffer spellings reach T == block_size after a graph captured at a shorter T: each got
        # a graph of its own for it; nanoGPT's flash spelling keeps one graph for every length
        assert r["guarded"]["masked"] >= 1 and r["guarded"]["lecture"] >= 1
        assert r["guarded"]["flash"] == 0


@pytest.mark.slow
@pytest.mark.extended
def test_sampling_loop_tp4():
    names = ["masked/own/train/b2/p5"]  # the default capture (2, 8) rejects T = 5: a second graph
    _check(launch(sampling_loops, 4, names), names, 4)


@pytest.mark.parametrize("guard_fn", [True, False])
@pytest.mark.parametrize("captured_at", [5, BLOCK])
def test_input_guard_tells_block_size_apart(captured_at: int, guard_fn: bool):
    """The graph's own guards decide which sequence lengths it takes: captured below block_size it takes
    every length from 2 up to block_size - 1, captured at block_size only block_size. A module without a
    guard function (older torch) is asked what its input check takes: the recorded range and static sizes."""
    from autotp.capture.tracer import capture, input_guard

    model = MaskedGPT(MaskConfig())
    gm, _ = capture(model, (torch.zeros(2, captured_at, dtype=torch.long),), {})
    if not guard_fn:
        delattr(gm, "_guards_fn")
    accepts = input_guard(gm)
    taken = [t for t in range(2, BLOCK + 1) if accepts([torch.zeros(3, t, dtype=torch.long)])]
    below = list(range(2, BLOCK)) if guard_fn else list(range(2, BLOCK + 1))  # the range check allows T = 8
    assert taken == (below if captured_at < BLOCK else [BLOCK])
    assert not accepts([torch.zeros(3, BLOCK + 1, dtype=torch.long)])  # assert t <= block_size bounds it
