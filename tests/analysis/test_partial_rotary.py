"""GPT-J-style blocks (tests/support/partial_rotary_models.py): a partial rotary embedding on interleaved pairs,
attention and the MLP reading one layer norm side by side, CodeGen's fused q | v | k projection laid out in 4
chunks. Each is cut by heads at tp 2 and 4 (structural, no processes: one hand-written block by default, the
LMs in the extended run) and trains exactly with Megatron's all-reduces (gloo ranks at 2 and 4, extended run)."""
from __future__ import annotations

import pytest
import torch

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import dense_step_collectives, pattern_parity
from partial_rotary_models import HF_KINDS, KINDS, H, S, ChunkedQKV, ParallelBlock, build
from ranks import Launches

RUN_KINDS = [*KINDS, *HF_KINDS]
RUNS = Launches({}, extended={w: {"families": (pattern_parity, RUN_KINDS, 3, False, "partial_rotary_models")}
                              for w in (2, 4)})
# the fused projection's rows and the attention's output projection, by spelling
QKV = {"chunked_qkv": ("blocks.{}.attn.qkv.weight", "blocks.{}.attn.out.weight"),
       "split_rotary": ("blocks.{}.attn.q.weight", "blocks.{}.attn.out.weight"),
       "codegen": ("transformer.h.{}.attn.qkv_proj.weight", "transformer.h.{}.attn.out_proj.weight"),
       "codegen_8_heads": ("transformer.h.{}.attn.qkv_proj.weight", "transformer.h.{}.attn.out_proj.weight"),
       "gptj": ("transformer.h.{}.attn.q_proj.weight", "transformer.h.{}.attn.out_proj.weight")}


def _assert_cut_by_heads(kind: str, gm) -> None:
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        params = dict(plan.params)
        for i in range(2):
            qkv, out = (params[n.format(i)] for n in QKV[kind])
            rows = 3 * H if "qkv" in QKV[kind][0] else H
            assert (qkv.role, qkv.local_shape) == ("column", (rows // tp, H)), (tp, qkv)
            assert (out.role, out.local_shape) == ("row", (H, H // tp)), (tp, out)


def test_chunks_of_q_v_k_regrouped_into_heads_are_cut_by_chunks():
    """One block alone (a capture of about a second): the fused projection ``unflatten``-ed into 4 chunks of
    q | v | k (captured as ``aten.unflatten``, read as the view it is), each chunk's q viewed from ``(b, s, 4,
    16)`` as 8 heads of 8. A rank's chunks are its heads: the rows cut by chunks, one all-reduce each way for
    attention (f joined with the MLP's: both read the one norm), one forward for the MLP."""
    torch.manual_seed(0)
    gm = capture(ParallelBlock(ChunkedQKV()), (torch.randn(2, S, H),), {})[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and plan.whole == (), (tp, plan.replicated, plan.whole)
        cut = {n: (s.role, s.local_shape) for n, s in plan.params if s.role != "replicated"}
        assert cut == {"attn.qkv.weight": ("column", (3 * H // tp, H)), "attn.out.weight": ("row", (H, H // tp)),
                       "fc_in.weight": ("column", (2 * H // tp, H)), "fc_in.bias": ("column", (2 * H // tp,)),
                       "fc_out.weight": ("row", (H, 2 * H // tp))}, (tp, cut)
        assert sorted((c.module, c.op, c.direction) for c in plan.collectives) == [
            ("attn", "sum", "backward"), ("attn", "sum", "forward"), ("fc_out", "sum", "forward")], tp


@pytest.mark.extended
@pytest.mark.parametrize("kind", RUN_KINDS)
def test_the_lm_is_cut_by_heads(kind: str):
    model, args, kwargs = build(kind)
    _assert_cut_by_heads(kind, capture(model, args, kwargs)[0])


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_the_families_train_exactly_with_megatron_collectives(world: int):
    """3 AdamW steps at fp32: loss, gradients and parameters within 1e-5 of one device, at most 1/tp + 0.12 of
    the parameters per rank, nothing replicated. Forward Megatron's all-reduces (the embedding's, attention's
    and the MLP's per layer, the loss's max and two sums of b·s); backward one all-reduce of b·s·h per layer
    (attention and the MLP read the same norm's output: their f is one) and the LM head's."""
    forward, _ = dense_step_collectives(2 * S * H, 2 * S)
    for rank, by_kind in RUNS(world, "families").items():
        assert list(by_kind) == RUN_KINDS, (rank, list(by_kind))
        for kind, r in by_kind.items():
            assert_exact(r, (rank, kind))
            assert_fully_sharded(r, world, (rank, kind))
            assert sorted(r["forward"]) == forward, (rank, kind, r["forward"])
            assert r["backward"] == [("all_reduce", "sum", 2 * S * H)] * 3, (rank, kind, r["backward"])
