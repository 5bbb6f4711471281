"""Find the vocab-parallel parts of a graph: token embeddings, LM heads, their losses and returned logits.

- A *token embedding* is ``aten.embedding(W, ids)`` with W a parameter and ids computed from the call's
  inputs (position embeddings index an ``arange`` and stay replicated).
- An *LM head* is a parameter matmul outside every column→row pair whose output, propagated as a
  vocab-sharded value, ends only in cross-entropy losses (``cross_entropy``, ``log_softmax`` + ``nll_loss``)
  or in the graph's outputs. Anything else that reads the logits (an argmax, a sampling step) keeps the
  head replicated, with the reason.
- A weight used by an embedding and a head (tied, found by identity) gets one layout for both.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autotp.errors import ShardingError
from autotp.analysis.pairs import Analysis
from autotp.analysis.matmuls import ParamMatmul, module_path
from autotp.analysis.ops import SAME_SHAPE, VIEWS, Unshardable, arg_of, ndim_of
from autotp.analysis.propagate import _Propagator
from autotp.analysis.shapes import Fingerprinter, normalize_dim
from autotp.plan.shard_spec import Segment, Sharding, VocabLayout

aten = torch.ops.aten

_LAYOUT_OPS = VIEWS | SAME_SHAPE | {aten.flatten.using_ints, aten.slice.Tensor, aten.transpose.int,
                                      aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim}
_NLL = {aten.nll_loss_nd.default, aten.nll_loss.default}


@dataclass
class LossFact:
    node: fx.Node
    logits: fx.Node
    log_softmax: fx.Node | None
    reduction: int
    ignore_index: int
    label_smoothing: float


@dataclass
class HeadFact:
    matmul: ParamMatmul
    layout: VocabLayout
    losses: list[LossFact] = field(default_factory=list)
    outputs: list[tuple[fx.Node, int]] = field(default_factory=list)  # returned node, vocab dim
    specs: dict[fx.Node, Sharding] = field(default_factory=dict)
    rewrites: list = field(default_factory=list)


@dataclass
class VocabFacts:
    embeddings: list[tuple[fx.Node, str, VocabLayout]] = field(default_factory=list)  # node, weight, layout
    heads: list[HeadFact] = field(default_factory=list)


class _VocabPropagator(_Propagator):
    """Propagation whose sharded values may end in losses and outputs instead of a row matmul."""

    def __init__(self, fp: Fingerprinter, tp: int, where: str):
        super().__init__(fp, tp, where)
        self.logprobs: set[fx.Node] = set()
        self.losses: list[LossFact] = []

    def visit(self, node: fx.Node) -> None:
        t = node.target
        src = node.args[0] if node.args else None
        if t is aten.cross_entropy_loss.default:
            s = self.spec(src)
            if s is None or ndim_of(src) != 2 or s.dim != 1 or arg_of(node, 2, "weight") is not None:
                raise Unshardable(node, "cross-entropy is not over 2-D logits sharded on the class dim, or is weighted")
            self.losses.append(LossFact(node, src, None, arg_of(node, 3, "reduction", 1),
                                        arg_of(node, 4, "ignore_index", -100), arg_of(node, 5, "label_smoothing", 0.0)))
            return
        if t in _NLL:
            s = self.spec(src)
            origin = self._log_softmax_of(src)
            if s is None or origin is None or ndim_of(src) != 2 or s.dim != 1 or arg_of(node, 2, "weight") is not None:
                raise Unshardable(node, "nll_loss not over a log_softmax of the sharded logits")
            self.losses.append(LossFact(node, origin.args[0], origin, arg_of(node, 3, "reduction", 1),
                                        arg_of(node, 4, "ignore_index", -100), 0.0))
            return
        if t in (aten.log_softmax.int, aten._log_softmax.default):
            s = self.spec(src)
            if normalize_dim(node.args[1], ndim_of(node)) == s.dim:
                self.logprobs.add(node)
                self.region.specs[node] = s
                return
        if any(a in self.logprobs for a in node.all_input_nodes):
            if t not in _LAYOUT_OPS:
                raise Unshardable(node, "log-probabilities over the sharded vocab used outside nll_loss")
            super().visit(node)
            self.logprobs.add(node)
            return
        super().visit(node)

    def _log_softmax_of(self, node: fx.Node) -> fx.Node | None:
        while node in self.logprobs:
            if node.target in (aten.log_softmax.int, aten._log_softmax.default):
                return node
            node = node.args[0]
        return None


def _from_data(ids: fx.Node) -> bool:
    """Do the ids come from the call's inputs (token ids), not only from shapes (positions)?"""
    seen, stack = set(), [ids]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return True
        if n.target is aten.sym_size.int:
            continue
        stack.extend(n.all_input_nodes)
    return False


def _propagate_head(m: ParamMatmul, layout: VocabLayout, fp: Fingerprinter, tp: int) -> HeadFact:
    p = _VocabPropagator(fp, tp, m.module)
    spec = Sharding(ndim_of(m.node) - 1, (Segment(layout.padded(tp), tp),))
    p.region.specs[m.node] = spec
    started = False
    output = None
    for node in m.node.graph.nodes:
        if node is m.node:
            started = True
            continue
        if not started:
            continue
        if node.op == "output":
            output = node
            continue
        if node.op == "call_function" and any(a in p.region.specs for a in node.all_input_nodes):
            p.visit(node)
    head = HeadFact(m, layout, p.losses, specs={n: s for n, s in p.region.specs.items() if isinstance(s, Sharding)},
                    rewrites=p.region.rewrites)
    loss_nodes = {x.node for x in p.losses}
    for n, s in p.region.specs.items():
        for u in n.users:
            if u in p.region.specs or u in loss_nodes or u.target in (aten._assert_tensor_metadata.default,
                                                                       aten.sym_size.int):
                continue
            if u is output and n not in p.logprobs and isinstance(s, Sharding):
                head.outputs.append((n, s.dim))
                continue
            if u.target is operator.getitem:
                continue
            raise Unshardable(u, f"the logits {n.name} are read by {u.target}")
    return head


def analyze_vocab(gm: fx.GraphModule, a: Analysis, tp: int, multiple: int = 1) -> VocabFacts:
    """Vocab-parallel embeddings and heads of ``gm``; what cannot be sharded is added to ``a.replicated``."""
    facts = VocabFacts()
    if tp == 1:
        return facts
    fp = Fingerprinter()
    paired = {m.node for p in a.pairs for m in [*p.columns, p.row]}
    params = dict(gm.named_parameters(remove_duplicate=False))
    uses: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in params:
            uses.setdefault(node.target, []).extend(node.users)
    layouts: dict[str, VocabLayout] = {}
    for m in a.matmuls:
        if m.node in paired:
            continue
        layout = VocabLayout.make(m.out_features, tp, multiple)
        try:
            head = _propagate_head(m, layout, fp, tp)
        except (Unshardable, ShardingError) as e:
            # a projection of a block already reported replicated is not an LM head: its reason stands
            if not any(m.module == r or m.module.startswith(r + ".") for r, _ in a.replicated):
                why = f"{e.reason} (at {e.node.name})" if isinstance(e, Unshardable) else str(e)
                a.replicated.append((m.module, f"LM head kept whole: {why}"))
            continue
        if not head.losses and not head.outputs:
            continue
        others = [u for u in uses[m.weight] if u is not m.node and u.target is not aten.embedding.default]
        if others:
            a.replicated.append((m.module, f"LM head kept whole: its weight is also used by {others[0].name}"))
            continue
        facts.heads.append(head)
        layouts[m.weight] = layout
    head_nodes = {h.matmul.node for h in facts.heads}
    for node in gm.graph.nodes:
        if node.target is not aten.embedding.default or not isinstance(node.args[0], fx.Node):
            continue
        w = node.args[0].target
        if w not in params or params[w].dim() != 2 or not _from_data(node.args[1]):
            continue
        others = [u for u in uses[w] if u.target is not aten.embedding.default and u not in head_nodes]
        if others:
            a.replicated.append((module_path(node) or w,
                                 f"embedding kept whole: its weight is also used by {others[0].name}"))
            continue
        layout = layouts.setdefault(w, VocabLayout.make(params[w].shape[0], tp, multiple))
        facts.embeddings.append((node, w, layout))
    return facts
