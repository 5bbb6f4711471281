"""Attention written out with scores no ring computes (ALiBi, a sliding window, tanh soft-capping), run on a
sequence chunk with its keys and values gathered (autotp.analysis.keyed_attention). Structural: captured
graphs, no process group; the parity at cp 2 and 4 is tests/runtime/test_context_parallel.py's."""
from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

import context_models
import pattern_models
from autotp.analysis.context import find_context
from autotp.capture.tracer import capture
from autotp.plan.context import ContextPlan
from autotp.plan.context_planner import context_plan
from autotp.reports.context import context_report
from autotp.passes.context_parallel import context_parallel
from shared_graphs import SHARED, copy_graph, spelling

SPELLINGS = [(pattern_models, "alibi"), (pattern_models, "softcap"),
             *((context_models, kind) for kind in context_models.KEYED if kind != "sdpa_window")]


def _captured(module, kind: str):
    """The model, inputs and shared capture (tests/support/shared_graphs.py: read here, rewritten as a copy)."""
    model, args, _, gm = spelling(module.__name__, kind)
    return model, args, gm


@SHARED
@pytest.mark.parametrize("module, kind", SPELLINGS, ids=[k for _, k in SPELLINGS])
def test_scores_no_ring_computes_run_with_their_keys_gathered(module, kind):
    """Each layer's attention: kᵀ and v gathered (their sequence dims 3 and 2), the ops between the two
    matmuls kept as written, a mask or bias made from positions (ALiBi's distances, the window, the causal
    triangle) listed with its query dim, computed at the whole length."""
    _, _, gm = _captured(module, kind)
    f = find_context(gm)
    assert f.runs, f.blockers
    assert [a.detail for a in f.attention] == ["keys gathered", "keys gathered"]
    for a in f.attention:
        k = a.keyed
        assert [d for _, d in k.keys] == [3, 2]
        assert any(n.startswith("softmax") for n in k.region)
        assert k.rows and all(d in (0, 1, 2) for _, d in k.rows), k.rows  # the (s, s) or (1, h, s, s) rows dim
        assert k.whole and set(name for name, _ in k.rows) <= set(k.whole)
    assert not f.positions  # an arange only the scores read is theirs: computed whole, not the chunk's


@SHARED
def test_the_rewrite_inserts_the_gathers_and_rows_and_computes_the_same_unbound():
    """Unbound (no process group) the operators are the identity, and at cp 1 the lengths are the whole's:
    the rewritten graph computes the model's numbers; per layer two key gathers, one row cut per mask or
    bias, the originals of the copied mask gone."""
    model, args, gm = _captured(pattern_models, "alibi")
    plan = context_plan(gm, find_context(gm), 1)
    assert len(plan.keyed) == 2 and not plan.attention
    assert ContextPlan.from_dict(json.loads(json.dumps(asdict(plan)))) == plan  # the plan's JSON round trip
    want = model(*args)[1]
    gm = context_parallel(copy_graph(gm), SimpleNamespace(context=plan))
    gm.graph.lint()
    gm.recompile()
    mods = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert sum(m.startswith("autotp_cp_keys_") for m in mods) == 4
    assert sum(m.startswith("autotp_cp_rows_") for m in mods) == sum(d is not None for k in plan.keyed
                                                                     for _, d in k.rows)
    names = {n.name for n in gm.graph.nodes}
    assert not any(name in names for k in plan.keyed for name in k.whole), "the originals are gone"
    torch.testing.assert_close(gm(*args)[1], want, rtol=0, atol=0)


@SHARED
def test_the_plan_reports_the_gathered_keys():
    """``autotp plan --cp``: the attentions with keys gathered counted, K and V bytes per layer priced as a
    ring's, the scores and the gathered K and V kept for backward in the activation bytes."""
    _, _, gm = _captured(context_models, "window")
    r = context_report(gm, context_plan(gm, find_context(gm), 2))
    assert r.keyed == 2 and r.rings == 0
    b, s, h, d = 2, context_models.S, context_models.NH, context_models.HD
    assert r.kv_bytes == 2 * b * s * h * d * 4 // 2
    assert r.activation_unsharded >= 2 * b * h * s * s * 4 * 2  # two layers' scores and probabilities
    # each rank: 1/cp of it, and the gathered K and V of both layers kept whole for the backward
    assert r.activation_bytes == r.activation_unsharded // 2 + 2 * (2 * b * s * h * d * 4 // 2)


@SHARED
def test_probabilities_read_elsewhere_and_folded_heads_are_still_named():
    """Probabilities the model also returns, and ALiBi over heads folded into the batch (BLOOM's baddbmm):
    named with their line, not run."""
    _, _, gm = _captured(context_models, "probs_out")
    f = find_context(gm)
    assert not f.runs and any("also read outside the attention" in b.detail for b in f.blockers), f.blockers
    _, _, gm = _captured(pattern_models, "baddbmm_alibi")
    assert not find_context(gm).runs


def test_one_mask_made_for_every_layer_is_theirs():
    """A mask made once and read by every layer's attention, all run with their keys gathered: it is theirs,
    copied once at the whole length and cut to the rows; unbound at cp 1 the rewrite computes the model's
    numbers."""
    model, (ids, targets), _ = context_models.build("shared_window")
    gm = capture(model, (ids, targets), {})[0]
    f = find_context(gm)
    assert f.runs, f.blockers
    keyed = [a.keyed for a in f.attention]
    assert len(keyed) == 2 and set(keyed[0].rows) == set(keyed[1].rows), [k.rows for k in keyed]
    plan = context_plan(gm, f, 1)
    gm = context_parallel(gm, SimpleNamespace(context=plan))
    gm.graph.lint()
    gm.recompile()
    copies = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("autotp_cp_rows_")]
    assert len(copies) == 1 and len(copies[0].users) == 2  # one copy, read by both layers
    torch.testing.assert_close(gm(ids, targets)[1], model(ids, targets)[1], rtol=0, atol=0)


def test_gemma2_soft_capped_and_windowed_scores_run_with_keys_gathered():
    """Gemma-2 (eager): tanh-capped scores, a sliding window every other layer; the mask machinery's ops
    over positions (a cumulative sum, a difference) are computed whole with the mask, not refused."""
    import context_workers

    model, args, kwargs = context_workers._build("hf_gemma2")
    f = find_context(capture(model, args, kwargs)[0])
    assert f.runs, f.blockers
    assert [a.detail for a in f.attention] == ["keys gathered", "keys gathered"]
    assert all(any("tanh" in n for n in a.keyed.region) for a in f.attention)


@pytest.mark.parametrize("kind", ["sdpa_window", "hf_llama_padded"])
def test_sdpa_with_a_mask_that_is_not_causal_runs_with_keys_gathered(kind):
    """``scaled_dot_product_attention`` given a sliding window as an additive mask, or Hugging Face Llama
    given a padding mask (computed from the whole ``attention_mask`` input on every rank): SDPA's own k and
    v gathered (sequence dim 2), the mask cut to the query rows; no ring."""
    import context_workers

    model, args, kwargs = context_workers._build(kind)
    gm = capture(model, args, kwargs)[0]
    f = find_context(gm)
    assert f.runs, f.blockers
    assert f.attention and all(a.detail == "keys gathered" for a in f.attention)
    nodes = {n.name: n for n in gm.graph.nodes}
    for a in f.attention:
        assert a.keyed.region == (a.keyed.out,) == (a.keyed.scores,)  # the SDPA call itself
        assert len(a.keyed.rows) == 1
        for (name, dim), span in zip(a.keyed.keys, a.keyed.spans):
            shape = nodes[name].meta["val"].shape
            per_token = shape.numel() // (shape[0] * shape[dim])
            if kind == "hf_llama_padded":  # gathered before repeat_kv: the 2 kv heads travel, not all 4
                assert span and per_token == model.config.num_key_value_heads * 16, (name, shape, span)
            else:
                assert not span and dim == 2 and per_token == context_models.NH * context_models.HD
    if kind == "hf_llama_padded":  # one mask for all four layers, read off the whole padding mask
        assert len({a.keyed.rows for a in f.attention}) == 1
        assert len(f.inputs) == 3, f.inputs  # ids, the padding mask and the labels, each (b, s)


class _DroppedProbs(torch.nn.Module):
    """Attention written out with dropout on its probabilities (training) and a sliding window."""

    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 96), torch.nn.Linear(32, 64)

    def forward(self, idx, targets):
        b, s = idx.shape
        q, k, v = self.qkv(self.emb(idx)).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        i = torch.arange(s, device=idx.device)
        near = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 4)
        att = torch.nn.functional.dropout((q @ k.transpose(-2, -1)).masked_fill(~near, float("-inf")).softmax(-1),
                                          0.1, self.training)
        logits = self.head((att @ v).transpose(1, 2).reshape(b, s, 32))
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_attention_dropout_on_the_rows_draws_from_the_chunks_stream():
    """Dropout on the probabilities of a keys-gathered attention runs on the chunk's rows: listed with the
    random ops, so each cp rank draws its own masks (not the same masks for different rows); the layout
    search leaves such a model's cp unpriced, naming the attention."""
    from autotp.search.model_costs import context_costs

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16))
    gm = capture(_DroppedProbs(), (ids, ids), {})[0]
    f = find_context(gm)
    assert f.runs and f.attention[0].keyed is not None, f.blockers
    assert [n for n in f.random if n in f.attention[0].keyed.region] == [n for n in f.random], f.random
    assert len(f.random) == 1
    why, width, heads = context_costs(gm)
    assert "keys gathered" in why and width is None
