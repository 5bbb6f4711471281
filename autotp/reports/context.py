"""What context parallelism does to one training step, for ``autotp plan --cp``: which attentions run as
rings, what else the rewrite touches, and per rank the activation bytes and the K/V bytes (the formulas
``benchmarks/context_parallel.py`` measures against).

Per transformer layer, fp32 terms scaled to the model's dtype, no dropout (Korthikanti et al. 2022 with fused
attention, benchmarks/activation_memory.py derives each term): ``(64·sbh + 4·asb + 16·sb) / cp`` bytes kept for
backward on each rank; K and V of the other ranks received, ``2·b·s·h_kv·(cp−1)/cp`` elements forward and as
many backward (the ring gathers them again rather than keeping them). An attention written out with scores no
ring computes (:class:`~autotp.plan.context.KeyedCall`) receives as much by one all-gather of K and V, and
keeps its (b, a, s/cp, s) scores and probabilities for backward, ``2·b·a·s·s / cp`` elements more, and the
gathered K and V themselves (the ring gathers them anew in backward): ``2·b·s·h_kv·(cp−1)/cp`` more.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.fx as fx

from autotp.plan.context import ContextPlan


@dataclass(frozen=True)
class ContextReport:
    cp: int
    batch: int
    seq: int
    rings: int  # attentions run as rings
    causal: int  # of them causal (is_causal, or a mask proven causal)
    written: int  # of them written out by hand, run as SDPA
    positions: int  # aranges over the sequence: the chunk's global positions
    tables: int  # tables read up to the length: the chunk's rows
    whole: int  # ops on the inputs alone, run on the whole inputs (a label shift)
    losses: int  # cross-entropy means completed over the group
    activation_bytes: int  # kept for backward per rank, all attention layers (formula)
    activation_unsharded: int  # the same on one device
    kv_bytes: int  # K and V each rank receives per layer, forward (as much again backward)
    keyed: int = 0  # attentions written out with scores no ring computes: keys and values gathered

    def to_dict(self) -> dict:
        return asdict(self)


def _hint(size) -> int:
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def context_report(gm: fx.GraphModule, plan: ContextPlan) -> ContextReport:
    """The report of ``plan`` on the graph it was made from, at the capture's batch and length."""
    nodes = {n.name: n for n in gm.graph.nodes}
    act = kv = whole = 0
    b = s = 0
    for ring in plan.attention:
        n = nodes[ring.node]
        q, k = (nodes[ring.inputs[0]], nodes[ring.inputs[1]]) if ring.inputs else (n.args[0], n.args[1])
        qv, kv_ = q.meta["val"], k.meta["val"]
        b, a, s, d = (_hint(x) for x in qv.shape)
        hk = _hint(kv_.shape[1]) * _hint(kv_.shape[3])
        size = qv.element_size()
        act += (16 * s * b * a * d + a * s * b + 4 * s * b) * size  # fp32's 64·sbh + 4·asb + 16·sb, per byte
        kv += 2 * b * s * hk * size * (plan.cp - 1) // plan.cp
    for call in plan.keyed:
        (name, seq), = call.keys[:1]  # kᵀ (b, h_kv, d, s) as a written-out matmul reads it, or SDPA's k
        q, k = nodes[call.scores].args[0], nodes[name]  # q (b, h, s, d)
        qv, kv_ = q.meta["val"], k.meta["val"]
        b, a, s, d = (_hint(x) for x in qv.shape)
        hk = _hint(kv_.shape[1]) * _hint(kv_.shape[2 if seq == 3 else 3])
        size = qv.element_size()
        act += (16 * s * b * a * d + a * s * b + 4 * s * b + 2 * b * a * s * s) * size
        kv += 2 * b * s * hk * size * (plan.cp - 1) // plan.cp
        whole += 2 * b * s * hk * size * (plan.cp - 1) // plan.cp  # the gathered K and V, kept for backward
    layers = max(1, len(plan.attention) + len(plan.keyed))
    return ContextReport(plan.cp, b, s, len(plan.attention), sum(r.is_causal for r in plan.attention),
                         sum(bool(r.inputs) for r in plan.attention), len(plan.positions), len(plan.tables),
                         len(plan.whole), len(plan.losses), act // plan.cp + whole, act, kv // layers,
                         len(plan.keyed))
