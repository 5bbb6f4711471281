"""One count of what a rank holds (autotp.parallel.held), used by the benchmarks' reports as by ``autotp
shard``'s summary: a DTensor counts its local shard, a tied tensor once, AdamW's step counts are no state."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from autotp.parallel.held import held, held_grads, held_params, held_state
from ranks import ROOT

sys.path[:0] = [f"{ROOT}/benchmarks"]


@pytest.fixture
def fake_world():
    """Rank 0 of 4 in this process (torch's fake process group: collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _trained(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def test_a_dtensor_counts_its_local_shard(fake_world) -> None:
    """A parameter sharded over 4 ranks (16 × 8, Shard(0)): this rank holds 4 × 8 of it, its gradient and
    AdamW's two moments likewise; a plain parameter beside it counts whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (4,))
    model = torch.nn.Module()
    model.sharded = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 8), mesh, [Shard(0)]))
    model.plain = torch.nn.Parameter(torch.randn(8))
    assert model.sharded.numel() == 128  # the global size
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    opt.step()
    assert held_params(model) == held_grads(model.parameters()) == held_state(opt)
    assert held_params(model).elements == 4 * 8 + 8 and held_params(model).bytes == 4 * 40


def test_benchmark_state_bytes_use_the_accessor() -> None:
    """benchmarks/run.py and benchmarks/fsdp.py count AdamW's moments, not its step counts (which they once
    added: 4 bytes per parameter tensor), and a tied weight once."""
    import fsdp
    import run

    lin = torch.nn.Linear(4, 3)
    model = torch.nn.Sequential(lin, lin)  # the same weight reached twice
    opt = _trained(model)
    assert any(torch.is_tensor(s.get("step")) for s in opt.state.values())
    want = {"params": 60, "grads": 60, "adam": 120, "total": 240}
    assert run._state_bytes(model, opt) == want
    assert fsdp._state_bytes(model, opt) == want


def test_load_benchmark_held_counts_buffers_once() -> None:
    """benchmarks/load_weights.py's ``_held``: parameters and buffers, a buffer two modules share once."""
    import load_weights

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    table = torch.zeros(5)
    model[0].register_buffer("table", table)
    model[1].register_buffer("table", table)
    assert load_weights._held(model) == held([*model.parameters(), table]).bytes == (15 + 8 + 5) * 4
