"""torch's rules behind autotp's table (:mod:`autotp.analysis.torch_rules`): an op autotp does not list is
placed by DTensor's sharding strategies (or DTensor's decomposition of it), checked by running it on
random shards, and refused with the op's name where it is not local; attention through such ops
(tests/support/torch_rule_models.py) is fully sharded and exact at tp 2 and 4 with Megatron's collectives."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autotp.analysis import torch_rules
from autotp.analysis.op_rules import TORCH, op_rule
from autotp.analysis.torch_rules import TorchRefused, ask_torch, torch_rule_source
from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from spelling_runs import SpellingRuns
from shared_graphs import SHARED, spelling
from parity_checks import assert_patterns_train_exactly
from pattern_models import H, S, LMWith, build_with
from test_op_rules import _graph, _out, _refuses, _s, _x
from torch_rule_models import KINDS, Attention

aten = torch.ops.aten


def _ask(op, sharded: dict[int, int], *args, tp: int = 2):
    node, inputs = _graph(op, *args)
    return ask_torch(node, {inputs[i]: d for i, d in sharded.items()}, tp), inputs


@pytest.mark.parametrize("op, args, sharded, outputs", [
    (aten.cumsum.default, (_x(2, 4, 6, 3), -2), {0: 1}, (1,)),  # along the sequence, heads sharded
    (aten.roll.default, (_x(2, 4, 6), [1], [2]), {0: 1}, (1,)),
    (aten.sort.default, (_x(2, 4, 6), -1), {0: 1}, (1, 1)),  # values and indices
    (aten.topk.default, (_x(2, 4, 6), 3), {0: 0}, (0, 0)),
    (aten.constant_pad_nd.default, (_x(2, 4, 6), [1, 0]), {0: 1}, (1,)),
    (aten.diff.default, (_x(2, 4, 6), 1, -1), {0: 1}, (1,)),  # DTensor derives it from diff's decomposition
])
def test_torch_places_ops_autotp_does_not_list(op, args, sharded, outputs):
    assert op_rule(op) is TORCH
    answer, _ = _ask(op, sharded, *args)
    assert answer.outputs == outputs and answer.slices == ()


def test_a_linear_captured_under_autocast_cut_along_its_rows_is_local():
    """A graph captured under autocast holds linears of a bf16 activation and the fp32 weight and bias
    (autocast casts them when it runs): cut along the sequence, each part is the whole's rows. The check runs
    16-bit operands in fp32, as the op computes them under autocast, not as mixed dtypes outside it."""
    x, w, b = _x(2, 32, 64, dtype=torch.bfloat16), _x(64, 64), _x(64)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the call's value, as the capture recorded it
        node, inputs = _graph(aten.linear.default, x, w, b)
    assert ask_torch(node, {inputs[0]: 1}, 2).outputs == (1,)


def test_a_replicated_operand_read_as_a_shard_is_sliced():
    idx = torch.randint(0, 6, (2, 4, 3))
    answer, (x, index) = _ask(aten.gather.default, {0: 1}, _x(2, 4, 6), -1, idx)
    assert answer.outputs == (1,) and answer.slices == ((index, 1),)
    assert _out(aten.gather.default, {0: _s(1, 4)}, _x(2, 4, 6), -1, idx) == _s(1, 4)


@pytest.mark.parametrize("op, args, why", [
    (aten.cumsum.default, (_x(2, 4, 6), -1), "needs x0 whole, not sharded on dim 2"),  # along the shards
    (aten.sum.default, (_x(2, 4, 6),), "partial result: it would need an all-reduce"),
    (aten.new_full.default, (_x(2, 4, 6), [2, 4, 6], 1.0), "takes the global shape"),
    (aten.cumsum_.default, (_x(2, 4, 6), 0), "writes into its input"),
    (aten.rand_like.default, (_x(2, 4, 6),), "draws random numbers"),
])
def test_what_torch_cannot_keep_local_is_refused_with_the_op_named(op, args, why):
    with pytest.raises(TorchRefused, match=why):
        _ask(op, {0: 2}, *args)


def test_an_op_neither_table_has_says_so():
    assert op_rule(aten.searchsorted.Tensor) is None and torch_rule_source(aten.searchsorted.Tensor) is None
    _refuses(aten.searchsorted.Tensor, "no sharding rule for aten.searchsorted.Tensor, in autotp's table or torch's",
             {1: _s(1, 4)}, torch.arange(6.0).expand(2, 6), _x(2, 4))
    assert torch_rule_source(aten.cumsum.default) == "strategy"
    assert torch_rule_source(aten.diff.default) == "decomposition"


def test_torchs_answer_is_checked_on_random_shards(monkeypatch):
    """DTensor's cumsum rule reads ``dim=-1`` as a dim other than the sharded last one (its strategy compares
    the dim unnormalized): autotp asks with the dims normalized, and also runs the op on random shards, which
    catches the wrong answer when the question is put as the model spelled it."""
    monkeypatch.setattr(torch_rules, "_dims_normalized", lambda node: (node.args, dict(node.kwargs)))
    with pytest.raises(TorchRefused, match="a check on random values disagrees"):
        _ask(aten.cumsum.default, {0: 2}, _x(2, 4, 6), -1)


def test_torchs_cache_answers_only_questions_it_keys_in_full():
    """torch's sharding cache keys a question by its tensor specs and only the arguments from the op's
    registered ``static_argnum`` on: a schema without that info (an op whose rule torch derives from its
    decomposition, until it first derives it) or with a size before that index is asked afresh; questions that
    differ only in a dim get answers of their own either way."""
    from torch.distributed.tensor._op_schema import OpSchema, RuntimeSchemaInfo

    cumsum, (x,) = _graph(aten.cumsum.default, _x(2, 4, 6), 2)
    args = (_spec(x), *cumsum.args[1:])
    keyed = torch_rules._keyed_in_full
    assert keyed(OpSchema(cumsum.target, args, {}, schema_info=RuntimeSchemaInfo(1)))
    assert not keyed(OpSchema(cumsum.target, args, {}, schema_info=None))  # the dim would not be keyed
    assert not keyed(OpSchema(cumsum.target, args, {}, schema_info=RuntimeSchemaInfo(2)))
    assert not keyed(OpSchema(cumsum.target, args, {"dtype": torch.float32}, schema_info=RuntimeSchemaInfo(1)))
    for op, args in ((aten.diff.default, (1,)), (aten.cumsum.default, ())):
        for _ in range(2):  # asked again: from the cache where torch keys it, each answer still its own
            assert _ask(op, {0: 1}, _x(2, 4, 6), *args, 2)[0].outputs == (1,)  # along the whole last dim
            with pytest.raises(TorchRefused, match="not sharded on dim 1"):  # the same question but the dim
                _ask(op, {0: 1}, _x(2, 4, 6), *args, 1)


def _spec(x):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.placement_types import Shard

    val = x.meta["val"]
    return DTensorSpec(torch_rules._mesh(2), (Shard(1),), TensorMeta(val.shape, val.stride(), val.dtype))


class _RowsByCount(torch.nn.Module):
    """Rows split by counts read at run time and joined again, then added back to their rows: the token dim's
    sizes are known only at run time (``u0``, ``u1``, ``u0 + u1``), the features' are not."""

    def forward(self, x, ids):
        counts = torch.nn.functional.one_hot(ids, 2).sum(0).tolist()
        a, b = x.split(counts)
        return torch.zeros(x.shape[0], 8).index_add(0, ids, torch.cat([a * 2, b * 3]))


def test_a_size_known_only_at_run_time_is_refused_only_on_the_sharded_dim():
    ep = torch.export.export(_RowsByCount(), (_x(6, 8), torch.tensor([0, 1, 0, 1, 1, 0])), strict=False)
    node = next(n for n in ep.graph.nodes if n.target is aten.index_add.default)
    zeros, _, ids, rows = node.args
    assert rows.meta["val"].shape[0].node.hint is None  # u0 + u1
    # cut on the features: torch's answer, checked on operands of stand-in sizes (u0 + u1 == 6, as the graph
    # asserts), and the zeros made this rank's
    answer = ask_torch(node, {rows: 1}, 2)
    assert answer.outputs == (1,) and answer.slices == ((zeros, 1),)
    with pytest.raises(TorchRefused, match="known only at run time on its sharded dim 0"):
        ask_torch(node, {rows: 0}, 2)


def test_asking_torch_needs_no_process_group():
    _ask(aten.cumsum.default, {0: 1}, _x(2, 4, 6, 3), -2, tp=4)
    assert not dist.is_initialized()


@SHARED
@pytest.mark.parametrize("kind", KINDS)
def test_attention_through_torchs_rules_is_planned_by_heads(kind: str):
    gm = spelling("torch_rule_models", kind)[3]
    assert any(op_rule(n.target) is TORCH and n.target not in (aten.linear.default, aten.embedding.default)
               for n in gm.graph.nodes)
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == () and not plan.whole, (plan.replicated, plan.whole)
        for i in range(2):
            assert plan.param(f"blocks.{i}.attn.qkv.weight").role == "column"
            assert plan.param(f"blocks.{i}.attn.proj.weight").role == "row"


class _SeqOps(LMWith):
    """Before the last norm: a cumsum over the features (local to a sequence slice) or over the sequence
    (which needs all of it)."""

    def __init__(self, along: int):
        super().__init__("cumsum_method", Attention)
        self.along = along

    def final_norm(self, x):
        return self.norm(x + torch.cumsum(x, dim=self.along) / H)


def test_sequence_parallelism_asks_torch_too():
    for along, local in ((-1, True), (1, False)):
        torch.manual_seed(0)
        model, args, _ = build_with(_SeqOps(along))
        seq = make_plan(capture(model, args, {})[0], 2, sequence_parallel=True).sequence
        assert seq.leaves, seq.notes
        stopped = [g.reason for g in seq.gathers if "cumsum" in g.reason]
        if local:
            assert not stopped, seq.gathers
        else:
            assert stopped and all("aten.cumsum.default needs" in r for r in stopped), seq.gathers


RUNS = SpellingRuns("torch_rules", "torch_rule_models", KINDS, ["cumsum_method", "topk_scatter"])


@pytest.mark.slow
@pytest.mark.parametrize("world,part", RUNS.params)
def test_attention_through_torchs_rules_trains_exactly_with_megatron_collectives(world: int, part: str):
    assert_patterns_train_exactly(RUNS(world, part), RUNS.kinds(part), world, bsh=2 * S * H, tokens=2 * S)
