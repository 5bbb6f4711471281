"""Ops that only move dims or do nothing: the transpose family in attention (``k.mT`` with tanh soft-capping,
``swapaxes``, ``movedim``, ``permute``/``transpose`` with negative dims, ``adjoint``, ``mH``) shards by heads
like ``transpose``, identity views, no-op casts and copies in front of each input projection do not split its
column group (one input-gradient all-reduce per attention and per MLP, Megatron's count), and positions folded
in groups of 4 inside the MLP (``view(b, s // 4, 4, f)``, ``reshape(b, -1, 4, f)``) are read as the sequence
they are."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autotp.analysis.ops import TRANSPOSES, permutation
from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from spelling_runs import SpellingRuns
from shared_graphs import SHARED, spelling
from view_gap_models import KINDS, NH, HD, S

aten = torch.ops.aten
RUNS = SpellingRuns("views", "view_gap_models", KINDS, ["mT_softcap", "swapaxes"])


@pytest.mark.slow
@pytest.mark.parametrize("world,part", RUNS.params)
def test_view_gaps_shard_exactly_with_megatron_collectives(world: int, part: str):
    results = RUNS(world, part)
    bsh, layers = 2 * S * NH * HD, 2
    for rank, by_kind in results.items():
        assert list(by_kind) == RUNS.kinds(part)
        for kind, r in by_kind.items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert not r["replicated"] and not r["quarter"] and not r["kv_replicated"], (kind, r)
            assert not r["whole"] and not r["unexplained"], (kind, r)
            # forward: the embedding and 2 per layer (b·s·h), the loss's max and 2 sums (b·s)
            assert sorted(r["forward"]) == sorted([("all_reduce", "sum", bsh)] * (2 * layers + 1) + [
                ("all_reduce", "max", 2 * S), ("all_reduce", "sum", 2 * S), ("all_reduce", "sum", 2 * S)]), kind
            # backward: one all-reduce entering attention and one entering the MLP per layer (q, k, v and
            # gate, up each read their own identity node of the one normed input), one for the LM head
            assert r["backward"] == [("all_reduce", "sum", bsh)] * (2 * layers + 1), (kind, r["backward"])


@SHARED
def test_transpose_family_in_the_sequence_parallel_regions():
    """A residual stream kept as (s, b, h), moved there by ``movedim`` and back by ``swapaxes``, stays split
    along the sequence (dim 0 inside the blocks) with nothing gathered."""
    plan = make_plan(spelling("view_gap_models", "seq_first")[3], 2, sequence_parallel=True)
    seq = plan.sequence
    assert not plan.replicated and not seq.notes and not seq.gathers, (plan.replicated, seq.notes, seq.gathers)
    assert len(seq.leaves) == len(plan.pairs) + 1 == 5  # every row output and the embedding reduce-scatter
    assert sorted(x.dim for x in seq.leaves) == [0, 0, 0, 0, 1]  # rows (s, b, h); the embedding (b, s, h)


class _Moves(nn.Module):
    def forward(self, x, m):
        return (x.mT, x.mH, x.adjoint(), x.swapaxes(-2, -1), x.swapdims(1, -1), torch.swapaxes(x, 0, 2),
                x.movedim(-1, -3), x.movedim([0, 1], [2, 0]), torch.movedim(x, (-1, 0), (0, -1)),
                x.permute(0, 1, -1, -2), x.permute(-1, 0, -2, 1), x.transpose(-1, -3), x.transpose(2, 0),
                m.t(), m.T, m.mT)


def test_transpose_family_maps_each_op_to_its_permutation():
    x, m = torch.randn(2, 3, 4, 5), torch.randn(3, 4)
    gm, _ = capture(_Moves(), (x, m), {})
    found = [n for n in gm.graph.nodes if n.target in TRANSPOSES]
    assert {n.target for n in found} >= {aten.mT.default, aten.mH.default, aten.adjoint.default, aten.swapaxes.default,
                                         aten.swapdims.default, aten.movedim.int, aten.movedim.intlist,
                                         aten.permute.default, aten.transpose.int, aten.t.default}
    assert len(found) == 16
    for n in found:  # the permutation reproduces the op on real values
        src = x if n.args[0].name == "tensors_0" else m
        want = n.target(src, *n.args[1:], **n.kwargs)
        assert torch.equal(src.permute(permutation(n)), want), (n.format_node(), permutation(n))
    perms = {n.name: permutation(n) for n in found}
    assert perms["m_t"] == perms["swapaxes"] == perms["adjoint"] == [0, 1, 3, 2]
    assert perms["movedim"] == [0, 3, 1, 2]  # x.movedim(-1, -3)
    assert perms["movedim_1"] == [1, 2, 0, 3]  # x.movedim([0, 1], [2, 0])
    assert perms["permute_1"] == [3, 0, 2, 1]


class _Identities(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(8, 8)

    def forward(self, x):
        h = self.w(x)  # (b, s, 8)
        b, s, c = h.shape
        same = (h.view_as(h) + h.reshape(b, s, c) + h.view(h.shape) + h[:] + h[..., :] + h.expand_as(h)
                + h.to(h.dtype) + torch.ops.aten.alias(h) + h.clone() + h.contiguous())
        kept = h.detach() * 2  # stops gradients: kept
        g = h * 3
        before = g.clone()  # its input is written in place through a view afterwards: kept
        g[:, 0].zero_()
        after = (h + 1).clone()
        after.mul_(2)  # a copy written in place: kept
        t = h.transpose(1, 2).contiguous().view(b, c * s)  # a real copy (new strides) the view needs: kept
        return same.sum() + kept.sum() + before.sum() + g.sum() + after.sum() + t.sum()


def test_identity_views_and_copies_are_removed_at_capture_and_casts_kept():
    """``h.to(h.dtype)`` is kept: an identity as captured in fp32, but not under torch.autocast (h arrives in
    bf16 there, and the cast is what the model asked for)."""
    model, x = _Identities(), torch.randn(2, 5, 8)
    gm, _ = capture(model, (x,), {})
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    for gone in (aten.view_as.default, aten.alias.default, aten.expand_as.default, aten.slice.Tensor):
        assert gone not in targets, gone
    assert targets.count(aten.to.dtype) == 1
    assert targets.count(aten.view.default) == 1 and aten.reshape.default not in targets  # the flattening one only
    assert targets.count(aten.detach.default) == 1
    assert targets.count(aten.clone.default) == 2  # before (input written) and after (written itself)
    assert targets.count(aten.contiguous.default) == 1  # the transposed one's copy
    # the sum of ten identities of h is nine adds that read h itself (and h + 1 is one more); export gives the
    # uses of h after ``h.to(h.dtype)`` (an alias of h) the cast's node
    (h,) = [n for n in gm.graph.nodes if n.target is aten.linear.default]
    (cast,) = [n for n in gm.graph.nodes if n.target is aten.to.dtype]
    assert len([u for u in (*h.users, *cast.users) if u.target is aten.add.Tensor]) == 10
    torch.testing.assert_close(gm(x)[0], model(x), rtol=0, atol=0)
