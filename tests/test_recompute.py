"""The model's own activation checkpointing survives parallelize: each torch.utils.checkpoint call (non-
reentrant, reentrant, around a function, around the MLP alone, Hugging Face's gradient_checkpointing_enable)
becomes a region the rewritten graph runs under checkpoint again, so a rank keeps what the model kept, and
the numbers are the unsharded model's."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autotp
from ranks import launch
from recompute_models import LAYERS, STYLES, build, loss_of
from recompute_workers import _example, recompute_parity


@pytest.fixture
def fake_tp2():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _kept_bytes(model, style: str, idx, targets) -> int:
    """Bytes autograd keeps for backward in one forward, each storage once, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(model, style, idx, targets)
    return sum(seen.values())


@pytest.mark.parametrize("style", STYLES)
def test_checkpointed_regions_are_recomputed(style: str, fake_tp2):
    kept = {}
    for recompute in (False, True):
        model, (idx, targets) = build(style, recompute)
        tpm = autotp.parallelize(model, example_inputs=_example(style, idx, targets))
        kept[recompute] = _kept_bytes(tpm, style, idx, targets)
        regions = [n for c in autotp.tp_state(tpm).graphs.values() for n, _ in c.module.named_children()
                   if n.startswith("autotp_recompute_")]
        assert len(regions) == (LAYERS if recompute else 0), (style, recompute, regions)
    assert kept[True] < 0.7 * kept[False], kept  # the layers' insides are no longer kept


def test_capture_leaves_checkpoint_as_it_was():
    import torch.utils.checkpoint as cp

    before = (cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction.apply)
    model, (idx, targets) = build("reentrant")
    from autotp.capture.tracer import capture

    capture(model, (idx, targets), {})
    assert (cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction.apply) == before
    assert "apply" not in cp.CheckpointFunction.__dict__


# every style at tp 2; at tp 4 the reentrant one and one whose region draws random numbers (the others in
# the extended run)
AT = {(2, False): STYLES, (4, False): ["reentrant", "dropout"],
      (4, True): [s for s in STYLES if s not in ("reentrant", "dropout")]}


@pytest.mark.slow
@pytest.mark.parametrize("world,rest", [(2, False), (4, False), pytest.param(4, True, marks=pytest.mark.extended)])
def test_checkpointing_models_train_exactly(world: int, rest: bool):
    for rank, r in launch(recompute_parity, world, AT[world, rest]).items():
        assert list(r) == AT[world, rest]
        for style, d in r.items():
            assert d["regions"] == LAYERS, (rank, style, d)
            assert d["loss"] <= 1e-5 and d["grad"] <= 1e-5 and d["param"] <= 1e-5, (rank, style, d)
