"""The model's own autograd Functions (tests/support/function_models.py): captured with their forward's ops tagged
(:mod:`autotp.capture.functions`), called again by the sharded graph (:mod:`autotp.operators.functions`) so
their backward is the model's; sharded through where running the Function on random shards shows its forward
and backward local to a shard, else whole with the reason; exact at tp 2 and 4.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_flatten

from autotp.analysis.function_rules import FunctionRefused, Operand, check_function
from autotp.operators.functions import FunctionCall, call_of
from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from autotp.operators.functions import CustomFunction
from autotp.passes import outline_functions
from spelling_runs import SpellingRuns
from shared_graphs import SHARED, spelling
import helper_models
from function_models import KINDS, GradNorm, RoundSTE, build
from parity_checks import assert_patterns_train_exactly
from ranks import launch
from pattern_models import H, S


def _grads(module, args) -> dict[str, torch.Tensor]:
    module.zero_grad()
    out = module(*args)
    out[1].backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", KINDS)
def test_the_graph_calls_the_models_function_again_and_keeps_its_backward(kind: str):
    model, args, _ = build(kind)
    apply = torch.autograd.Function.__dict__["apply"]
    gm = capture(model, args, {})[0]
    assert torch.autograd.Function.__dict__["apply"] is apply  # the capture puts torch back as it was
    calls = {call_of(n) for n in gm.graph.nodes} - {None}
    assert len(calls) == 2  # one per layer
    want = _grads(model, args)
    inlined = _grads(gm, args)
    if kind == "ste":  # the traced forward alone differentiates round(): no gradient reaches the attention
        assert torch.count_nonzero(inlined["blocks.0.attn.qkv.weight"]) == 0
        assert torch.count_nonzero(want["blocks.0.attn.qkv.weight"]) > 0
    assert outline_functions(gm) == 2
    assert sum(isinstance(m, CustomFunction) for m in gm.modules()) == 2
    got = _grads(gm, args)
    assert want.keys() == got.keys()
    for name, g in want.items():
        assert torch.equal(got[name], g), name


@SHARED
@pytest.mark.parametrize("kind", ["ste", "custom_fwd", "outside"])
def test_a_function_local_to_a_shard_is_sharded_through(kind: str):
    gm = spelling("function_models", kind)[3]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and not plan.whole, (plan.replicated, plan.whole)
        assert plan.param("blocks.0.attn.qkv.weight").role == "column"


@SHARED
def test_a_function_whose_backward_needs_the_whole_tensor_leaves_its_region_whole_with_its_name():
    gm = spelling("function_models", "grad_norm")[3]
    for tp in (2, 4):
        reasons = dict(make_plan(gm, tp).replicated)
        assert set(reasons) == {"blocks.0.attn", "blocks.1.attn"}, reasons
        assert all(f"{GradNorm.__module__}.GradNorm's backward run on a rank's shards does not give that rank's "
                   "shard of the gradient" in r for r in reasons.values()), reasons


def test_the_check_runs_the_function_on_shards():
    """A forward that reads the whole feature dim (a max over it) is refused by the check itself, as is a
    backward that does; the identity of both passes."""
    call = FunctionCall(RoundSTE, (None, 8.0), tree_flatten(((torch.ones(1), 8.0), {}))[1], 0)
    x = Operand((2, 3, 8), torch.float32, 2)
    check_function(call, [x], [x], 2)
    whole = FunctionCall(MaxOver, (None,), tree_flatten(((torch.ones(1),), {}))[1], 0)
    with pytest.raises(FunctionRefused, match="does not give that rank's shard of its result"):
        check_function(whole, [x], [x], 2)
    norm = FunctionCall(GradNorm, (None,), tree_flatten(((torch.ones(1),), {}))[1], 0)
    with pytest.raises(FunctionRefused, match="does not give that rank's shard of the gradient"):
        check_function(norm, [x], [x], 2)


class MaxOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x - x.amax(dim=-1, keepdim=True)

    @staticmethod
    def backward(ctx, grad):
        return grad


RUNS = SpellingRuns("functions", "function_models", KINDS, ["custom_fwd", "grad_norm"])


@pytest.mark.slow
@pytest.mark.parametrize("world,part", RUNS.params)
def test_models_with_their_own_functions_train_exactly(world: int, part: str):
    results = RUNS(world, part)
    # run on shards (or outside every region): Megatron's collectives
    assert_patterns_train_exactly(results, RUNS.kinds(part), world, bsh=2 * S * H, tokens=2 * S,
                                  sharded=lambda kind: kind != "grad_norm")
    for rank, by_kind in results.items():  # the attention the Function sits in is whole; the MLPs are sharded
        if "grad_norm" not in by_kind:
            continue
        r = by_kind["grad_norm"]
        assert r["unexplained"] == [], (rank, r)
        assert [m for m, _ in r["replicated"]] == ["blocks.0.attn", "blocks.1.attn"], (rank, r)


class _Wrapped(torch.nn.Module):
    """An MLP whose activation is called through ``torch._higher_order_ops.wrap.wrap``."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        from torch._higher_order_ops.wrap import wrap

        return self.down(wrap(lambda t: torch.nn.functional.gelu(t) * 2, self.up(x)))


def test_the_wrap_higher_order_op_is_traced_through():
    """The capture's export traces through ``wrap`` (no higher-order op is left for analysis to look into):
    the MLP is a column→row pair like any other."""
    model = _Wrapped()
    gm = capture(model, (torch.randn(2, 8, 16),), {})[0]
    assert all(isinstance(n.target, torch._ops.OpOverload) for n in gm.graph.nodes if n.op == "call_function")
    plan = make_plan(gm, 2)
    assert plan.param("up.weight").role == "column" and plan.param("down.weight").role == "row"


# -- the spellings of state-space, recurrent and RWKV-style model files (tests/support/helper_models.py) ------
def _no_fake_cached() -> None:
    """No fake or meta tensor, and no symbolic size, in any of the helpers' caches."""
    from torch._subclasses.fake_tensor import FakeTensor

    for key, value in helper_models.MEMO.items():
        assert not isinstance(value, FakeTensor) and not value.is_meta, key
        assert all(isinstance(k, (int, torch.device, torch.dtype)) for k in key), key
    for cached in (helper_models.lru_mask, helper_models.Attention.cached_mask):
        assert cached.cache_info().currsize <= 1, cached.cache_info()


@pytest.mark.parametrize("kind", helper_models.LOSSES + ("grad_max",))
def test_a_function_whose_backward_reads_the_whole_sharded_dim_runs_whole_and_the_plan_names_it(kind: str):
    """A loss helper whose backward builds a term over the vocab (a max, an argmax, a logsumexp), however it
    is called (apply, an alias bound at import, functools.partial, a staticmethod), keeps the LM head whole;
    a backward normalizing by a max over the features keeps its attention whole; each with the Function's
    name and reason."""
    model, args, _ = helper_models.build(kind)
    gm = capture(model, args, {})[0]
    name = {"loss_argmax": "ArgmaxTerm", "loss_lse": "LseTerm", "grad_max": "GradMax"}.get(kind, "MaxTerm")
    for tp in (2, 4):
        reasons = dict(make_plan(gm, tp).replicated)
        want = {"blocks.0.attn", "blocks.1.attn"} if kind == "grad_max" else {"head"}
        assert set(reasons) == want, reasons
        why = "backward run on a rank's shards does not give" if kind == "grad_max" else "gives a whole result"
        assert all(f"helper_models.{name}" in r and why in r for r in reasons.values()), reasons


@pytest.mark.parametrize("kind", helper_models.SCANS)
def test_a_scan_writing_in_place_is_seen_by_every_spelling_and_keeps_its_backward(kind: str):
    """``scan = Scan.apply`` bound at import, ``Scan.apply`` and an ``allow_in_graph`` subclass: each call is
    one Function region; the outlined graph calls the Function (no in-place error from differentiating its
    traced forward) and gives the eager gradients."""
    model, args, _ = helper_models.build(kind)
    gm = capture(model, args, {})[0]
    assert len({call_of(n) for n in gm.graph.nodes} - {None}) == 2
    assert outline_functions(gm) == 2
    want, got = _grads(model, args), _grads(gm, args)
    assert want.keys() == got.keys()
    for name, g in want.items():
        assert torch.allclose(got[name], g, atol=1e-6), name
    plan = make_plan(gm, 2)  # the MLPs around the scan's mixing sharded as ever
    assert plan.param("blocks.0.mlp.down.weight").role == "row"


@pytest.mark.parametrize("kind", helper_models.MASKS)
def test_a_cached_mask_builder_neither_fails_the_capture_nor_keeps_its_values(kind: str):
    """An lru-cached, a functools.cache staticmethod and a dict-memo mask builder called with the sequence
    length: captured (symbolic sizes never hashed), the attention sharded, the caches as they were (what the
    model's own eager call put there, the same objects), and the model's next eager call the same."""
    helper_models.clear_caches()
    model, args, _ = helper_models.build(kind)
    want = model(*args)[0]
    memo, lru = dict(helper_models.MEMO), helper_models.lru_mask.cache_info()
    gm = capture(model, args, {})[0]
    assert helper_models.MEMO == memo and all(helper_models.MEMO[k] is v for k, v in memo.items())
    assert helper_models.lru_mask.cache_info().currsize == lru.currsize
    _no_fake_cached()
    assert torch.equal(model(*args)[0], want)
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), plan.replicated
        assert plan.param("blocks.0.attn.qkv.weight").role == "column"


HELPERS = SpellingRuns("helpers", "helper_models", helper_models.KINDS,
                       ["loss_max", "loss_lse", "scan_alias", "mask_lru", "mask_memo", "grad_max"])


@pytest.mark.slow
@pytest.mark.parametrize("world,part", HELPERS.params)
@pytest.mark.extended
def test_models_with_their_own_helpers_train_exactly(world: int, part: str):
    """Loss, gradients and 3 AdamW steps within 1e-5 of the unsharded model (which runs after parallelize:
    the helpers' caches hold nothing of the capture); the mask spellings fully sharded with Megatron's
    collectives, the others whole where their Function needs it, with its reason."""
    results = HELPERS(world, part)
    kinds = HELPERS.kinds(part)
    assert_patterns_train_exactly(results, kinds, world, bsh=2 * S * H, tokens=2 * S,
                                  sharded=lambda kind: kind in helper_models.MASKS)
    for rank, by_kind in results.items():
        for kind, r in by_kind.items():
            assert r["unexplained"] == [], (rank, kind, r)
            if kind in helper_models.LOSSES:
                assert [m for m, _ in r["replicated"]] == ["head"], (rank, kind, r["replicated"])
            elif kind == "grad_max":
                assert [m for m, _ in r["replicated"]] == ["blocks.0.attn", "blocks.1.attn"], (rank, r)


@pytest.mark.slow
def test_the_command_lines_parity_check_compares_gradients_and_names_the_parameter():
    """The gradient half of ``autotp shard``'s parity check: within 1e-5 on a sharded model; a backward made
    wrong on one weight (its gradient negated) is found, in that weight, by the gradients and by the
    parameters after one AdamW step; the model is left with its parameters and no gradients."""
    from helper_workers import grad_parity_catches

    wrong = "blocks.1.attn.proj.weight"
    for rank, r in launch(grad_parity_catches, 2, "mask_lru", wrong).items():
        assert r["kept"], (rank, r)
        grad_diff, _, step_diff, _ = r["right"]
        assert grad_diff <= 1e-5 and step_diff <= 1e-5, (rank, r)
        grad_diff, grad_param, step_diff, step_param = r["wrong"]
        assert grad_diff > 1e-5 and grad_param == wrong, (rank, r)
        assert step_diff > 1e-5 and step_param == wrong, (rank, r)
