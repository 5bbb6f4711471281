"""Context parallelism: can a captured forward run on 1/cp of its sequence, and what must change where.

With context parallelism each rank of a cp group holds a chunk of the sequence (load-balanced, see
:mod:`autotp.operators.ring_attention`). Almost every op of a transformer treats each position alike and
runs on the chunk unchanged; this analysis finds, from the graph's shapes and dataflow alone, the few that
do not:

- the sequence length is the query length of ``scaled_dot_product_attention`` (a size symbol of the
  capture); a value *carries* the sequence where one of its dims is that symbol, or a product with it (the
  ``b·s`` rows of a flattened loss);
- *attention*: each SDPA call, run as ring attention over the cp group (causal or full; a mask only where
  it is proven causal, :func:`~autotp.analysis.written_attention.mask_is_causal`; dropout is refused), and
  each attention written out by hand that is exactly SDPA (:mod:`autotp.analysis.written_attention`); one
  written out with scores no ring computes (a bias of distances, a sliding window, soft-capping) runs as
  written with its keys and values gathered (:mod:`autotp.analysis.keyed_attention`);
- *positions*: an ``arange`` over the sequence length (position embeddings, rotary tables, causal masks
  made from positions): indexed by the chunk's global positions instead. What is computed from them is
  held to the same rules as the tokens' data: on a chunk the positions are not in order, so a running sum
  or a difference along them (a packed-sequence check) would be wrong, and is named;
- *reductions*: a loss (cross-entropy, NLL) or a sum or mean over tokens: completed over the cp group (the
  global mean over every counted token);
- *random*: dropout (or any random op) on a value carrying the sequence: each rank draws its chunk's masks
  from a stream of its own (:mod:`autotp.operators.rng`), not the same masks as every other chunk;
- *blockers*: anything else that reads across positions — a cumulative sum, a shift or a convolution
  along the sequence, an index or slice of positions, a hand-written attention whose scores are read
  elsewhere or mix query rows —
  named with its op, module and source line. For an op without a rule of autotp's own, DTensor's sharding
  rule decides (:func:`~autotp.analysis.torch_rules.ask_torch`): an op torch keeps local on a sequence
  shard is per-token; one torch would gather is a blocker.

Read-only: it reports facts; nothing here rewrites the graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from autotp.analysis.matmuls import where
from autotp.analysis.op_rules import op_rule
from autotp.analysis.ops import arg_named, is_random, reduction_args
from autotp.analysis.torch_rules import TorchRefused, ask_torch
from autotp.analysis.context_attention import Attention, Site, attentions
from autotp.analysis.keyed_attention import seq_dims as _seq_dims, symbols as _symbols

aten = torch.ops.aten

# kinds of autotp's table that treat every position alike along dims they do not name
_PER_TOKEN = frozenset({"pointwise", "same_shape", "view", "flatten", "move", "expand", "expand_as",
                        "complex_view"})
# kinds that make values (sizes, masks) or pick outputs, reading no position's values
_NEUTRAL = frozenset({"getitem", "sym_size", "no_output", "factory", "like", "new_like", "triangle"})
# ops whose every output element is made from one input element (one_hot's classes, repeat_interleave's
# copies, each beside its source), so a chunk's tokens give exactly the chunk's rows, wherever they lie:
# the routing of a mixture of experts (top-k ids one-hot per expert, each token repeated per slot)
_PER_ELEMENT = frozenset({aten.one_hot.default, aten.repeat_interleave.self_int})
# kinds whose named dim (``dim`` argument) must not be the sequence's
_ALONG_DIM = frozenset({"softmax", "split", "slice", "narrow", "select", "cat", "stack"})


@dataclass(frozen=True)
class ContextFacts:
    """What running the forward on a sequence chunk takes (see the module docstring)."""

    length: str  # the sequence length's size symbol in the capture ("s85"); "" when none was found
    inputs: tuple[tuple[str, int], ...]  # placeholders carrying the sequence: (name, their sequence dim)
    attention: tuple[Attention, ...]
    positions: tuple[Site, ...]
    reductions: tuple[Site, ...]
    blockers: tuple[Site, ...]
    outputs: tuple[tuple[int, int], ...] = ()  # outputs carrying the sequence: (output index, sequence dim)
    # what only the attentions run as rings read (written-out scores, masks): gone with the rewrite
    dropped: tuple[str, ...] = ()
    # values cut to the rank's chunk where ops on chunks read them: (node, sequence dim); the inputs, or
    # what ``whole`` computed from them
    chunks: tuple[tuple[str, int], ...] = ()
    whole: tuple[str, ...] = ()  # ops run on the whole inputs, on every rank (a label shift)
    sizes: tuple[str, ...] = ()  # the sequence length read off the whole inputs (sym_size nodes)
    # tables read by position (``cos[:s]`` of a rotary table): (node, dim), the chunk's rows instead
    tables: tuple[tuple[str, int], ...] = ()
    random: tuple[str, ...] = ()  # random ops on values carrying the sequence: a stream per chunk

    @property
    def runs(self) -> bool:
        """Can this forward run context-parallel?"""
        return bool(self.length) and not self.blockers


def sequence_length(gm: fx.GraphModule) -> sympy.Symbol | None:
    """The size symbol of the attention's query length: the first SDPA call's, else the first batched
    matmul's whose result is (.., s, s) (a hand-written attention's scores); None where neither is found."""
    for want in ("sdpa", "matmul"):
        for node in gm.graph.nodes:
            rule = op_rule(node.target) if node.op == "call_function" else None
            val = node.meta.get("val")
            if rule is None or rule.kind not in (want, "baddbmm" if want == "matmul" else want) \
                    or not isinstance(val, torch.Tensor) or val.dim() < 3:
                continue
            rows = val.shape[-2]
            free = _symbols(rows)
            if len(free) == 1 and (want == "sdpa" or _symbols(val.shape[-1]) == free):
                return next(iter(free))
    return None


def find_context(gm: fx.GraphModule, cp: int = 2) -> ContextFacts:
    """The context-parallel facts of a captured forward (dynamic sizes, as autotp captures them)."""
    s = sequence_length(gm)
    if s is None:
        return ContextFacts("", (), (), (), (), (Site("", "", "no attention whose query length varies with the "
                                                          "input was found (a length fixed by the model?)"),))
    attention, positions, reductions, tables, random = [], [], [], [], []
    inputs = [(n.name, _seq_dims(n, s)[0]) for n in gm.graph.find_nodes(op="placeholder") if _seq_dims(n, s)]
    found, blockers, inside, dropped = attentions(gm, s, {name for name, _ in inputs})
    inside |= _whole(gm, _lengths(gm, inputs), dict(inputs), dropped)[0]  # run on the whole inputs: unchecked
    nodes = {n.name: n for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        if node.name in found:
            attention.append(found[node.name])
            keyed = found[node.name].keyed
            for name in keyed.region if keyed else ():  # attention dropout on the chunk's rows: its own stream
                rule = op_rule(nodes[name].target)
                if rule is not None and is_random(nodes[name], rule):
                    random.append(name)
            continue
        if node.op != "call_function" or node.name in inside or \
                op_rule(node.target) is not None and op_rule(node.target).kind == "sym_size":
            continue
        if node.target in (aten.arange.default, aten.arange.start, aten.arange.start_step) and \
                any(s in _symbols(a.meta.get("val")) for a in node.all_input_nodes):
            # one position per token (arange(s), arange(1, s + 1)): the chunk's own are computable
            length = node.meta["val"].shape[0]
            step = arg_named(node, "step", 1) if node.target is aten.arange.start_step else 1
            if isinstance(length, torch.SymInt) and length.node.expr == s and step == 1:
                positions.append(Site(node.name, where(node)))
            else:
                blockers.append(Site(node.name, where(node), f"an arange of {length} values over a sequence "
                                                             f"of {s}: not one position per token"))
            continue
        operands = [a for a in node.all_input_nodes if _seq_dims(a, s)]
        site = Site(node.name, where(node))
        if not operands:  # the sequence's length enters through a size only
            reason = _from_length(node, s, tables) if _seq_dims(node, s) else ""
        else:
            reason = _blocked(node, operands, s, cp, reductions, site)
            if not reason and (rule := op_rule(node.target)) is not None and is_random(node, rule):
                random.append(node.name)
        if reason:
            blockers.append(Site(node.name, site.where, reason))
    for r in reductions:
        _loss_targets(gm, r, inputs, blockers)
    lengths = _lengths(gm, inputs)
    whole, cut = _whole(gm, lengths, dict(inputs), dropped)
    blockers += [Site(n.name, where(n), f"{n.target} on the inputs, where ops on chunks read it: it would run on "
                                        "the chunk") for n in cut if not _per_token(n)]
    chunks = []
    for node in gm.graph.nodes:
        if (node.name in dict(inputs) or node.name in whole) and any(_chunked_reader(u, whole, dropped)
                                                                     for u in node.users):
            chunks.append((node.name, dict(inputs).get(node.name, _own_dim(node, lengths))))
    # the sequence length as read off the whole inputs: ops on chunks read the chunk's
    sizes = tuple(n.name for n in gm.graph.nodes if _is_size(n) and (n.args[0].name in dict(inputs) or
                  n.args[0].name in whole) and isinstance(n.meta.get("val"), torch.SymInt)
                  and n.meta["val"].node.expr in lengths)
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    outputs = tuple((i, _seq_dims(x, s)[0]) for i, x in enumerate(out.args[0]) if _seq_dims(x, s))
    return ContextFacts(str(s), tuple(inputs), tuple(attention), tuple(positions), tuple(reductions),
                        tuple(blockers), outputs, tuple(n.name for n in gm.graph.nodes if n.name in dropped),
                        tuple(chunks), tuple(n.name for n in gm.graph.nodes if n.name in whole), sizes,
                        tuple(tables), tuple(random))


def _is_size(node: fx.Node) -> bool:
    rule = op_rule(node.target) if node.op == "call_function" else None
    return rule is not None and rule.kind == "sym_size"


def _chunked_reader(user: fx.Node, whole: set[str], dropped: set[str]) -> bool:
    """Does ``user`` read its input as this rank's chunk (not a whole-input op, a size, the export's guard,
    or a node the rewrite drops)?"""
    return user.name not in whole and user.name not in dropped and not _is_size(user) and \
        not (user.op == "call_module" and str(user.target).startswith("_guards"))


def _lengths(gm: fx.GraphModule, inputs: list[tuple[str, int]]) -> set:
    """The sequence length as each input's own size expression (the loss's targets may have their own
    symbol, of the same value)."""
    nodes = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    sizes = (nodes[name].meta["val"].shape[dim] for name, dim in inputs)
    return {size.node.expr for size in sizes if isinstance(size, torch.SymInt)}


def _own_dim(node: fx.Node, lengths: set) -> int | None:
    """The one dim of ``node``'s value whose size is the sequence length itself (not a product with it)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    dims = [i for i, size in enumerate(val.shape) if isinstance(size, torch.SymInt) and size.node.expr in lengths]
    return dims[0] if len(dims) == 1 else None


def _per_token(node: fx.Node) -> bool:
    rule = op_rule(node.target) if node.op == "call_function" else None
    return rule is not None and (rule.kind in _PER_TOKEN or rule.kind in _NEUTRAL)


def _whole(gm: fx.GraphModule, lengths: set, placeholders: dict[str, int],
           dropped: set[str]) -> tuple[set[str], list[fx.Node]]:
    """The ops computed from the sequence inputs alone (token ids, labels, masks: no parameter, buffer or
    other tensor), run on the whole inputs on every rank: cheap, and exact whatever they do along the
    sequence (a label shift, a packed-sequence check). Their values are cut to the rank's chunk where an op
    on chunks reads them, at a dim of the sequence's own length; a value with none there (flattened with
    the batch) is computed on the chunk instead, and its inputs cut: those (``cut``) must treat each
    position alike."""
    whole: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or _is_size(node) or node.name in dropped:
            continue
        ins = node.all_input_nodes
        if any(i.name in placeholders or i.name in whole for i in ins) and all(
                i.name in placeholders or i.name in whole or not isinstance(i.meta.get("val"), torch.Tensor)
                for i in ins):
            whole.add(node.name)
    nodes = {n.name: n for n in gm.graph.nodes}
    cut: list[fx.Node] = []
    changed = True
    while changed:
        changed = False
        for name in sorted(whole):
            n = nodes[name]
            if _own_dim(n, lengths) is None and any(_chunked_reader(u, whole, dropped) for u in n.users):
                whole.discard(name)
                cut.append(n)
                changed = True
    return whole, cut


def _hint_shape(node: fx.Node) -> tuple:
    return tuple(size if isinstance(size, int) else size.node.hint for size in node.meta["val"].shape)


def _loss_targets(gm: fx.GraphModule, loss: Site, inputs: list, blockers: list) -> None:
    """A loss's targets must be chunked as its logits are. Flattened (``targets.view(-1)``) they share only
    the product ``b·s`` with the logits' rows, so their own sizes may be other symbols: an input the
    targets come from (through views) is chunked on the sequence dim of an input of the same shape."""
    node = next(n for n in gm.graph.nodes if n.name == loss.node)
    if op_rule(node.target) is None or op_rule(node.target).kind not in ("cross_entropy", "nll_loss"):
        return
    t = node.args[1]
    while isinstance(t, fx.Node) and t.op == "call_function":  # through the ops of the targets alone
        tensors = [i for i in t.all_input_nodes if isinstance(i.meta.get("val"), torch.Tensor)]
        if len(tensors) != 1:
            return
        t = tensors[0]
    if not isinstance(t, fx.Node) or t.op != "placeholder" or any(name == t.name for name, _ in inputs):
        return
    known = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    like = [(name, d) for name, d in inputs if _hint_shape(known[name]) == _hint_shape(t)]
    if like:
        inputs.append((t.name, like[0][1]))
    else:
        blockers.append(Site(loss.node, loss.where, f"the loss's targets ({t.name}) have no sequence dim that "
                                                    "matches an input's"))


def _from_length(node: fx.Node, s: sympy.Symbol, tables: list) -> str:
    """Why a value of the sequence's length made from sizes and tensors without it (``ones(s, s)``, an
    expand, ``table[:s]``) cannot be made on a chunk; '' where it can. The first s rows of a table (a rotary
    or position table sliced to the length) are the positions' rows: on a chunk, its own positions' rows
    (recorded in ``tables``)."""
    rule = op_rule(node.target)
    if rule is not None and rule.kind in ("factory", "expand", "expand_as"):
        return ""  # the same value at every position
    if rule is not None and rule.kind in _NEUTRAL or not any(isinstance(a.meta.get("val"), torch.Tensor)
                                                               for a in node.all_input_nodes):
        return ""  # an output picked from a tuple (a split's), or a value made from sizes alone
    if node.target in (aten.slice.Tensor, aten.narrow.default):
        x, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
        start = node.args[2] if len(node.args) > 2 else 0
        step = node.args[4] if node.target is aten.slice.Tensor and len(node.args) > 4 else 1
        out = node.meta["val"].shape[dim]
        if start in (0, None) and step == 1 and isinstance(out, torch.SymInt) and out.node.expr == s:
            tables.append((node.name, dim % x.meta["val"].dim()))
            return ""
    return f"{node.target} makes a value of the sequence's length from one without it: not a table's first rows"


def _blocked(node: fx.Node, operands: list[fx.Node], s, cp: int, reductions: list, site: Site) -> str:
    """Why ``node`` (which reads the sequence through ``operands``) cannot run on a chunk; '' where it can
    (recording reductions on the way). Attention is decided before (:func:`_attentions`)."""
    rule = op_rule(node.target)
    kind = rule.kind if rule is not None else None
    if kind in ("cross_entropy", "nll_loss"):
        reductions.append(Site(site.node, site.where, "loss: the mean over every counted token of the group"))
        return ""
    if kind in _NEUTRAL or kind in _PER_TOKEN:
        return ""
    if any(len(_seq_dims(a, s)) > 1 for a in operands):
        return ""  # inside a hand-written attention, refused once where its scores are made (below)
    if len(_seq_dims(node, s)) > 1:
        return "a hand-written attention's (sequence × sequence) scores: not softmax(q·kᵀ·c + a causal mask)·v"
    dims = {d for a in operands for d in _seq_dims(a, s)}
    if kind == "reduction":
        r = reduction_args(node)
        over = set(range(node.args[0].meta["val"].dim())) if r.dims is None else \
            {d % node.args[0].meta["val"].dim() for d in r.dims}
        if not over & set(_seq_dims(node.args[0], s)):
            return ""
        if rule.stat in ("sum", "mean"):
            reductions.append(Site(site.node, site.where, f"{rule.stat} over tokens"))
            return ""
        return f"{node.target} over the sequence"
    if kind in _ALONG_DIM:
        d = arg_named(node, "dim", 0)
        ndim = operands[0].meta["val"].dim()
        return f"{node.target} along the sequence" if isinstance(d, int) and d % ndim in dims else ""
    if kind == "index":  # x[:, [-1]]: the positions picked are the whole sequence's, not a chunk's
        if node.args[0] not in operands:  # W[ids]: only the indices carry the sequence, and each of the chunk's
            return ""  # tokens picks its own rows (an expert's weights per routed token): a gather per token
        picked = {i for i, ix in enumerate(node.args[1]) if ix is not None}
        own = set(_seq_dims(node.args[0], s))
        indices = [ix for ix in node.args[1] if isinstance(ix, fx.Node) and ix in operands]
        return "picks positions by index (x[:, [-1]] and the like)" if picked & own or indices else ""
    if node.target in _PER_ELEMENT:
        return ""
    if kind == "norm":
        ndim, norm = node.args[0].meta["val"].dim(), len(node.args[1])
        return f"{node.target} normalizes over the sequence" if dims & set(range(ndim - norm, ndim)) else ""
    try:
        ask_torch(node, {a: _seq_dims(a, s)[0] for a in operands}, cp)
    except TorchRefused as e:
        return f"{e} (with the sequence sharded)"
    return ""
