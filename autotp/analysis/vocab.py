"""Find the vocab-parallel parts of a graph: token embeddings, LM heads, their losses and returned logits.

- A *token embedding* is ``aten.embedding(W, ids)`` with W a parameter and ids computed from the call's
  inputs (position embeddings index an ``arange`` and stay replicated).
- An *LM head* is a parameter matmul outside every column→row pair whose output, propagated as a
  vocab-sharded value, ends only in cross-entropy losses (``cross_entropy``, ``log_softmax`` + ``nll_loss``)
  or in the graph's outputs. Anything else that reads the logits (an argmax, a sampling step) keeps the
  head replicated, with the reason.
- A weight used by an embedding and a head (tied, found by identity) gets one ``VocabRows`` for both.
- A head padded past the vocabulary and cropped in the model (``lm_head(x)[..., :vocab_size]``, ``narrow``)
  keeps all its rows vocab-parallel: the crop is the vocab padding already there, so it becomes the identity on
  each rank's logits and the rows record the classes (``VocabRows.classes``) that the loss and the
  returned logits keep.
- An unpaired matmul that is not an LM head is reported as what its dataflow says it is: a gate (a few
  features read by sigmoid, softmax or a multiply), a router (read by topk), else a linear outside every pair.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from autotp.errors import ShardingError
from autotp.analysis.pairs import Analysis
from autotp.analysis.chosen import indexer_reason
from autotp.analysis.matmuls import ParamMatmul, module_path, where
from autotp.analysis.op_rules import OpRule, kind_of, op_rule
from autotp.analysis.ops import Unshardable, arg_of, from_inputs, ndim_of, slice_range, unread
from autotp.analysis.propagate import Propagator
from autotp.analysis.pair_region import ParamCut
from autotp.analysis.shapes import Fingerprinter, is_static, normalize_dim
from autotp.shard_spec import Segment, Sharding, VocabRows

aten = torch.ops.aten

# what log-probabilities may pass through on their way to nll_loss: layout ops, casts and copies
_LAYOUT_KINDS = frozenset({"view", "same_shape", "flatten", "slice", "move"})


def _is_log_softmax(target: object) -> bool:
    rule = op_rule(target)
    return rule is not None and rule.kind == "softmax" and rule.log


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
    rows: VocabRows  # the vocabulary's rows per rank
    losses: list[LossFact] = field(default_factory=list)
    outputs: list[tuple[fx.Node, int]] = field(default_factory=list)  # returned node, vocab dim
    specs: dict[fx.Node, Sharding] = field(default_factory=dict)
    rewrites: list = field(default_factory=list)
    params: list[ParamCut] = field(default_factory=list)  # parameters cut along the vocab with the logits


@dataclass
class VocabFacts:
    embeddings: list[tuple[fx.Node, str, VocabRows]] = field(default_factory=list)  # node, weight, rows per rank
    heads: list[HeadFact] = field(default_factory=list)


class _VocabPropagator:
    """Propagation of a head's vocab-sharded logits, whose sharded values may end in losses and outputs
    instead of a row matmul: the loss and crop kinds are handled here, every other op by the tensor-parallel
    :class:`~autotp.analysis.propagate.Propagator` it wraps."""

    def __init__(self, fp: Fingerprinter, tp: int, where: str):
        self.prop = Propagator(fp, tp, where)
        self.fp, self.region, self.spec = fp, self.prop.region, self.prop.spec
        self.logprobs: set[fx.Node] = set()
        self.losses: list[LossFact] = []
        self.crop: fx.Node | None = None  # the slice that crops a padded head to its classes
        self.classes: int | None = None
        self.cropped: set[fx.Node] = set()  # the crop and every value computed from it

    def visit(self, node: fx.Node) -> None:
        after_crop = any(a in self.cropped for a in node.all_input_nodes)
        self._read(node)
        if after_crop or node is self.crop:
            self.cropped.add(node)

    def _read(self, node: fx.Node) -> None:
        rule = op_rule(node.target)
        on = getattr(self, f"_on_{rule.kind}", None) if rule is not None else None
        if on is not None and on(node, rule):
            return
        if any(a in self.logprobs for a in node.all_input_nodes):
            if rule is None or rule.kind not in _LAYOUT_KINDS:
                raise Unshardable(node, "log-probabilities over the sharded vocab used outside nll_loss")
            self.prop.visit(node)
            self.logprobs.add(node)
            return
        self.prop.visit(node)

    # -- one handler per kind: True when the node is handled ----------------------------------------
    def _on_slice(self, node: fx.Node, rule: OpRule) -> bool:
        src = node.args[0]
        s = self.spec(src)
        if s is None or normalize_dim(arg_of(node, 1, "dim", 0), ndim_of(src)) != s.dim:
            return False
        if src in self.logprobs:
            raise Unshardable(node, "log-probabilities cut along the vocab dim: the rows cut off took part "
                                    "in the softmax, so they are not padding")
        self.region.specs[node] = self._crop(node, s)
        return True

    def _on_narrow(self, node: fx.Node, rule: OpRule) -> bool:
        """Along the vocab dim a crop, as a slice; along another dim the sharding is unchanged."""
        if self._on_slice(node, rule):
            return True
        s = self.spec(node.args[0])
        if s is not None:
            self.region.specs[node] = s
        return s is not None

    def _on_cross_entropy(self, node: fx.Node, rule: OpRule) -> bool:
        """torch's losses take the classes on dim 1: (n, V), or (b, V, s, ...) for N-d targets."""
        src = node.args[0]
        s = self.spec(src)
        if s is None or ndim_of(src) < 2 or s.dim != 1 or arg_of(node, 2, "weight") is not None:
            raise Unshardable(node, "cross-entropy is not over logits sharded on the class dim (dim 1), or is weighted")
        self.losses.append(LossFact(node, src, None, arg_of(node, 3, "reduction", 1),
                                    arg_of(node, 4, "ignore_index", -100), arg_of(node, 5, "label_smoothing", 0.0)))
        return True

    def _on_nll_loss(self, node: fx.Node, rule: OpRule) -> bool:
        src = node.args[0]
        s = self.spec(src)
        origin = self._log_softmax_of(src)
        if s is None or origin is None or ndim_of(src) < 2 or s.dim != 1 or arg_of(node, 2, "weight") is not None:
            raise Unshardable(node, "nll_loss not over a log_softmax of the logits sharded on the class dim (dim 1)")
        self.losses.append(LossFact(node, origin.args[0], origin, arg_of(node, 3, "reduction", 1),
                                    arg_of(node, 4, "ignore_index", -100), 0.0))
        return True

    def _on_softmax(self, node: fx.Node, rule: OpRule) -> bool:
        """A log_softmax over the vocab dim gives log-probabilities, read only by nll_loss (through layout ops)."""
        s = self.spec(node.args[0])
        if not rule.log or normalize_dim(node.args[1], ndim_of(node)) != s.dim:
            return False
        self.logprobs.add(node)
        self.region.specs[node] = s
        return True

    def _crop(self, node: fx.Node, s: Sharding) -> Sharding:
        """``logits[..., :V]`` / ``logits.narrow(-1, 0, V)`` of the (padded) vocab dim: the rows past V are
        vocab padding, so the crop is the identity on each rank's ``local`` columns (its end is rewritten to
        ``local``) and V is recorded as the classes. Before any softmax: the crop decides what is normalised."""
        full = self.fp.shape(node.args[0])[s.dim]
        if kind_of(node.target) == "narrow":
            start, length = node.args[2], node.args[3]
            if not (is_static(start) and is_static(length)):
                raise Unshardable(node, "the vocab dim is narrowed to a size known only at run time")
            start = start + full if start < 0 else start
            r, old = (start, start + length), length
        else:
            r, old = slice_range(node, full), arg_of(node, 3, "end", None)
            if r is None:
                raise Unshardable(node, "the vocab dim is sliced with a step or at a size known only at run time")
        if r == (0, full):
            return s
        if r[0] != 0 or r[1] <= 0:
            raise Unshardable(node, f"the logits keep classes [{r[0]}, {r[1]}) of {full}: only a crop to the first "
                                    "classes ([..., :vocab_size]) folds into the vocab padding")
        if self.classes is not None and self.classes != r[1]:
            raise Unshardable(node, f"the logits are cropped to {r[1]} classes here and to {self.classes} at "
                                    f"{self.crop.name}")
        if len(node.args) < 4:  # the end (slice) or length (narrow) is args[3]
            raise Unshardable(node, "a crop of the vocab dim whose size is not a positional argument")
        self.crop, self.classes = node, r[1]
        self.prop.rewrite(node, 3, None, old, s.local_size)  # [..., :100] -> [..., :64] on 64 local columns
        return s

    def _log_softmax_of(self, node: fx.Node) -> fx.Node | None:
        while node in self.logprobs:
            if _is_log_softmax(node.target):
                return node
            node = node.args[0]
        return None


# what a matmul's output passes through before it is read: layout and casts (logits.float()[..., :V]), and the
# pieces of a split (hyper-connections' pre | post | comb mixing weights, read apart as slices would read them)
_THROUGH_KINDS = _LAYOUT_KINDS | {"narrow", "select", "expand", "getitem", "split"}
# ops that read only their input's shape (``zeros_like(router_logits)``)
_SHAPE_KINDS = frozenset({"no_output", "sym_size", "new_like", "like"})
# what reads a gate's few outputs: an activation (these, or a softmax), a weighting of other values, a choice
_ACTIVATIONS = frozenset({aten.sigmoid.default, aten.tanh.default, aten.silu.default, aten.softplus.default})
_WEIGHINGS = frozenset({aten.mul.Tensor, aten.topk.default})


def _activates(target: object) -> bool:
    return target in _ACTIVATIONS or (kind_of(target) == "softmax" and not _is_log_softmax(target))


def _is_loss(target: object) -> bool:
    return kind_of(target) in ("cross_entropy", "nll_loss") or _is_log_softmax(target)


def _readers(node: fx.Node) -> list[fx.Node]:
    """The first ops that compute with ``node``'s values, looking through views, casts and slices."""
    out, todo, seen = [], [node], set()
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen or kind_of(u.target) in _SHAPE_KINDS:
                continue
            seen.add(u)
            (todo if kind_of(u.target) in _THROUGH_KINDS else out).append(u)
    return out


_MATMULS = frozenset({aten.linear.default, aten.matmul.default, aten.mm.default, aten.bmm.default,
                      aten.addmm.default, aten.baddbmm.default, aten.einsum.default,
                      aten.scaled_dot_product_attention.default})


def _reaches_logits(node: fx.Node, depth: int = 24) -> bool:
    """Does ``node``'s output reach the loss or the graph's output with no other matmul on the way: logits,
    not a projection that attention or another linear reads?"""
    todo, seen = [(node, 0)], set()
    while todo:
        n, d = todo.pop()
        for u in n.users:
            if u in seen or d > depth:
                continue
            seen.add(u)
            if u.op == "output" or _is_loss(u.target):
                return True
            if u.target not in _MATMULS and u.op == "call_function":
                todo.append((u, d + 1))
    return False


def _op_name(n: fx.Node) -> str:
    if n.op == "output":
        return "the graph's output"
    return getattr(n.target, "__name__", str(n.target)).split(".")[0].lstrip("_")


_BY_DESIGN = ("router kept whole", "gate kept whole", "down-projection kept whole", "head transform kept whole",
              "indexer kept whole", "latent kept whole", "input kept whole")
_CHOICES = frozenset({aten.topk.default, aten.sort.default, aten.argmax.default, aten.argsort.default})


def _latent_of(m: ParamMatmul, a, order: dict[fx.Node, int]) -> str | None:
    """The pair whose column matmuls read ``m``'s output through ops of it alone (norms, splits, views; no
    other activation joins in, no other matmul in between), when ``m`` maps to fewer features than it reads: a
    low-rank down-projection (DeepSeek's q_a_proj, kv_a_proj_with_mqa) whose latent every rank computes whole
    for the head-parallel up-projections (or one mapping to as many features or more: a latent wider than the
    model, which its norm reads whole all the same). ``order``: each node's position in the graph."""
    return _read_alone_by(m, {c.node: p.name for p in a.pairs for c in p.columns}, a, order)


def _read_alone_by(m: ParamMatmul, readers: dict[fx.Node, str], a, order: dict[fx.Node, int]) -> str | None:
    """The name ``readers`` gives the first of its matmuls that reads ``m``'s output through ops of it alone
    (activations, norms, splits, views, with parameters but no other activation joining in, no other matmul in
    between); None when none does."""
    matmuls = {x.node for x in a.matmuls}
    mine = {m.node}
    todo = [(order[u], u) for u in m.node.users]
    heapq.heapify(todo)
    seen: set[fx.Node] = set()
    while todo:  # in graph order, so that every input derived from m is decided before its readers
        _, n = heapq.heappop(todo)
        if n in seen:
            continue
        seen.add(n)
        if n in readers:
            return readers[n]
        val = n.meta.get("val")
        val = val[0] if isinstance(val, (tuple, list)) and val else val  # a split's pieces
        if n in matmuls or not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
            continue  # a choice (topk's indices) reaches the experts as indices, not as their input
        if all(x in mine or not from_inputs(x) for x in n.all_input_nodes):
            mine.add(n)
            for u in n.users:
                heapq.heappush(todo, (order[u], u))
    return None


def _entering_input(m: ParamMatmul, a) -> str | None:
    """Why ``m`` stays whole when everything computed from its output reaches the pairs only as values their
    regions read whole through f, each rank slicing its own part where they meet the cut values (Gemma's
    per-layer inputs: ``per_layer_model_projection`` h -> L·d_pl, viewed ``(b, s, L, d_pl)``, normed over d_pl,
    added to the per-layer embedding, layer l's ``(b, s, d_pl)`` multiplying its gate's ``(b, s, d_pl/t)``). The
    value is whole on every rank already, and f sums its gradient; None where a path from ``m`` reaches another
    matmul, the loss or the output first."""
    entering = {e.operand: p.name for p in a.pairs for e in p.region.entering}
    matmuls = {x.node for x in a.matmuls}
    found: dict[str, None] = {}
    todo, seen = list(m.node.users), set()
    while todo:
        n = todo.pop()
        if n in seen or kind_of(n.target) in ("no_output", "sym_size"):
            continue
        seen.add(n)
        if n in entering:
            found[entering[n]] = None
            continue
        if n in matmuls or n.op == "output" or _is_loss(n.target):
            return None
        todo.extend(n.users)
    if not found:
        return None
    return (f"input kept whole: its {m.in_features}→{m.out_features} linear computes a value that the regions of "
            f"{', '.join(sorted(found))} read whole through f, each rank its own slice of it: every rank computes "
            f"it whole with no collective of its own, and f sums its gradient (cut, it would be gathered before the "
            f"ops that read all of it)")


def _head_transform(m: ParamMatmul, heads: list[HeadFact], a, order: dict[fx.Node, int]) -> str | None:
    """Why ``m`` stays whole when it computes, through ops of its output alone (an activation, a norm), the
    input of a vocab-parallel LM head: the dense + norm transform of a masked-LM-style head (BERT's). The norm
    reads all its features, so a cut ``m`` would need a gather (or the norm's statistics summed) before the head;
    every rank computes it whole, as Megatron-LM's BERT head does, and the head is cut by the vocab."""
    if m.out_features != m.in_features:
        return None
    head = _read_alone_by(m, {h.matmul.node: h.matmul.weight for h in heads}, a, order)
    if head is None:
        return None
    shape = f"{m.in_features}→{m.out_features}"
    return (f"head transform kept whole: its {shape} linear computes the input of the vocab-parallel LM head "
            f"{head} through ops of its output alone (an activation, a norm over all {m.out_features} features); "
            f"every rank computes it whole (cutting it would add a gather before the norm), and the head is cut "
            f"by the vocab")


def _chooses(node: fx.Node, depth: int = 8) -> bool:
    """Is what ``node`` computes chosen among by topk (or sort, argmax) within a few ops: a router's scores?"""
    todo, seen = [(node, 0)], set()
    while todo:
        n, d = todo.pop()
        if n in seen or d > depth:
            continue
        seen.add(n)
        if n.target in _CHOICES:
            return True
        todo.extend((u, d + 1) for u in n.users)
    return False


def _past_constant_divisions(readers: list[fx.Node]) -> list[fx.Node]:
    """``readers`` with each division by a Python number (scores scaled by ``1 / sqrt(h)``) replaced by what
    reads its quotient: such a division is the multiply a gate's scores may pass through."""
    out, todo = [], list(readers)
    while todo:
        u = todo.pop()
        if u.target is aten.div.Tensor and isinstance(u.args[1], (int, float)):
            todo += _readers(u)
        else:
            out.append(u)
    return out


def _kept_whole(m: ParamMatmul, why: str, latent_of: str | None = None) -> str:
    """Why an unpaired matmul that could not be made vocab-parallel stays whole, named by what it is: its
    dataflow and shapes decide (a loss or the output reads an LM head; a gate maps to fewer features than it
    reads, and they are read by an activation, a multiply or topk, past a division by a constant; a router's are
    chosen among by topk)."""
    readers = _past_constant_divisions(_readers(m.node))
    shape = f"{m.in_features}→{m.out_features}"
    if any(u.op == "output" or _is_loss(u.target) for u in readers):
        return f"LM head kept whole: {why}"
    if latent_of is not None and not _chooses(m.node) and m.out_features < m.in_features:
        return (f"down-projection kept whole: its {shape} linear computes the latent that the column matmuls of "
                f"{latent_of} read; every rank computes it whole (cutting it would add an all-reduce of the "
                f"latent), and its weight is small")
    if latent_of is not None and not _chooses(m.node):
        # as wide as its input or wider (Dots3-Note's sliding layers: a 1024-feature latent of a 5120 model,
        # wider than a small model's width): the up-projections need it whole all the same
        return (f"latent kept whole: its {shape} linear computes the latent that the column matmuls of {latent_of} "
                f"read whole, through ops of it alone; every rank computes it whole (cutting it would add a gather "
                f"of its {m.out_features} features before them)")
    gated = all(_activates(u.target) or u.target in _WEIGHINGS for u in readers)
    # or chosen among within a few ops whatever reads it first: a router whose topk reads its logits plus a
    # balancing bias and whose weights are its logits gathered at the choice (``gather(logits, topk(logits + b))``)
    if m.out_features < m.in_features and readers and (gated or _chooses(m.node)):
        then = [v for u in readers if _activates(u.target) for v in _readers(u)]  # sigmoid -> mul, softmax -> topk
        reads = " then ".join(", ".join(sorted({_op_name(u) for u in us})) for us in (readers, then) if us)
        if any(u.target is aten.topk.default for u in [*readers, *then]) or _chooses(m.node):
            return (f"router kept whole: its {shape} linear is read by {reads}, which chooses among all "
                    f"{m.out_features} of its outputs on every rank; cutting them would only add a gather, and "
                    f"its weight is small")
        feats = f"{m.out_features} feature{'s' if m.out_features > 1 else ''}"
        return (f"gate kept whole: its {shape} linear is read by {reads}, which weights replicated activations "
                f"with its whole output ({feats}) on every rank; cutting it would only add a gather, and its weight "
                f"is small")
    if m.out_features >= m.in_features and _reaches_logits(m.node):
        return f"LM head kept whole: {why}"
    reads = ", ".join(sorted({_op_name(u) for u in readers})) or "nothing"
    if m.out_features >= m.in_features:  # a projection inside a block that the rules left out of every pair
        return f"linear kept whole: its {shape} linear is outside every column→row pair: {why}"
    return (f"linear kept whole: its {shape} linear is outside every column→row pair and is not an LM head "
            f"(its output is read by {reads})")


def _check_vocab_param(cut: ParamCut, p: _VocabPropagator, rows: VocabRows) -> None:
    """A parameter the logits meet along their vocab dim (a learned scale per vocab entry multiplied into them,
    Dory's ``logits * (logit_scale.float() * c)``, logit_scale ``(V,)``) is cut along the vocab like the head's
    rows: each rank's slice meets its own logits, so forward and backward stay local (the gradient of entry v
    comes from column v of the logits alone). Unshardable when it is a buffer, spans another size, or is also read
    where the logits are not (that read would see a shard)."""
    x = cut.node
    gm = x.graph.owning_module
    params = dict(gm.named_parameters(remove_duplicate=False))
    if x.op != "get_attr" or x.target not in params or params[x.target].shape[cut.dim] != rows.size:
        raise Unshardable(x, f"{x.name} spans the vocab dim of the logits")
    same = {n for n in x.graph.nodes if n.op == "get_attr" and params.get(n.target) is params[x.target]}
    stray = [u for n in same for u in n.users
             if u not in p.region.specs and kind_of(u.target) not in ("no_output", "sym_size")]
    if stray or same != {x}:
        at = stray[0] if stray else next(iter(same - {x}))
        raise Unshardable(at, f"{x.target} spans the vocab dim of the logits and is also read by {at.name}, "
                              "where the logits are not: cut with them, that read would see a shard")


def _propagate_head(m: ParamMatmul, rows: VocabRows, fp: Fingerprinter, tp: int) -> HeadFact:
    p = _VocabPropagator(fp, tp, m.module)
    spec = Sharding(ndim_of(m.node) - 1, (Segment(rows.padded(tp), tp),))
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
    p.prop.check_functions()
    # replicated operands spanning the vocab: not planned for heads
    if p.region.slices:
        x = p.region.slices[0]
        raise Unshardable(x.consumer, f"{x.operand.name} spans the vocab dim of the logits")
    for cut in p.region.params:
        _check_vocab_param(cut, p, rows)
    if p.region.entering:  # a learned temperature (1,) dividing the logits: no f is planned for a head's operands
        at, x = p.region.entering[0]
        raise Unshardable(at, f"{x.name}, learned and whole on every rank, meets the vocab-sharded logits: each "
                              "rank's gradient of it would cover only its own vocab slice")
    if p.classes is not None:
        rows = replace(rows, classes=p.classes)
    head = HeadFact(m, rows, p.losses, specs={n: s for n, s in p.region.specs.items() if isinstance(s, Sharding)},
                    rewrites=p.region.rewrites, params=list(p.region.params))
    loss_nodes = {x.node for x in p.losses}
    for n, s in p.region.specs.items():
        for u in n.users:
            if u in p.region.specs or u in loss_nodes or kind_of(u.target) in ("no_output", "sym_size"):
                continue
            if u is output and n not in p.logprobs and isinstance(s, Sharding):
                head.outputs.append((n, s.dim))
                continue
            if kind_of(u.target) == "getitem":
                continue
            raise Unshardable(u, f"the logits {n.name} are read by {u.target}")
    if p.crop is not None:  # every loss and returned value must see the classes only, as the crop gives them
        whole = [(x.node, f"the loss {x.node.name} reads") for x in p.losses if x.logits not in p.cropped] + \
                [(n, f"the graph returns {n.name} with") for n, _ in head.outputs if n not in p.cropped]
        if whole:
            raise Unshardable(whole[0][0], f"the logits are cropped to {p.classes} classes at {p.crop.name}, but "
                                           f"{whole[0][1]} all {rows.size} rows")
    return head


def analyze_vocab(gm: fx.GraphModule, a: Analysis, tp: int, multiple: int = 1) -> VocabFacts:
    """Vocab-parallel embeddings and heads of ``gm``; what cannot be sharded is added to ``a.replicated``."""
    facts = VocabFacts()
    if tp == 1:
        return facts
    fp = Fingerprinter(gm)
    # a mixer's reducing projections are row-parallel inside their pair's region
    paired = {m.node for p in a.pairs for m in [*p.columns, p.row, *p.sides, *p.reduces]}
    params = dict(gm.named_parameters(remove_duplicate=False))
    uses: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:  # a read no value depends on (a tied table's pad row put where no one reads it,
        # Gemma 4's) sees this rank's rows harmlessly: it does not count as a use
        if node.op == "get_attr" and node.target in params:
            uses.setdefault(node.target, []).extend(u for u in node.users if not unread(u))
    rows_of: dict[str, VocabRows] = {}  # weight -> its rows per rank, one for a tied embedding and head
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    unheaded: list[tuple[ParamMatmul, str]] = []  # unpaired matmuls that are no LM head, and why
    for m in a.matmuls:
        if m.node in paired or m.in_axis is not None:  # an expert's 3-D weight is no LM head
            continue
        why = indexer_reason(m)
        if why is not None:  # its output only chooses (a sparse-attention indexer): whole by design, no head
            a.by_design.append((m.module, why))
            continue
        rows = VocabRows.make(m.out_features, tp, multiple)
        try:
            head = _propagate_head(m, rows, fp, tp)
        except (Unshardable, ShardingError) as e:
            unheaded.append((m, f"{e.reason} (at {where(e.node)})" if isinstance(e, Unshardable) else str(e)))
            continue
        if not head.losses and not head.outputs:
            continue
        others = [u for u in uses[m.weight] if u is not m.node and u not in m.chain
                  and u.target not in (aten.embedding.default, aten._assert_tensor_metadata.default)]
        if others:
            a.replicated.append((m.module, f"LM head kept whole: its weight is also used by {others[0].name}"))
            continue
        facts.heads.append(head)
        rows_of[m.weight] = rows
    head_nodes = {h.matmul.node for h in facts.heads}
    # named once the heads are known: a head's dense + norm transform is whole by design
    named = [(m, _head_transform(m, facts.heads, a, order) or _entering_input(m, a)
              or _kept_whole(m, why, _latent_of(m, a, order)))
             for m, why in unheaded]
    # a failed pair whose row is an LM head after all (a gate of the last block tried as its column, BERT's
    # dense tried as the column of its decoder), or is a latent whose up-projections, paired, read it whole, or a
    # router or a gate (tried as the row of a hyper-connection's mixing linear: HY-V4's attn_hc.fn -> q_a_proj,
    # ffn_hc.fn -> mlp.gate; DeepSeek-V4's hash-routed layer, whose gate is read by softplus and chooses nothing):
    # its columns are named each on their own below
    latents = {m.node for m, why in named
               if why.startswith(("down-projection kept whole", "latent kept whole", "router kept whole",
                                  "gate kept whole"))}
    a.replicated[:] = [e for e in a.replicated if a.failed_rows.get(e) not in head_nodes | latents]
    blocks = [r for r, _ in a.replicated]
    for m, why in named:
        if any(m.module == r or m.module.startswith(r + ".") for r in blocks):
            continue  # a projection of a block reported replicated is not an LM head: its reason stands
        (a.by_design if why.startswith(_BY_DESIGN) else a.replicated).append((m.module, why))
    head_chains = {n for h in facts.heads for n in h.matmul.chain}
    for node in gm.graph.nodes:
        if node.target is not aten.embedding.default or not isinstance(node.args[0], fx.Node):
            continue
        w = node.args[0].target
        if node in paired or w not in params or params[w].dim() != 2 or not from_inputs(node.args[1]):
            continue
        others = [u for u in uses[w] if u.target not in (aten.embedding.default, aten._assert_tensor_metadata.default)
                  and u not in head_nodes and u not in head_chains]
        if others:
            a.replicated.append((module_path(node) or w,
                                 f"embedding kept whole: its weight is also used by {others[0].name}"))
            continue
        rows = rows_of.setdefault(w, VocabRows.make(params[w].shape[0], tp, multiple))
        facts.embeddings.append((node, w, rows))
    return facts
