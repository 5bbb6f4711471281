"""Which attentions of a captured forward run on a sequence chunk, and how: as torch's ring (SDPA, or attention
written out that is exactly SDPA's), with their keys and values gathered (scores no ring computes, SDPA given a
mask that is not causal), or named as what stops context parallelism. Part of :mod:`autotp.analysis.context`;
read-only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import sympy
import torch
import torch.fx as fx

from autotp.analysis.keyed_attention import Keyed, keyed_attention, keyed_sdpa, seq_dims as _seq_dims
from autotp.analysis.matmuls import where
from autotp.analysis.op_rules import op_rule
from autotp.analysis.ops import arg_named
from autotp.analysis.written_attention import Written, mask_is_causal, written_attention


@dataclass(frozen=True)
class Site:
    """One fact about one node: its name, where the model made it (op, module, line) and what it is."""

    node: str
    where: str
    detail: str = ""


@dataclass(frozen=True)
class Attention:
    """An attention run as ring attention: an SDPA call, or one written out (``written``: its q, k, v and the
    chain the ring replaces). ``causal``: is_causal, or a mask proven causal."""

    node: str  # its output: the SDPA call, or the written-out ·v matmul
    where: str
    causal: bool
    scale: float | None
    written: Written | None = None
    keyed: Keyed | None = None  # written out with scores no ring computes: its keys and values gathered

    @property
    def detail(self) -> str:
        return "keys gathered" if self.keyed else "causal" if self.causal else "full"


class Attentions(NamedTuple):
    found: dict[str, Attention]  # the attentions over the sequence that run as rings, by output node
    blockers: list[Site]  # among the others
    inside: set[str]  # nodes the rest of the analysis skips (attentions and their chains, checked here)
    dropped: set[str]  # gone with the rewrite: written-out chains, and masks only the rings read


def attentions(gm: fx.GraphModule, s: sympy.Symbol, inputs: set[str]) -> Attentions:
    """Every attention over the sequence: run as a ring, with its keys gathered, or a blocker (see
    :class:`Attentions`)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    found: dict[str, Attention] = {}
    blockers, inside, masks = [], set(), []
    for w in written_attention(gm):
        if _seq_dims(nodes[w.q], s) != [2] or _seq_dims(nodes[w.k], s) != [2]:
            continue  # not over this sequence (attention across heads or features)
        scores = nodes[w.chain[1]]
        reason = mask_is_causal(gm, w.mask, w.how, s) if w.mask is not None else ""
        if reason and keyed_attention(nodes[w.out], s, inputs)[0] is not None:
            continue  # not SDPA's mask, yet each query row alone: its keys gathered (below)
        inside.update(w.chain)
        if reason:  # named once, where the scores are made
            blockers.append(Site(scores.name, where(scores), f"a hand-written attention: {reason}"))
            continue
        found[w.out] = Attention(w.out, where(scores), w.mask is not None, w.scale, w)
        masks += [nodes[w.mask]] if w.mask is not None else []
    keyed: list[Keyed] = []
    for node in gm.graph.nodes:  # the others: scores that are not SDPA's, each query row on its own
        if node.name in found or node.name in inside:
            continue
        k, why = keyed_attention(node, s, inputs)
        if k is not None:
            keyed.append(k)
        elif why:  # an attention's ·v matmul: named once, where its scores are made
            blockers.append(Site(node.name, where(node), f"a hand-written attention: {why}"))
            inside.update(_scores_of(node, s))
    for node in gm.graph.nodes:
        if node.op != "call_function" or op_rule(node.target) is None or op_rule(node.target).kind != "sdpa" \
                or 2 not in _seq_dims(node.args[0], s):
            continue
        inside.add(node.name)
        mask = arg_named(node, "attn_mask")
        if arg_named(node, "dropout_p", 0.0):
            blockers.append(Site(node.name, where(node), "attention dropout: not run as ring attention"))
            continue
        causal = bool(arg_named(node, "is_causal", False))
        if isinstance(mask, fx.Node):  # a mask made from positions (Hugging Face's): causal, or refused
            reason = mask_is_causal(gm, mask.name, "keep" if mask.meta["val"].dtype == torch.bool else "add", s)
            if reason and not causal and (k := keyed_sdpa(node, mask, s, inputs)) is not None:
                keyed.append(k)  # a padding mask, a window: K and V gathered, the mask's rows
                continue
            if reason:
                blockers.append(Site(node.name, where(node), f"attention with an explicit mask: {reason}"))
                continue
            causal = True
            masks.append(mask)
        found[node.name] = Attention(node.name, where(node), causal, arg_named(node, "scale"))
    while True:  # a mask or bias made once for several layers (Hugging Face's) is theirs if only they read it
        region = {nodes[n] for k in keyed for n in (*k.region, k.scores)}
        shared = [k for k in keyed if any(u not in region for r, _ in k.rows for u in nodes[r].users)]
        if not shared:
            break
        for k in shared:
            keyed.remove(k)
            blockers.append(Site(k.out, where(nodes[k.scores]), "a hand-written attention: a mask or bias its "
                                                                 "scores read is also read outside the attention"))
            if k.region != (k.out,):  # written out: its (s, s) values skipped, named once here
                inside.update(_scores_of(nodes[k.out], s))
    for k in keyed:
        found[k.out] = Attention(k.out, where(nodes[k.scores]), False, None, keyed=k)
        inside.update(k.region + (k.scores,))
    # what only their scores read (masks, biases from positions or the whole inputs): computed whole by the
    # rewrite's copies, the originals dropped
    computed = _only_read_by([nodes[r] for k in keyed for r, _ in k.rows],
                             {nodes[n] for k in keyed for n in (*k.region, k.scores, k.out)})
    rings = {nodes[a.node] for a in found.values() if not a.keyed} | {
        nodes[c] for a in found.values() if a.written for c in a.written.chain}
    dropped = _only_read_by(masks, rings) | computed
    chains = {c for a in found.values() if a.written for c in a.written.chain}
    return Attentions(found, blockers, inside | dropped, dropped | chains)


def _scores_of(out: fx.Node, s: sympy.Symbol) -> set[str]:
    """The (.., s, s) values an attention's ·v matmul reads, up to its scores: skipped by the rest of the
    analysis once the attention is named."""
    seen, todo = set(), [out.args[0]]
    while todo:
        n = todo.pop()
        if isinstance(n, fx.Node) and n.name not in seen and len(_seq_dims(n, s)) > 1:
            seen.add(n.name)
            todo += n.all_input_nodes
    return seen


def _only_read_by(roots: list[fx.Node], readers: set[fx.Node]) -> set[str]:
    """The nodes among ``roots`` and their inputs whose values only ``readers`` read (directly or through
    one another); never the graph's inputs or the model's tensors."""
    if not roots:
        return set()
    order = {n: i for i, n in enumerate(roots[0].graph.nodes)}
    seen: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    out: set[fx.Node] = set()
    for n in sorted(seen, key=order.__getitem__, reverse=True):  # latest first: its readers are decided
        if n.op == "call_function" and n.users and all(u in readers or u in out for u in n.users):
            out.add(n)
    return {n.name for n in out}
