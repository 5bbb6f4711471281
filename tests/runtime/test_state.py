"""The state accessor, the tensor swap every in-place change of a model uses, and launch errors as flags."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autotp.cli.run import as_flags
from autotp.distributed.launch import LaunchSpec
from autotp.errors import LaunchError
from autotp.io.empty import swap_tensors
from autotp.options import Options
from autotp.state import RankIdentity, TPState, attach_state, detach_state, find_tp_state, tp_state


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter under two names
        self.register_buffer("mask", torch.ones(2))


def test_state_is_attached_and_found_through_the_accessor() -> None:
    model = _Tied()
    assert find_tp_state(model) is None
    with pytest.raises(TypeError, match="_Tied is not parallelized"):
        tp_state(model)
    st = TPState(RankIdentity(None, 2, 1, torch.device("cpu")), Options(), base=_Tied, forward=None)
    attach_state(model, st)
    assert tp_state(model) is st and find_tp_state(model) is st
    assert "_autotp" not in dict(model.named_modules()) and not any("autotp" in k for k in model.state_dict())
    detach_state(model)
    assert find_tp_state(model) is None


def test_swap_tensors_keeps_ties_and_calls_make_once_per_tensor() -> None:
    model = _Tied()
    calls = []

    def halve(p: torch.Tensor) -> nn.Parameter | None:
        calls.append(p.shape)
        return nn.Parameter(p.detach()[:, :2].clone()) if p.dim() == 2 else None

    assert swap_tensors(model, "parameters", halve) == 1
    assert calls == [torch.Size([5, 3])]  # the tied weight once
    assert model.emb.weight is model.head.weight and model.emb.weight.shape == (5, 2)
    mask = torch.zeros(2)
    assert swap_tensors(model, "buffers", lambda b: mask) == 1 and model.mask is mask


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=0), "--tp must be an integer >= 1, got 0"),
    (dict(tp=2, nnodes=2, node_rank=2, master_addr="a", master_port=1), "--node-rank 2 is out of range [0, 2) for --nnodes 2"),
    (dict(tp=2, nnodes=2), "--nnodes 2 needs --master-addr and --master-port"),
    (dict(tp=2, dp=2, world=8), "--tp 2 × --dp 2 × --pp 1 = 4 ranks, not the --world-size 8"),
    (dict(tp=2, dp=3, world=6, nnodes=4, master_addr="a", master_port=1),
     "--world-size 6 ranks do not divide into --nnodes 4 equal nodes"),
    (dict(tp=4, dp=4, world=16, nnodes=4, master_addr="a", master_port=1, fsdp=True, hsdp=2),
     "--hsdp 2: a shard group of 2 data-parallel ranks would span nodes (4 ranks per node)"),
])
def test_launch_errors_name_settings_and_the_cli_names_flags(kwargs: dict, message: str) -> None:
    with pytest.raises(LaunchError) as info:
        LaunchSpec(**kwargs)
    assert "--" not in str(info.value).split("\n")[0]  # the library names its own fields
    assert as_flags(info.value).startswith(message)


def test_with_world_dp_counts_every_nodes_replicas_and_stages_sit_on_different_nodes() -> None:
    """LaunchSpec(world=W) (autotp shard --world-size): world = tp × cp × dp × pp, W / nnodes ranks per node, in
    Megatron's order; the per-node spelling (no world) multiplies dp by the nodes, as before."""
    spec = LaunchSpec(tp=4, dp=4, pp=4, world=64, nnodes=8, master_addr="h", master_port=1, fsdp=True)
    assert (spec.nproc_per_node, spec.world_size, spec.data_parallel) == (8, 64, 4)
    assert spec.job("gloo").grid.dp == 4 and spec.grid.gpus_per_node == 8
    stage0 = next(g for g in spec.grid.pp_groups if 0 in g)
    assert stage0 == [0, 16, 32, 48]  # stage p on nodes 2p and 2p + 1
    assert [spec.grid.coords(r)["node"] for r in stage0] == [0, 2, 4, 6]
    assert spec.grid.tp_groups[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # each inside a node
    per_node = LaunchSpec(tp=2, dp=1, pp=2, nnodes=2, master_addr="h", master_port=1)
    assert (per_node.nproc_per_node, per_node.world_size, per_node.data_parallel) == (4, 8, 2)
    # HSDP's shard groups inside a node: allowed either way
    LaunchSpec(tp=2, dp=8, world=16, nnodes=2, master_addr="h", master_port=1, fsdp=True, hsdp=2)
