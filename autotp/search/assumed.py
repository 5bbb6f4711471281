"""Which terms of a priced step rest on numbers not measured on the device they price: said "assumed".

A preset (:data:`autotp.search.hardware.PRESETS`) is datasheet numbers and fitted curves: every term it
prices is assumed. A profile ``autotp profile`` wrote measured one node: its matmuls, memory bandwidth and
op overhead (the compute term), its AdamW step (the optimizer term), the copies into and out of a flat
buffer (``copy_bandwidth``; profiles written before it have none) and each collective per group size of
adjacent ranks on that node. A collective over a group the profile did not time, or one that spans nodes
(the profile never crosses one), runs at a link taken as measured elsewhere: assumed.
"""
from __future__ import annotations

from autotp.search.cost import Candidate, Estimate, Training
from autotp.search.hardware import Hardware


def _timed(hw: Hardware, kinds: tuple[str, ...], ranks: int, spans_nodes: bool) -> bool:
    """Whether the profile timed each of ``kinds`` over groups of ``ranks`` ranks of one node."""
    timed = {(m.kind, m.ranks) for m in hw.measured}
    return not spans_nodes and all((k, ranks) in timed for k in kinds)


def assumed_terms(hw: Hardware, est: Estimate, training: Training = Training()) -> dict[str, str]:
    """The non-zero terms of ``est`` (:attr:`Estimate.TERMS` names) that rest on a number not measured on
    ``hw``'s device, each with what was not measured."""
    lay: Candidate = est.candidate
    values = est.terms()
    if not hw.matmuls:  # no profile: datasheet numbers and the presets' curves
        return {k: "datasheet numbers and assumed rates, not measured" for k, v in values.items() if v}
    g = hw.gpus_per_node
    t, c, d = lay.tp, lay.cp, lay.dp
    out: dict[str, str] = {}
    tp_kinds = ("all_gather", "reduce_scatter") if lay.sp else ("all_reduce",)
    if not _timed(hw, tp_kinds, t, t > g):
        out["tp comm"] = f"{' and '.join(k.replace('_', '-') for k in tp_kinds)} over {t} ranks not timed"
    if not _timed(hw, ("all_gather", "reduce_scatter"), c, t * c > g):
        out["cp comm"] = f"K/V gathers over {c} ranks{' across nodes' if t * c > g else ''} not timed"
    across = t * c * d >= g  # stage neighbours are tp·cp·dp ranks apart
    gathered = training.scatter_gather and not lay.sp and not _timed(hw, ("all_gather",), t, t > g)
    if not _timed(hw, ("send",), 2, across) or gathered:
        out["pp comm"] = "sends between nodes not timed" if across else "sends not timed"
    f = d * c if lay.fsdp else d
    dp_kinds = ("all_gather", "reduce_scatter") if lay.fsdp else ("all_reduce",)
    # the group's ranks are t (tp·cp for DDP) apart: it spans nodes when they do not fit on one
    spans = f * (t if lay.fsdp else t * c) > g
    missing = []
    if not _timed(hw, dp_kinds, f, spans):
        missing.append(f"{' and '.join(k.replace('_', '-') for k in dp_kinds)} over {f} ranks"
                       f"{' across nodes' if spans else ''} not timed")
    if not hw.copy_bandwidth:
        missing.append("buffer copies at the memory bandwidth (copy rate not measured)")
    if missing:
        out["dp comm"] = "; ".join(missing)
    if not hw.optimizer:
        out["optimizer"] = "AdamW's state read and written at the memory bandwidth (step not timed)"
    return {k: why for k, why in out.items() if values.get(k)}
