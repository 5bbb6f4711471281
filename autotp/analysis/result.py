"""Everything analysis finds in one captured graph at one tp, made by one call: what the planner reads.

    facts = analyze_graph(gm, tp, sequence_parallel=True)
    facts.units       # the model's blocks and their parameters (any tp)
    facts.pairs       # column→row pairs, replicated modules and why, the sharding of every value
    facts.vocab       # vocab-parallel embeddings, heads and losses
    facts.experts     # E/tp whole experts per rank (expert parallelism only)
    facts.sequence    # where the sequence is cut between the pairs (sequence parallelism only)
    facts.whole       # every 2-D parameter with the reason it stays whole if the plan does not cut it

Each stage reads the graph and the stages before it, never a plan; the planner turns the result into a
:class:`~autotp.plan.plan.Plan` without calling analysis again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autotp.analysis.after_rows import name_after_rows
from autotp.analysis.coverage import WholeCandidate, whole_candidates
from autotp.analysis.experts import ExpertFacts, analyze_experts
from autotp.analysis.pairs import Analysis, analyze
from autotp.analysis.row_gates import name_row_gates
from autotp.analysis.sequence import SeqFacts, analyze_sequence
from autotp.analysis.units import UnitFacts, find_units
from autotp.analysis.vocab import VocabFacts, analyze_vocab


@dataclass(frozen=True)
class GraphFacts:
    """What :func:`analyze_graph` found; at tp 1 only the units (nothing is cut)."""

    tp: int
    units: tuple[UnitFacts, ...]
    pairs: Analysis | None = None
    vocab: VocabFacts | None = None
    experts: ExpertFacts | None = None
    sequence: SeqFacts | None = None
    whole: tuple[WholeCandidate, ...] = ()


def analyze_graph(gm: fx.GraphModule, tp: int, *, vocab_multiple: int = 1, sequence_parallel: bool = False,
                  expert_parallel: bool = False, pairs_only: bool = False) -> GraphFacts:
    """Analyze ``gm`` for ``tp`` ranks: the units, then (tp > 1) the pairs, the vocab-parallel layers, the
    experts and the sequence-parallel regions where asked, and the candidates for the whole-weight report.
    ``pairs_only``: the units and the pairs alone, at any tp (at tp 1 each pair's segments are whole blocks):
    what a fused projection's segments are read from (:func:`~autotp.plan.planner.fused_segments`)."""
    units = find_units(gm)
    if tp == 1 and not pairs_only:
        return GraphFacts(1, units)
    a = analyze(gm, tp)
    if pairs_only:
        return GraphFacts(tp, units, a)
    v = analyze_vocab(gm, a, tp, vocab_multiple)
    name_after_rows(a, frozenset(h.matmul.node for h in v.heads))  # once the LM heads are known
    name_row_gates(a)
    return GraphFacts(
        tp, units, a, v,
        experts=analyze_experts(gm, a) if expert_parallel else None,
        sequence=analyze_sequence(gm, a, v) if sequence_parallel else None,
        whole=whole_candidates(gm, a),
    )
