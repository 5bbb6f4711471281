"""Weights read in other ways than one module each (tests/support/weight_read_models.py): an MLP's gate and up
projections stacked in one (2, d, D) parameter read by einsum or by index, cut along D as one column; a token
table that is a raw parameter read by index or index_select, vocab-parallel and tied to its ``x @ E.T`` head; a
masked-LM-style head tied to the embedding after a dense layer and a norm, vocab-parallel with the dense layer
whole by design. Each fully sharded and exact with Megatron's collectives."""
from __future__ import annotations

import pytest
import torch

from autotp.capture.lookups import row_reads_as_embeddings
from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from parity_checks import assert_patterns_train_exactly
from parity_workers import pattern_parity
from pattern_models import H, S, V
from ranks import Launches
from weight_read_models import F_, INDEXED, KINDS, STACKED, build

aten = torch.ops.aten


def _fraction(model: torch.nn.Module, plan) -> float:
    """Of the model's parameters, the share one rank holds under ``plan``."""
    shards = dict(plan.params)
    held = sum(torch.Size(shards[n].local_shape).numel() if n in shards else p.numel()
               for n, p in model.named_parameters())
    return held / sum(p.numel() for p in model.parameters())


def test_row_reads_of_a_parameter_become_embedding_lookups():
    """``E[ids]`` and ``E.index_select(0, ids)`` of a 2-D parameter are ``embedding(E, ids)`` (the same values);
    a bool mask, a buffer, a second index tensor and a row read along dim 1 are left as they are."""

    class Reads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.E = torch.nn.Parameter(torch.randn(10, 4))
            self.register_buffer("table", torch.randn(10, 4))

        def forward(self, ids, mask):
            return (self.E[ids], self.E.index_select(0, ids.flatten()), self.E[mask], self.table[ids],
                    self.E[ids, ids % 4], self.E.index_select(1, ids[0, :2] % 4))

    model = Reads()
    ids, mask = torch.tensor([[1, 7, 3]]), torch.rand(10) > 0.5
    gm = capture(model, (ids, mask), {})[0]
    lookups = [n for n in gm.graph.nodes if n.target is aten.embedding.default]
    assert [n.args[0].target for n in lookups] == ["E", "E"]
    assert sum(n.target in (aten.index.Tensor, aten.index_select.default) for n in gm.graph.nodes) == 4
    for got, want in zip(gm(ids, mask), model(ids, mask)):
        assert torch.equal(got, want)
    assert not row_reads_as_embeddings(gm)  # nothing left to rewrite


@pytest.mark.parametrize("kind", KINDS)
def test_each_weight_read_is_cut(kind: str):
    model, args, kwargs = build(kind)
    gm = capture(model, args, kwargs)[0]
    assert torch.equal(gm(*args)[1], model(*args)[1])
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), plan.replicated
        assert _fraction(model, plan) <= 1 / tp + 0.12, (tp, _fraction(model, plan))
        if kind in STACKED:  # both matrices of the stack cut along D, as the down projection's rows
            w = plan.param("blocks.0.mlp.w_in")
            d_axis = 1 if kind == "stacked_index_linear" else 2
            assert w.role == "column" and w.local_shape[d_axis] == F_ // tp, w
            assert plan.param("blocks.0.mlp.down.weight").local_shape == (H, F_ // tp)
        elif kind in INDEXED:  # the raw table is the tied lookup and head: one vocab-parallel shard
            w = plan.param("wte")
            assert w.role == "vocab" and w.local_shape == (V // tp, H), w
            assert len(plan.vocab.embeddings) == 1 and len(plan.vocab.heads) == 1
        else:  # the tied decoder vocab-parallel, the dense layer before its norm whole by design
            assert len(plan.vocab.embeddings) == 1 and len(plan.vocab.heads) == 1
            w = plan.param("decoder.weight" if kind == "mlm_decoder" else "emb.weight")
            assert w.role == "vocab" and w.local_shape == (V // tp, H), w
            (dense,) = [w for w in plan.whole if w.name == "dense.weight"]
            assert dense.reason.startswith("head transform kept whole: its 64→64 linear"), dense.reason


WORLDS = Launches({2: {"weights": (pattern_parity, list(KINDS), 3, False, "weight_read_models")}},
                  extended={4: {"weights at tp 4": (pattern_parity, list(KINDS), 3, False, "weight_read_models")}})


@pytest.mark.slow
@pytest.mark.parametrize("world,part", [pytest.param(2, "weights", id="2"),
                                        pytest.param(4, "weights at tp 4", id="4", marks=pytest.mark.extended)])
def test_weight_reads_train_exactly_with_megatron_collectives(world: int, part: str):
    """3 AdamW steps against the unsharded model: losses, gradients and parameters within 1e-5; each rank holds
    at most 1/tp + 0.12 of the parameters; one all-reduce per block and the embedding's forward, one per block
    and the head's input backward, and the vocab-parallel loss's max and two sums."""
    assert_patterns_train_exactly(WORLDS(world, part), list(KINDS), world, bsh=2 * S * H, tokens=2 * S)


class _RobertaHead(torch.nn.Module):
    """RoBERTa's LM head as one module: dense, gelu, a norm, then the decoder tied to the embedding (an
    ``nn.Linear`` sharing its weight, or ``F.linear(x, emb.weight, bias)``)."""

    def __init__(self, emb: torch.nn.Embedding, spelling: str):
        super().__init__()
        from pattern_models import H, V
        self.spelling, self.emb = spelling, [emb]  # the table is the LM's: not registered here again
        self.dense, self.layer_norm = torch.nn.Linear(H, H), torch.nn.LayerNorm(H)
        if spelling == "decoder":
            self.decoder = torch.nn.Linear(H, V)
            self.decoder.weight = emb.weight
        else:
            self.bias = torch.nn.Parameter(torch.zeros(V))

    def forward(self, x):
        x = self.layer_norm(torch.nn.functional.gelu(self.dense(x)))
        if self.spelling == "decoder":
            return self.decoder(x)
        return torch.nn.functional.linear(x, self.emb[0].weight, self.bias)


class _RobertaHeadLM(torch.nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        from pattern_models import H, V
        from weight_read_models import Block
        self.emb = torch.nn.Embedding(V, H)
        torch.nn.init.normal_(self.emb.weight, std=0.02)
        self.blocks = torch.nn.ModuleList([Block("mlm_decoder")])
        self.lm_head = _RobertaHead(self.emb, spelling)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(x)
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("spelling", ["decoder", "functional"])
def test_a_head_module_holding_its_transform_keeps_the_dense_whole_by_design(spelling: str):
    """The dense layer and the tied decoder in one module (RoBERTa, BERT, Camembert, Data2Vec-Text): the pair
    tried from the dense to the decoder fails, and the decoder is the vocab-parallel head after all, so the
    dense is named as the head's transform (whole by design, as Megatron's BERT head keeps it), not as a
    matmul outside every pair."""
    torch.manual_seed(0)
    model = _RobertaHeadLM(spelling)
    g = torch.Generator().manual_seed(1)
    args = (torch.randint(0, V, (2, S), generator=g), torch.randint(0, V, (2, S), generator=g))
    gm = capture(model, args, {})[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and len(plan.vocab.heads) == 1, (tp, plan.replicated)
        (dense,) = [w for w in plan.whole if w.name == "lm_head.dense.weight"]
        assert dense.reason.startswith("head transform kept whole: its 64→64 linear"), dense.reason
