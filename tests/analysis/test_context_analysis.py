"""Context parallelism's analysis: which captured forwards can run on 1/cp of their sequence, and where the
others are stopped (op, module, source line). Structural: captured graphs, no process group."""
from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from autotp.analysis.context import find_context
from autotp.capture.tracer import capture
from shared_graphs import SHARED, spelling


def _facts(model, *args, **kwargs):
    return find_context(capture(model, args, kwargs)[0])


def _built(model, args, kwargs):
    return _facts(model, *args, **kwargs)


def _shared(module: str, kind: str):
    """The facts of a test model's shared capture (tests/support/shared_graphs.py; the analysis only reads it)."""
    return find_context(spelling(module, kind)[3])


def _nanogpt(**config):
    """nanoGPT with its flash path (``F.scaled_dot_product_attention(..., is_causal=True)``): tests/scripts."""
    module = sys.modules.get("nanogpt_model")
    if module is None:
        path = Path(__file__).resolve().parents[1] / "scripts" / "nanogpt_model.py"
        spec = importlib.util.spec_from_file_location("nanogpt_model", path)
        module = sys.modules["nanogpt_model"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.GPT(module.GPTConfig(n_layer=2, **config))


@functools.cache
def _nanogpt_facts():
    """The facts of nanoGPT called with ids and targets of (2, 8), read by two tests (one capture)."""
    idx = torch.randint(0, 128, (2, 8))
    return _facts(_nanogpt(), idx, idx)


def test_nanogpt_runs_on_a_chunk():
    """SDPA (causal) per layer as ring attention, the position embedding's arange, the loss's token mean."""
    f = _nanogpt_facts()
    assert f.runs and not f.blockers
    assert [a.detail for a in f.attention] == ["causal", "causal"]
    assert [a.where.split(", ")[1] for a in f.attention] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert all("nanogpt_model.py:" in a.where for a in f.attention)
    assert len(f.positions) == 1 and f.positions[0].node.startswith("arange")
    assert [r.node for r in f.reductions] == ["cross_entropy_loss"]
    assert [d for _, d in f.inputs] == [1, 1]  # ids and targets, (b, s)


@SHARED
def test_heads_folded_into_the_batch_run_as_sdpa():
    """GPT-2 / BLOOM's spelling: q, k and v reshaped to (b·h, s, d), ``baddbmm(zeros, q, kᵀ, beta=0, alpha=c)``,
    a masked softmax and ``bmm(p, v)``: the (b, h, s, d) q, k and v are found behind the folds, the output
    folded back; with an ALiBi bias (beta=1) it is not SDPA's computation, and is named."""
    import pattern_models

    f = _shared("pattern_models", "baddbmm")
    assert f.runs and [a.detail for a in f.attention] == ["causal", "causal"]
    assert all(a.written.folded and a.scale == pattern_models.HD ** -0.5 for a in f.attention)
    assert all(a.written.q.startswith("transpose") for a in f.attention)  # (b, h, s, d), before the fold
    alibi = _shared("pattern_models", "baddbmm_alibi")
    assert not alibi.runs and len(alibi.blockers) == 2


@SHARED
def test_dropout_on_the_chunks_is_listed_for_a_stream_of_its_own():
    """Dropout on the embeddings and the residual branches reads values carrying the sequence: each rank draws
    its chunk's masks from its own stream; at p = 0 nothing is random."""
    import context_models

    model, args, _ = context_models.build("bool_sdpa_mask", dropout=0.1)
    f = _built(model, args, {})
    assert f.runs and len(f.random) == 3 and all("dropout" in name for name in f.random)
    assert _shared("context_models", "bool_sdpa_mask").random == ()


def test_the_last_tokens_logits_and_attention_dropout_are_named():
    idx = torch.randint(0, 128, (2, 8))
    f = _facts(_nanogpt(), idx)  # no targets: the head reads x[:, [-1], :]
    assert not f.runs
    (b,) = f.blockers
    assert "picks positions by index" in b.detail and "nanogpt_model.py:" in b.where
    f = _facts(_nanogpt(dropout=0.1).train(), idx, idx)
    assert {b.detail for b in f.blockers} == {"attention dropout: not run as ring attention"}


@SHARED
@pytest.mark.parametrize("kind, op", [("cumsum_fn", "aten.cumsum"), ("cumsum_method", "aten.cumsum"),
                                      ("roll_shift", "aten.roll"), ("pad_shift", "aten.pad")])
def test_ops_that_mix_positions_are_named_with_their_line(kind, op):
    """A running sum, a roll or a pad along the sequence: torch's rule would gather the sequence, so the op
    is refused, named with its module and line (each layer)."""
    f = _shared("torch_rule_models", kind)
    mixing = [b for b in f.blockers if op in b.detail]
    assert len(mixing) == 2 and not f.runs, f.blockers
    assert all("torch_rule_models.py:" in b.where and ".attn" in b.where for b in mixing)


@SHARED
@pytest.mark.parametrize("kind", ["plain", "rope_interleaved", "rope_complex"])
def test_hand_written_causal_attention_runs_as_sdpa(kind):
    """softmax(q·kᵀ/√d masked by tril)·v written out: each layer's chain is SDPA's (causal, scale 1/√d), its
    q, k and v those the matmuls read; the rotary tables read up to the length are read by position."""
    import pattern_models

    f = _shared("pattern_models", kind)
    assert f.runs, f.blockers
    assert [a.detail for a in f.attention] == ["causal", "causal"]
    assert all(a.written is not None and a.scale == pytest.approx(pattern_models.HD ** -0.5) for a in f.attention)
    assert sum(n.startswith("tril") for n in f.dropped) == 2  # each layer's mask, gone with its scores
    assert len(f.tables) == (4 if kind == "rope_interleaved" else 2 if kind == "rope_complex" else 0), f.tables


@SHARED
def test_a_written_attention_left_whole_is_named_once_per_layer():
    """An ALiBi bias over heads folded into the batch (BLOOM's baddbmm spelling) is neither SDPA's scores nor
    run with its keys gathered yet: one reason per attention, where its scores are made."""
    f = _shared("pattern_models", "baddbmm_alibi")
    assert [b.where.split(", ")[1] for b in f.blockers] == ["blocks.0.attn", "blocks.1.attn"], f.blockers
    assert all("hand-written attention" in b.detail for b in f.blockers)


@SHARED
@pytest.mark.parametrize("kind", ["buffer_mask", "where_mask", "additive_min", "einsum_rope", "bool_sdpa_mask"])
def test_masks_proven_causal_in_every_spelling(kind):
    """A mask read from a buffer sliced to the length, made by ``where``, added as finfo.min, by einsum, or a
    boolean mask from positions passed to SDPA: computed at several lengths, the lower triangle each time."""
    f = _shared("context_models", kind)
    assert f.runs, f.blockers
    assert [a.detail for a in f.attention] == ["causal", "causal"]
    assert all((a.written is None) == (kind == "bool_sdpa_mask") for a in f.attention)


@SHARED
@pytest.mark.parametrize("kind", ["probs_out", "offset_table"])
def test_what_is_not_causal_attention_is_named(kind):
    """Probabilities the model also returns, a rotary table read from an offset: each named, with the
    model's line (a sliding window runs with its keys gathered: tests/analysis/test_keyed_attention.py)."""
    import context_models

    f = _shared("context_models", kind)
    assert not f.runs
    assert any(context_models.NAMED[kind] in b.detail and "context_models.py:" in b.where for b in f.blockers), \
        f.blockers


def test_a_mask_buffer_on_meta_is_not_proven_causal_and_runs_with_its_keys_gathered():
    """Built on meta, the mask buffer has no values to compute: not assumed causal (no ring), but the mask
    is made from a buffer alone, so the attention runs as written with its keys gathered, the mask read
    from whatever the buffer holds when it runs."""
    import context_models

    with torch.device("meta"):
        model = context_models.build("buffer_mask")[0]
    args = tuple(torch.zeros(2, context_models.S, dtype=torch.long) for _ in range(2))
    f = _facts(model, *args)
    assert f.runs and [a.detail for a in f.attention] == ["keys gathered", "keys gathered"], f.blockers
    assert all(any(n.startswith("slice") for n in a.keyed.whole) for a in f.attention)


def test_hugging_face_llama_runs_with_its_mask_proven_and_its_labels_shifted_whole():
    """Llama (SDPA) passes a mask made from positions: proven causal at each layer and dropped. Its loss
    shifts the labels along the sequence (pad, slice): computed on the whole labels, the result cut."""
    import llama

    f = _facts(llama.build_model(), **llama.example_batch())
    assert f.runs, f.blockers
    assert [a.detail for a in f.attention] == ["causal"] * 4 and all(a.written is None for a in f.attention)
    assert {n.rstrip("_0123456789") for n in f.whole} >= {"pad", "slice"}
    assert any(name in f.whole for name, _ in f.chunks) and f.dropped


def test_without_attention_there_is_no_sequence_to_split():
    lin = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    f = _facts(lin, torch.randint(0, 16, (2, 6)))
    assert not f.runs and not f.length and "no attention" in f.blockers[0].detail


def test_the_examples_hand_written_nanogpt_runs_as_sdpa():
    """examples/nanogpt.py writes attention out (scores, tril mask, softmax, ·v): SDPA's, causal, per layer;
    its scores, mask and softmax are dropped with the rewrite."""
    from nanogpt import GPT, GPTConfig

    idx = torch.randint(0, 128, (2, 8))
    f = _facts(GPT(GPTConfig()), idx, idx)
    assert f.runs, f.blockers
    assert [a.detail for a in f.attention] == ["causal", "causal"] and all("nanogpt.py:" in a.where
                                                                          for a in f.attention)
    assert sum(n.startswith("softmax") for n in f.dropped) == 2


def test_an_arange_not_one_per_token_is_named():
    """Positions are computable on a chunk only for one value per token: ``arange(2 * s)`` is refused."""

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos = torch.nn.Embedding(16, 8), torch.nn.Embedding(64, 8)

        def forward(self, idx):
            x = self.emb(idx)  # (b, s, h)
            q = x.view(x.size(0), 1, x.size(1), 8)
            pos = torch.arange(2 * idx.size(1), device=idx.device)[::2]
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True) + self.pos(pos)

    f = _facts(Twice(), torch.randint(0, 16, (2, 6)))
    assert any("not one position per token" in b.detail for b in f.blockers), f.blockers


def test_outputs_carrying_the_sequence_are_found_by_symbol():
    """The logits (b, s, V) are gathered back, the scalar loss is not."""
    assert _nanogpt_facts().outputs == ((0, 1),)


def test_a_tied_weight_enters_the_cp_gradient_sum_once():
    """nanoGPT ties its embedding and LM head: the plan sums the tensor's gradient through one read, and the
    other read takes that sum (a tensor handed twice to one autograd Function is a graph break under compile);
    after the pass one ContextGrads reads each trained tensor once."""
    from autotp.passes.context_parallel import context_parallel
    from autotp.plan.context_planner import context_plan
    from autotp.plan.plan import Plan

    idx = torch.randint(0, 128, (2, 8))
    gm = capture(_nanogpt(), (idx, idx), {})[0]
    plan = context_plan(gm, find_context(gm, 2), 2)
    ((read, first),) = plan.tied
    nodes = {n.name: n for n in gm.graph.nodes}
    assert gm.get_parameter(nodes[read].target) is gm.get_parameter(nodes[first].target) and first in plan.grads
    tensors = [gm.get_parameter(nodes[n].target) for n in plan.grads]
    assert len({id(t) for t in tensors}) == len(tensors) == len(list(gm.parameters()))
    gm = context_parallel(gm, Plan(1, context=plan))
    (group,) = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "autotp_cp_grads"]
    assert len(group.args) == len(plan.grads) and not nodes[read].users


@pytest.mark.extended
def test_expert_routing_runs_on_a_chunk():
    """A mixture of experts' routing is per token: top-k over each token's own scores, its ids one-hot per
    expert, each token repeated per slot (``repeat_interleave``) and an expert weight gathered per slot by id
    (``W[ids]``: only the ids carry the sequence): all commute with a sequence split. Counting tokens in order
    (an expert capacity's ``cumsum`` over the flattened b·s) does not, and is named with its line; a
    load-balancing loss (a product of two means over tokens) is refused by the planner, which completes only a
    cross-entropy's mean over the group."""
    import moe_models

    from autotp.plan.context_planner import ContextRefused, context_plan

    f = _built(*moe_models.build("gathered_bmm"))
    assert f.runs and not f.blockers, f.blockers
    capacity = _built(*moe_models.build("capacity"))
    assert [b.node for b in capacity.blockers] == ["cumsum", "cumsum_1"]
    assert all("moe_models.py:" in b.where for b in capacity.blockers)
    model, args, kwargs = moe_models.build("top1_aux")
    gm = capture(model, args, kwargs)[0]
    with pytest.raises(ContextRefused, match="only an unweighted cross-entropy's mean is completed"):
        context_plan(gm, find_context(gm), 2)
