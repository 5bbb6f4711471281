"""An eager island's backward communicates as Megatron's block does: one all-reduce for the block, its
input's gradient and the router's (the parameters it keeps whole) flattened into one bucket, exact; and an
island runs inside its block's FSDP unit (FSDP over dp gathers its experts' TP shards), exact."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autotp.parallel.islands import module_planner
from autotp.plan.islands import plan_island
from moe_island_models import E, H, S, MoE
from island_workers import backward_collectives, expert_parallel_islands, fsdp_island_parity
from ranks import launch

STYLES = ["nonzero", "bool_mask"]  # index_add_ over nonzero's tokens; a boolean mask with a load-balancing loss


def test_experts_with_dropout_stay_whole_with_the_reason_and_the_stream_untouched():
    """Dropout inside an expert: a rank's slice of its mask would not be the unsharded model's. Found whatever
    mode the block is planned in (a model parallelized in eval mode trains later); the probes leave the
    random stream where it was, so the model's own dropout draws stay the unsharded model's."""
    block = MoE("nonzero")
    for ex in block.experts:  # SwiGLU's product dropped out before its row matmul
        ex.w2 = nn.Sequential(nn.Dropout(0.1), ex.w2)
    block.eval()
    x = torch.randn(2, 8, H)
    before = torch.get_rng_state()
    shapes = dict([*block.named_parameters(), *block.named_buffers()])
    plan = plan_island(block, "moe", (x,), {}, 2, shapes, module_planner(2))
    assert plan.params == () and plan.reason.startswith("experts.0, experts.1, experts.2 ... draw random numbers "
                                                        "in training (dropout)"), plan.reason
    assert torch.equal(torch.get_rng_state(), before) and not any(m.training for m in block.modules())


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("style", STYLES)
def test_an_island_backward_is_one_all_reduce(style: str):
    bsh = 2 * S * H  # the batch's hidden state: (2, S, H)
    for rank, r in launch(backward_collectives, 2, style).items():
        assert r["grad"] <= 1e-5, (rank, r)
        assert r["cut"] <= 1 / 2 + 0.12, r["cut"]
        assert all(w == [f"{p}.gate.weight"] for p, w in r["islands"].items()) and len(r["islands"]) == 2
        # Megatron's 2L + 1: per block the f before attention and the island's bucket (its input's gradient
        # and the router's, E·H), then the LM head's input; no all-reduce of the router's gradient alone
        assert r["backward"] == [("sum", bsh), ("sum", bsh + E * H)] * 2 + [("sum", bsh)], (rank, r["backward"])


@pytest.mark.slow
@pytest.mark.extended
def test_islands_train_inside_fsdp_units():
    """dp 2 × tp 2: each data-parallel replica on half the batch, 3 AdamW steps against the unsharded model."""
    for rank, r in launch(fsdp_island_parity, 4, "where").items():
        assert r["units"] == ["emb", "blocks.0", "blocks.1", "norm"], r["units"]  # the islands in their blocks'
        assert max(r["loss"], r["param"]) <= 1e-5, (rank, r)


@pytest.mark.slow
@pytest.mark.extended
def test_expert_parallel_says_each_island_keeps_expert_tensor_parallelism():
    for rank, r in launch(expert_parallel_islands, 2, "nonzero").items():
        assert r["loss"] <= 1e-5, (rank, r)
        # exact, and said: the experts of an island are cut by columns and rows, not placed whole per rank
        assert r["said"] and r["said"][0].startswith("autotp: expert_parallel: blocks.0.moe branches on the data"), r
        assert all("cut by columns and rows on every rank" in m for m in r["said"]), r["said"]
