"""The fast tier's core rules (no process): shard slicing, view grouping, Megatron's head-count rules, the Plan
as data."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from autotp.errors import ShardingError
from autotp.plan.plan import WholeParam
from autotp.plan.plan import Plan
from autotp.analysis.ops import parts_for
from autotp.analysis.shapes import view_groups
from autotp.shard_spec import Segment, Sharding, local_indices, shard_tensor, unshard_tensor


def test_fused_segments_give_each_rank_its_slice_of_every_segment():
    w = torch.arange(12.0).repeat_interleave(2).view(12, 2)  # rows 0..11: q=0..3, k=4..7, v=8..11
    segs = (Segment(4, 2), Segment(4, 2), Segment(4, 2))
    r0 = shard_tensor(w, 0, segs, 2, 0)[:, 0].tolist()
    r1 = shard_tensor(w, 0, segs, 2, 1)[:, 0].tolist()
    assert r0 == [0, 1, 4, 5, 8, 9]
    assert r1 == [2, 3, 6, 7, 10, 11]
    assert torch.equal(unshard_tensor([shard_tensor(w, 0, segs, 2, r) for r in range(2)], 0, segs, 2), w)


def test_unequal_segments_and_replicated_kv_heads():
    # 4 query heads of 2, 2 kv heads of 2, tp = 4: each rank one q head; kv head r // 2
    segs = (Segment(8, 4), Segment(4, 2), Segment(4, 2))
    got = [local_indices(segs, 4, r).tolist() for r in range(4)]
    assert got == [[0, 1, 8, 9, 12, 13], [2, 3, 8, 9, 12, 13], [4, 5, 10, 11, 14, 15], [6, 7, 10, 11, 14, 15]]


def test_contiguous_shard_is_a_narrow():
    x = torch.randn(3, 8)
    assert torch.equal(shard_tensor(x, 1, (Segment(8, 4),), 4, 2), x[:, 4:6])


@pytest.mark.parametrize("src,dst,expected", [
    ([2, 5, 64], [2, 5, 4, 16], [([0], [0]), ([1], [1]), ([2], [2, 3])]),
    ([2, 4, 5, 16], [2, 4, 80], [([0], [0]), ([1], [1]), ([2, 3], [2])]),
    ([2, 5, 64], [10, 64], [([0, 1], [0]), ([2], [1])]),
    ([2, 1, 5, 16], [2, 5, 16], [([0], [0]), ([1, 2], [1]), ([3], [2])]),
    ([2, 5, 16], [2, 5, 1, 16], [([0], [0]), ([1], [1]), ([2], [2, 3])]),  # one kv head of 16
    ([2, 5, 16], [2, 5, 16, 1], [([0], [0]), ([1], [1]), ([2], [2, 3])]),
])
def test_view_groups(src, dst, expected):
    assert view_groups(src, dst) == expected


def test_view_groups_rejects_mismatched_sizes():
    with pytest.raises(ValueError, match="number of elements"):
        view_groups([2, 3], [7])


def test_head_rules_follow_megatron():
    assert parts_for(8, 128, 4, "heads") == 4  # split
    assert parts_for(2, 32, 4, "kv heads") == 2  # fewer kv heads than ranks: replicate
    with pytest.raises(ShardingError, match=r"attn: 6 is not divisible by tp=4"):
        parts_for(6, 96, 4, "attn")


def test_plan_is_immutable_json_data():
    from autotp.plan.plan import Rewrite
    from autotp.plan.plan import (Collective, ColumnForm, ExpertLayer, ExpertSlot, LocalSlice, PairPlan, ParamShard,
                                  SeqEnter, SeqGather, SeqLeave, SeqSlice, SequencePlan, Stat, Unit)

    shard = ParamShard("column", "h.0.attn.c_attn", 0, (Segment(64, 2),) * 3, (192, 64), (96, 64))
    plan = Plan(tp=2, params=(("h.0.attn.c_attn.weight", shard),),
                pairs=(PairPlan("h.0.attn", ("linear",), ("h.0.attn.c_attn.weight",), ("ln",), "linear_1",
                                "h.0.attn.c_proj.weight", "h.0.attn.c_proj.bias"),),
                rewrites=(Rewrite("view", 1, 2, 4, 2), Rewrite("reshape", 1, 0, 4, 2, factor_of="mul_2")),
                collectives=(Collective("all_reduce", "sum", "forward", "h.0.attn", "linear_1", ("s0", "s1", "64")),),
                random_nodes=("dropout_1",), replicated=(("lm_head", "reason"),),
                local_slices=(LocalSlice("baddbmm", "alibi", 0, (Segment(4, 2),), outer=True),),
                stats=(Stat("mean_1", "mean", 0.5, (-1,), True), Stat("var_1", "var", 0.5, None, False, 1.0),
                       Stat("rms_norm", "rms_norm", 1.0)),
                column_forms=(ColumnForm("linear", "ln", "out_in", "h_0_attn_c_attn_weight", None),
                              ColumnForm("addmm", "view_1", "in_out", "h_0_mlp_c_fc_weight", "h_0_mlp_c_fc_bias")),
                buffers=(("h.0.attn.k_cache", ParamShard("column", "h.0.attn", 1, (Segment(4, 2),), (2, 4, 16, 8),
                                                         (2, 2, 16, 8))),),
                sequence=SequencePlan(length=("tensors_0", 1), leaves=(SeqLeave("h.0.attn", "addmm_1", "view_7", 1),),
                                      enters=(SeqEnter("h.0.attn", "view_1", "ln", 1, ("addmm",), True, True),),
                                      gathers=(SeqGather("ln_f", 1, ("index", "output"), "slices the sequence"),),
                                      slices=(SeqSlice("add", "pos", 0, True),), grads=(("ln", "ln_w"),),
                                      enter_grads=(("mul", "w1"),), sizes=(("view_23", 1, 1, 1),), notes=("n",)))
    grouped = ParamShard("column", "h.1.attn.qkv", 0, (Segment(192, 2, (Segment(64, 1), Segment(16, 1), Segment(16, 1))),),
                         (192, 64), (96, 64))
    plan = dataclasses.replace(plan, params=plan.params + (("h.1.attn.qkv.weight", grouped),),
                               whole=(WholeParam("wpe.weight", "wpe", "position embedding"),),
                               experts=(ExpertLayer("h.0.moe", 4, ("h.0.moe.w1",), (("select_1", 1),), ("index_2",),
                                                    ("grouped_mm",), (ExpertSlot(1, ("mm", "silu"), ("x",), "mm_2"),),
                                                    2, 64),),
                               experts_kept=(("h.1.moe", "separate modules"),),
                               units=(Unit("h.0", ("h.0.attn.c_attn.weight",)), Unit("h.1", ("h.1.attn.qkv.weight",))))
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.to_dict()["version"] == 14
    assert Plan.from_dict({k: v for k, v in plan.to_dict().items() if k != "graph_cuts"}).graph_cuts == ()  # 10
    v8 = {k: v for k, v in plan.to_dict().items() if k != "units"}  # before FSDP units
    assert Plan.from_dict({**v8, "version": 8}).units == ()
    assert again.column_form("linear", "ln").weight == "h_0_attn_c_attn_weight"
    assert again.column_form("linear", "view_1") is None  # a column is fusable only on the input it reads
    v7 = {k: v for k, v in plan.to_dict().items() if k != "column_forms"}  # before the passes read forms from plans
    v7["stats"] = [{k: v for k, v in x.items() if k in ("node", "kind", "scale")} for x in v7["stats"]]
    old7 = Plan.from_dict({**v7, "version": 7})
    assert old7.column_forms == () and old7.stats[0] == Stat("mean_1", "mean", 0.5)
    v6 = {k: v for k, v in plan.to_dict().items() if k not in ("experts", "experts_kept")}  # before expert parallelism
    assert Plan.from_dict({**v6, "version": 6}).experts == ()
    v5 = {k: v for k, v in plan.to_dict().items() if k != "whole"}  # written before the completeness check
    assert Plan.from_dict({**v5, "version": 5}).whole == ()
    v4 = {**plan.to_dict(), "version": 4}  # written before collectives recorded their dtype
    v4["collectives"] = [{k: v for k, v in c.items() if k != "dtype"} for c in v4["collectives"]]
    assert all(c.dtype == "" for c in Plan.from_dict(v4).collectives)
    old = {k: v for k, v in plan.to_dict().items() if k != "sequence"}
    assert Plan.from_dict({**old, "version": 3}).sequence is None  # plans written before sequence parallelism
    with pytest.raises(Exception):
        plan.tp = 4  # frozen
    with pytest.raises(ValueError, match="version"):
        Plan.from_dict({**plan.to_dict(), "version": 99})


def test_plan_written_before_version_14_reads_its_layout_keys():
    """A column form's orientation and a vocab loss's rows were written under the key "layout" up to version 13
    (saved plans, plan cache entries): read back, they give the same Plan as the new keys."""
    from autotp.plan.plan import ColumnForm, ParamShard, VocabLoss, VocabPlan
    from autotp.shard_spec import VocabRows

    rows = VocabRows.make(100, 2)  # 50 rows per rank
    cropped = VocabRows(128, 64, 64, classes=100)  # a head padded to 128 rows, its logits cropped to 100
    plan = Plan(tp=2, params=(("wte.weight", ParamShard("vocab", "wte", 0, (Segment(100, 2),), (100, 16), (50, 16),
                                                        rows)),),
                vocab=VocabPlan(embeddings=(("embedding", rows),), heads=(("linear_4", "ln_f"),),
                                losses=(VocabLoss("cross_entropy", "linear_4", None, 1, -100, 0.0, cropped),),
                                outputs=(("linear_4", 2, cropped),)),
                column_forms=(ColumnForm("linear", "ln", "out_in", "h_0_attn_c_attn_weight", None),
                              ColumnForm("addmm", "view_1", "in_out", "h_0_mlp_c_fc_weight", "h_0_mlp_c_fc_bias")))
    new = plan.to_dict()
    assert "layout" not in plan.to_json()
    assert [f["orientation"] for f in new["column_forms"]] == ["out_in", "in_out"]
    assert new["vocab"]["losses"][0]["rows"]["classes"] == 100
    old = {**new, "version": 13,
           "column_forms": [{("layout" if k == "orientation" else k): v for k, v in f.items()}
                            for f in new["column_forms"]],
           "vocab": {**new["vocab"], "losses": [{("layout" if k == "rows" else k): v for k, v in x.items()}
                                                for x in new["vocab"]["losses"]]}}
    assert "orientation" not in json.dumps(old) and '"rows"' not in json.dumps(old)
    again = Plan.from_json(json.dumps(old))
    assert again == plan and again.column_forms[1].orientation == "in_out"
    assert again.vocab.losses[0].rows == cropped and again.to_dict() == new  # written back under the new keys


def test_grouped_segments_cut_whole_groups_or_split_one_group_among_its_ranks():
    """Falcon's [n_kv groups, 4 q heads + k + v, d=1]: at tp 4 each of the 2 groups is held by 2 ranks that split
    its q heads and both hold its k and v; at tp 2 and 1 ranks hold whole groups."""
    from autotp.shard_spec import LocalRun, local_indices, local_runs

    def grouped(parts, inner_parts):
        return (Segment(12, parts, (Segment(4, inner_parts), Segment(1, 1), Segment(1, 1))),)

    assert [local_indices(grouped(2, 2), 4, r).tolist() for r in range(4)] == [
        [0, 1, 4, 5], [2, 3, 4, 5], [6, 7, 10, 11], [8, 9, 10, 11]]
    assert [local_indices(grouped(2, 1), 2, r).tolist() for r in range(2)] == [list(range(6)), list(range(6, 12))]
    assert local_indices(grouped(1, 1), 1, 0).tolist() == list(range(12))
    assert grouped(2, 2)[0].local() == 4 and grouped(1, 1)[0].local() == 12
    assert local_runs(grouped(2, 2), 4) == [LocalRun(0, 2, 1, 0), LocalRun(2, 1, 2, 1), LocalRun(3, 1, 2, 2)]
    assert [p.leaf for p in local_runs(grouped(1, 1), 1)] == [0, 1, 2, 0, 1, 2]
    w = torch.arange(12.0)
    assert torch.equal(unshard_tensor([shard_tensor(w, 0, grouped(2, 2), 4, r) for r in range(4)], 0, grouped(2, 2), 4), w)


def test_outer_sharding_cuts_heads_folded_under_the_batch():
    """[b·h, s] with h = 4 heads over 2 ranks: rank 1 holds heads 2, 3 of every batch row."""
    from autotp.shard_spec import shard_tensor

    x = torch.arange(2 * 4).reshape(2 * 4, 1)  # row = batch * 4 + head
    assert shard_tensor(x, 0, (Segment(4, 2),), 2, 1, outer=True).flatten().tolist() == [2, 3, 6, 7]
    assert Sharding(0, (Segment(4, 2),), outer=True).ratio() == 2
    assert Sharding(0, (Segment(64, 4), Segment(16, 1))).ratio() is None  # q split 4 ways, one kv head whole
