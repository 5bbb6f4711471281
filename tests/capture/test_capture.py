"""Capture of the user's own model object: the styles a deep copy cannot capture, a bare
``parallelize(model)`` on Hugging Face models and torch's test Transformer, and a model left as it was."""
from __future__ import annotations

import pytest
import torch

from capture_models import STYLES, build
from ranks import Launches
from parity_workers import capture_styles, default_calls

from autotp.capture.tracer import capture
from autotp.capture.structure import call_key, flatten, unflatten


def _snapshot(model: torch.nn.Module) -> dict:
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "ids": {k: id(v) for k, v in [*model.named_parameters(remove_duplicate=False),
                                      *model.named_buffers(remove_duplicate=False)]},
        "hooks": [(n, len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()],
        "training": [m.training for m in model.modules()],
        "dict": {n: sorted(m.__dict__) for n, m in model.named_modules()},
        "class": type(model),
    }


@pytest.mark.parametrize("style", list(STYLES))
def test_capture_leaves_the_model_as_it_was(style: str):
    model, args, kwargs = build(style)
    before = _snapshot(model)
    gm, spec = capture(model, args, kwargs)
    after = _snapshot(model)
    assert before["ids"] == after["ids"] and before["hooks"] == after["hooks"]
    assert before["training"] == after["training"] and before["dict"] == after["dict"]
    assert before["class"] is after["class"]
    for k, v in before["state"].items():
        assert torch.equal(v, after["state"][k]), f"capture changed {k}"
    assert sum(n.op == "placeholder" for n in gm.graph.nodes) == 2
    assert spec.kind == "tree"  # (logits, loss)


def test_capture_of_a_meta_model_keeps_working():
    with torch.device("meta"):
        model, _, _ = build("attribute")
    args = tuple(torch.zeros(2, 16, dtype=torch.long) for _ in range(2))
    gm, _ = capture(model, args, {})
    assert any(n.target == torch.ops.aten.linear.default for n in gm.graph.nodes)


def test_output_structure_round_trips():
    class Cache:  # an object the user's forward returns, not a registered pytree type
        def __init__(self, k, v):
            self.layers = [{"k": k, "v": v}]
            self.seen = 3

    t = [torch.randn(2) for _ in range(3)]
    out = (t[0], {"cache": Cache(t[1], t[2]), "n": None})
    tensors, spec = flatten(out)
    assert len(tensors) == 3
    back = unflatten(tensors, spec)
    assert back[0] is t[0] and back[1]["n"] is None and back[1]["cache"].seen == 3
    assert back[1]["cache"].layers[0]["v"] is t[2] and isinstance(back[1]["cache"], Cache)
    # the cache key sees structure, constants and which sizes are 0 or 1, not the values or other sizes
    other = (torch.randn(3), {"cache": Cache(torch.randn(5), torch.randn(5)), "n": None})
    assert call_key((out,), {}, True) == call_key((other,), {}, True) != call_key((other,), {}, False)
    assert call_key((t[0],), {"flag": True}, True) != call_key((t[0],), {"flag": False}, True)
    assert call_key((torch.randn(1),), {}, True) != call_key((torch.randn(4),), {}, True)


DEFAULT_CALLS = ["gpt2", "llama", "test_transformer"]


@pytest.fixture(scope="module")
def runs() -> Launches:
    """The multi-process tests' jobs, one launch per world."""
    return Launches({2: {"styles": (capture_styles, TRAINED), "default calls": (default_calls, DEFAULT_CALLS)}},
                    extended={2: {"other styles": (capture_styles, [s for s in STYLES if s not in TRAINED])},
                              4: {"default calls": (default_calls, DEFAULT_CALLS)}})


# trained in the default run: a forward hook, a forward bound to another object, a buffer the forward writes
# (each captured above, like every style); the rest train in the extended run
TRAINED = ["hooks", "bound", "buffer_write"]


@pytest.mark.slow
@pytest.mark.parametrize("styles", ["styles", pytest.param("other styles", marks=pytest.mark.extended)])
def test_capture_styles_train_exactly_at_tp2(runs, styles: str):
    results = runs(2, styles)
    for rank, by_style in results.items():
        for style, r in by_style.items():
            assert r["loss_diff"] <= 1e-5, (rank, style, r)
            assert r["param_diff"] <= 1e-5, (rank, style, r)
            assert r["buffer_diff"] <= 1e-5, (rank, style, r)
            assert not r["replicated"], (style, r["replicated"])
            assert r["sharded_fraction"] < 0.6, (style, r)  # every 2-D weight and the embedding at 1/2


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])  # tp 4: the extended run
def test_bare_parallelize_trains_exactly(runs, world: int):
    """``parallelize(model)`` with no example, then the model's own training call (HF: ``use_cache`` as
    configured, so a KV cache comes back) for 3 AdamW steps."""
    results = runs(world, "default calls")
    for rank, by_kind in results.items():
        assert list(by_kind) == DEFAULT_CALLS
        for kind, r in by_kind.items():
            assert r["tp"] == world and r["same_class"]
            assert r["loss_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert not r["replicated"], (kind, r["replicated"])
            assert r["sharded"] >= 14, (kind, r)
