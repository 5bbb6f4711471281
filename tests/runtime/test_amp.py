"""Mixed precision as GPU training scripts run it (gloo, CPU autocast): bf16 and fp16 ``torch.autocast``
around a parallelized model, a GradScaler whose overflow check agrees over the group, ``full_tensor()``
that backpropagates.

Tolerances. Under autocast each matmul rounds its output to the low dtype. The unsharded model rounds a
whole dot product once; a sharded one rounds each rank's partial sum, then the sum of the ranks' parts
(Megatron's all-reduce in the activation dtype does the same). So a sharded value can differ by a few
roundings of the low dtype: we allow 4·eps of the dtype (bf16 eps 2⁻⁷, fp16 eps 2⁻¹⁰) relative to the
largest element of the tensor compared, the same order as autocast's own distance from the fp32 model,
which each test also measures. The loss is computed in fp32 from the logits (as ``cross_entropy`` is
under autocast), so it is held to the same bound. Adam's first steps move every element by about ±lr
whatever its gradient's size, so an element whose gradient is at rounding level may move either way (in
autocast's own run against fp32 too): after 3 AdamW steps we compare the updates as a whole,
‖Δθ − Δθ_ref‖ / ‖Δθ_ref‖, and allow twice what autocast alone gives against fp32.
"""
from __future__ import annotations

import pytest
import torch

from amp_workers import autocast_parity, full_tensor_grad, grad_scaler_overflow
from ranks import Launches
from tiers import core_first

EPS = {"bfloat16": torch.finfo(torch.bfloat16).eps, "float16": torch.finfo(torch.float16).eps}
MOE = [("moe_bmm", False), ("mixtral", False), ("mixtral", True)]
# every job of this file, by the world it runs at: one launch per world
JOBS: dict[int, dict[str, tuple]] = {world: {
    **{f"nanogpt {dtype}": (autocast_parity, "nanogpt", dtype) for dtype in EPS},
    "llama": (autocast_parity, "llama", "bfloat16", False, True),
    "grad scaler": (grad_scaler_overflow,),
} for world in (2, 4)}
JOBS[2].update({f"moe {model} {ep}": (autocast_parity, model, "bfloat16", False, False, 3, ep) for model, ep in MOE})
JOBS[2].update({"sequence parallel": (autocast_parity, "nanogpt", "bfloat16", True), "full tensor": (full_tensor_grad,)})
# tp 4 in the extended run only (four ranks on CI's two cores cost the most of any launch): tp 2 covers both
# dtypes' collectives, Llama captured under autocast and the grad scaler's skipped step
REST = {4: JOBS.pop(4)}
# at tp 2, experts under autocast once (Mixtral's, cut per expert); the other expert spellings and sequence
# parallelism under autocast in the extended run
MOE_CORE = {("mixtral", False)}
REST[2] = {name: JOBS[2].pop(name) for name in [f"moe {m} {ep}" for m, ep in MOE if (m, ep) not in MOE_CORE]
           + ["sequence parallel"]}


@pytest.fixture(scope="module")
def runs() -> Launches:
    return Launches(JOBS, extended=REST, reuse_captures=True)


def _check_close(r: dict, dtype: str, rank: int) -> None:
    tol = 4 * EPS[dtype]
    assert r["loss_dtype"] == "torch.float32", r["loss_dtype"]  # cross_entropy under autocast: fp32
    assert r["logits_dtype"] == r["ref_logits_dtype"] == f"torch.{dtype}", r
    assert r["loss_rel"] <= tol, (rank, r["loss_rel"], r["autocast_loss_rel"])
    assert r["logits_rel"] <= tol, (rank, r["logits_rel"])
    assert r["grad_rel"] <= tol, (rank, r["grad_rel"], r["autocast_grad_rel"])
    assert r["grad_dtypes"] == ["torch.float32"]  # fp32 parameters get fp32 gradients, as without autotp
    # after 3 AdamW steps the updates as a whole agree as closely as autocast's own agree with fp32's
    assert r["update_rel"] <= 2 * r["autocast_update_rel"], (rank, r["update_rel"], r["autocast_update_rel"])


@pytest.mark.slow
@pytest.mark.parametrize("world,dtype", [(2, "bfloat16"), (2, "float16"),
                                         pytest.param(4, "bfloat16", marks=pytest.mark.extended),
                                         pytest.param(4, "float16", marks=pytest.mark.extended)])
def test_autocast_training_parity(runs, world: int, dtype: str):
    for rank, r in runs(world, f"nanogpt {dtype}").items():
        _check_close(r, dtype, rank)
        # what travels: the row-parallel outputs' all-reduces and the input gradients entering the column
        # matmuls in the low dtype (half the bytes of fp32); the embedding's output (not autocast) and the
        # cross-entropy's row statistics in fp32
        low = [c for c in r["traveled"] if c[1] == dtype]
        wide = [c for c in r["traveled"] if c[1] == "float32"]
        bsh, bs = 4 * 32 * 64, 4 * 32
        assert sorted(c[2] for c in low) == [bsh] * (4 + 4 + 1), r["traveled"]  # 2L forward, 2L + 1 backward
        assert sorted(c[2] for c in wide) == [bs] * 3 + [bsh], r["traveled"]
        # the plan says the same
        assert ("forward", "all_reduce", "sum", dtype) in r["plan_dtypes"]
        assert ("backward", "all_reduce", "sum", dtype) in r["plan_dtypes"]
        assert ("forward", "all_reduce", "max", "float32") in r["plan_dtypes"]
        assert r["graphs"] == 2  # the call under autocast is captured under it


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_autocast_gqa_captured_under_autocast(runs, world: int):
    """A Hugging Face Llama (grouped-query: kv heads replicated at tp 4), parallelized inside the autocast
    region, bf16."""
    for rank, r in runs(world, "llama").items():
        _check_close(r, "bfloat16", rank)
        assert r["graphs"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("model,expert_parallel", [c if c in MOE_CORE else pytest.param(*c, marks=pytest.mark.extended)
                                                   for c in MOE])
def test_autocast_moe(runs, model: str, expert_parallel: bool):
    """Experts under bf16 autocast (gathered per slot with bmm; Hugging Face's grouped GEMM, also with whole
    experts per rank): each rank's partial expert sums in bf16, one all-reduce of the combined sum, as close
    as the dense models. (A router's top-k may flip on a near-tie when its input rounds differently, as it
    does between autocast and fp32: these models' batches have none.)"""
    for rank, r in runs(2, f"moe {model} {expert_parallel}").items():
        _check_close(r, "bfloat16", rank)


@pytest.mark.slow
@pytest.mark.extended
def test_autocast_sequence_parallel(runs):
    for rank, r in runs(2, "sequence parallel").items():
        _check_close(r, "bfloat16", rank)
        kinds = {(c[0], c[1]) for c in r["traveled"]}
        assert ("reduce_scatter", "bfloat16") in kinds and ("all_gather", "bfloat16") in kinds, kinds


@pytest.mark.slow
def test_full_tensor_is_differentiable_and_foreach_norms_are_full(runs):
    for rank, r in runs(2, "full tensor").items():
        for dtype in ("float32", "bfloat16"):
            d = r[dtype]
            assert d["plain"] and d["requires_grad"], (rank, dtype, d)
            tol = 1e-5 if dtype == "float32" else 4 * EPS[dtype]
            assert d["loss_rel"] <= tol and d["grad_rel"] <= tol, (rank, dtype, d)
        assert r["no_grad_plain"]
        assert r["foreach_norm_rel"] <= 1e-5 and r["foreach_inf_norm_rel"] <= 1e-6, r


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_grad_scaler_overflow_on_one_rank_skips_every_rank(runs, world: int):
    results = runs(world, "grad scaler")
    for rank, r in results.items():
        assert r["skipped_unchanged"], rank  # no rank stepped with the overflowing step's gradients
        assert r["scales"] == r["ref_scales"], (rank, r["scales"], r["ref_scales"])  # halved once, on every rank
        assert r["scales"][1] == r["scales"][0] / 2
        assert r["moved"] > 0  # the other steps did step
        # fp16 autocast alone moves the updates ≈ 0.011 from fp32's (test_autocast_training_parity)
        assert r["update_rel"] <= 0.02, (rank, r["update_rel"])
    assert len({tuple(r["scales"]) for r in results.values()}) == 1


@pytest.mark.parametrize("dtype", core_first([None, torch.bfloat16, torch.float16], [torch.float16]))
def test_plan_gives_bytes_in_the_dtype_that_travels(dtype):
    """Captured under autocast, the plan records each collective's dtype and ``autotp plan``'s table counts
    its bytes: the pairs' activations and input gradients in the low dtype, the embedding's output (not
    autocast) and the loss's statistics in fp32; without autocast everything in fp32."""
    from autotp.capture.tracer import capture
    from autotp.plan.plan import Plan
    from autotp.plan.planner import make_plan
    from autotp.reports.sharding import build_report
    from small_models import MODELS

    model, args, kwargs = MODELS["nanogpt"]()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        gm, _ = capture(model, args, kwargs)
    plan = make_plan(gm, 2)
    assert Plan.from_json(plan.to_json()) == plan
    rep = build_report(plan, model.named_parameters(), 4, 32)
    low = 4 if dtype is None else 2
    bsh, bs = 4 * 32 * 64, 4 * 32
    sizes = sorted((r.direction, r.op, r.elements, r.bytes // r.elements) for r in rep.collectives)
    assert sizes == sorted([("forward", "sum", bsh, 4)]  # the vocab-parallel embedding's output
                           + [("forward", "sum", bsh, low)] * 4  # attention and MLP outputs, 2 layers
                           + [("backward", "sum", bsh, low)] * 5  # entering attention, MLP, the LM head
                           + [("forward", "max", bs, 4)] + [("forward", "sum", bs, 4)] * 2), sizes
    total = rep.total()
    assert total.bytes == sum(r.bytes for r in rep.collectives)
