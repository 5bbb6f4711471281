"""Analysis hands the planner one result: ``make_plan`` analyses a graph once, and the plan is the plan of that
result; the whole-weight report names a tied weight once, and never one the plan cuts under another name."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autotp.analysis.result import analyze_graph
from autotp.capture.tracer import capture
from autotp.plan import planner

V, S, H = 32, 8, 16


class Tied(nn.Module):
    """A tied embedding and head (cut under either name), an MLP pair, and a weight read through tanh (whole)
    registered under two names."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.up, self.down = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
        self.mix = nn.Parameter(torch.randn(H, H) / 4)
        self.mix_again = self.mix
        self.head = nn.Linear(H, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx, targets):
        x = self.emb(idx)  # (b, s, h)
        x = x + self.down(F.gelu(self.up(x)))
        x = x @ torch.tanh(self.mix)
        logits = self.head(x)  # (b, s, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _graph():
    torch.manual_seed(0)
    model = Tied()
    idx, targets = torch.randint(0, V, (2, S)), torch.randint(0, V, (2, S))
    return capture(model, (idx, targets), {})[0]


def test_make_plan_analyses_the_graph_once_and_plans_what_it_found(monkeypatch):
    gm = _graph()
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return analyze_graph(*args, **kwargs)

    monkeypatch.setattr(planner, "analyze_graph", counted)
    for sp in (False, True):
        calls.clear()
        plan = planner.make_plan(gm, 2, sequence_parallel=sp)
        assert len(calls) == 1 and calls[0]["sequence_parallel"] is sp
        facts = analyze_graph(gm, 2, sequence_parallel=sp)
        assert (facts.sequence is not None) is sp and facts.experts is None
        assert planner.plan_from_facts(gm, facts) == plan
        assert (plan.sequence is not None) is sp
    assert planner.make_plan(gm, 1).units == planner.plan_from_facts(gm, analyze_graph(gm, 1)).units
    assert analyze_graph(gm, 1).pairs is None


def test_a_tied_weight_is_reported_whole_once_and_a_tied_cut_weight_never():
    gm = _graph()
    facts = analyze_graph(gm, 2)
    by_names = {c.names: c.param for c in facts.whole}
    # every 2-D weight is a candidate once, under all its names
    assert set(by_names) == {("emb.weight", "head.weight"), ("up.weight",), ("down.weight",), ("mix", "mix_again")}
    plan = planner.make_plan(gm, 2)
    cut = {name for name, _ in plan.params}
    # the tied table is cut under the name the graph reads it by, once
    assert {"up.weight", "down.weight"} <= cut and len(cut & {"emb.weight", "head.weight"}) == 1
    whole = {w.name: w.reason for w in plan.whole}
    assert set(whole) == {"mix"}, whole
    assert "tanh" in whole["mix"], whole  # read under its other name


def test_an_analysis_reads_no_facts_left_on_the_graph_by_another():
    """One capture planned at several tp sizes (``autotp plan --auto``): each analysis writes its own facts on
    the nodes and reads none an earlier one left. Facts planted on every node (as an analysis at another tp
    would leave them where this one cuts nothing) are gone: only the nodes of this analysis's pairs carry
    one, and each is the sharding its pair found."""
    from autotp.analysis.pairs import analyze
    from autotp.shard_spec import Segment, Sharding

    gm = _graph()
    planted = Sharding(0, (Segment(7, 2),))
    for n in gm.graph.nodes:
        n.meta["autotp"] = planted
    result = analyze(gm, 2)
    cut = {n: s for p in result.pairs for n, s in p.region.specs.items()}
    assert cut and {n for n in gm.graph.nodes if "autotp" in n.meta} == set(cut)
    assert all(n.meta["autotp"] == s != planted for n, s in cut.items())
