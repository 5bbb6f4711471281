"""The rank jobs' capture reuse (tests/support/capture_reuse.py) gives each model its own graph: a reused graph
holds the new model's parameters and computes its outputs, and any difference the export could read (an
attribute, a shape, a hook, the inputs, autocast) exports again. Fast tier: captures in this process."""
from __future__ import annotations

import torch

import small_models
from autotp.capture.structure import flatten
from autotp.capture.tracer import capture
from capture_reuse import _call_key, captures_reused


def _nanogpt(seed: int):
    model, args, kwargs = small_models.MODELS["nanogpt"]()
    if seed:  # other weights, same code, shapes and attributes
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))
    return model, args, kwargs


def _outputs(gm, args, kwargs) -> list[torch.Tensor]:
    flat, _ = flatten((tuple(args), dict(kwargs)))
    return [o for o in gm(*flat) if isinstance(o, torch.Tensor)]


def test_an_equal_model_gets_the_graph_bound_to_its_own_tensors():
    with captures_reused() as counts:
        m1, a1, k1 = _nanogpt(0)
        g1, _ = capture(m1, a1, k1)
        m2, a2, k2 = _nanogpt(1)
        g2, _ = capture(m2, a2, k2)
    assert counts == {"exported": 1, "reused": 1}
    assert g2.code == g1.code
    own = dict(m2.named_parameters())
    assert all(p is own[n] for n, p in g2.named_parameters())
    logits, loss = m2(*a2, **k2)
    out = _outputs(g2, a2, k2)
    assert torch.equal(next(o for o in out if o.shape == logits.shape), logits)
    assert not torch.equal(next(o for o in _outputs(g1, a1, k1) if o.shape == logits.shape), logits)


def _key(model, args, kwargs):
    return _call_key(model, type(model).forward.__get__(model), args, kwargs, None, torch.device("cpu"), False, False)


def test_what_the_export_reads_tells_models_apart():
    m1, a1, k1 = _nanogpt(0)
    base = _key(m1, a1, k1)
    assert base is not None and _key(*_nanogpt(1)) == base  # other weights: the same graph
    m2, a2, k2 = _nanogpt(0)
    m2.transformer.h[0].attn.dropout = 0.5  # a plain attribute the forward reads
    m3, a3, k3 = _nanogpt(0)
    m3.lm_head.register_forward_hook(lambda mod, inp, out: out)
    m4, a4, k4 = _nanogpt(0)
    m5, a5, k5 = _nanogpt(0)
    m5.lm_head.weight.requires_grad_(False)
    m6, a6, k6 = _nanogpt(0)
    m6.eval()
    keys = [_key(m2, a2, k2), _key(m4, tuple(a[:, :4] for a in a4), k4), _key(m5, a5, k5), _key(m6, a6, k6)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        keys.append(_key(*_nanogpt(0)))
    assert _key(m3, a3, k3) is None  # a hook: never reused
    assert all(k is not None and k != base for k in keys) and len(set(keys)) == len(keys)
