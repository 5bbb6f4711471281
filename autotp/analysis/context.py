"""Context parallelism: can a captured forward run on 1/cp of its sequence, and what must change where.

With context parallelism each rank of a cp group holds a chunk of the sequence (load-balanced, see
:mod:`autotp.operators.ring_attention`). Almost every op of a transformer treats each position alike and
runs on the chunk unchanged; this analysis finds, from the graph's shapes and dataflow alone, the few that
do not:

- the sequence length is the query length of ``scaled_dot_product_attention`` (a size symbol of the
  capture); a value *carries* the sequence where one of its dims is that symbol, or a product with it (the
  ``b·s`` rows of a flattened loss);
- *attention*: each SDPA call, run as ring attention over the cp group (causal or full; an explicit mask
  or dropout is refused here);
- *positions*: an ``arange`` over the sequence length (position embeddings, rotary tables, causal masks
  made from positions): indexed by the chunk's global positions instead. What is computed from them is
  held to the same rules as the tokens' data: on a chunk the positions are not in order, so a running sum
  or a difference along them (a packed-sequence check) would be wrong, and is named;
- *reductions*: a loss (cross-entropy, NLL) or a sum or mean over tokens: completed over the cp group (the
  global mean over every counted token);
- *blockers*: anything else that reads across positions — a cumulative sum, a shift or a convolution
  along the sequence, an index or slice of positions, a hand-written attention not yet run as SDPA —
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
from autotp.analysis.ops import arg_named, reduction_args
from autotp.analysis.torch_rules import TorchRefused, ask_torch

aten = torch.ops.aten

# kinds of autotp's table that treat every position alike along dims they do not name
_PER_TOKEN = frozenset({"pointwise", "same_shape", "view", "flatten", "move", "expand", "expand_as",
                        "complex_view"})
# kinds that make values (sizes, masks) or pick outputs, reading no position's values
_NEUTRAL = frozenset({"getitem", "sym_size", "no_output", "factory", "like", "new_like", "triangle"})
# kinds whose named dim (``dim`` argument) must not be the sequence's
_ALONG_DIM = frozenset({"softmax", "split", "slice", "narrow", "select", "cat", "stack"})


@dataclass(frozen=True)
class Site:
    """One fact about one node: its name, where the model made it (op, module, line) and what it is."""

    node: str
    where: str
    detail: str = ""


@dataclass(frozen=True)
class ContextFacts:
    """What running the forward on a sequence chunk takes (see the module docstring)."""

    length: str  # the sequence length's size symbol in the capture ("s85"); "" when none was found
    inputs: tuple[tuple[str, int], ...]  # placeholders carrying the sequence: (name, their sequence dim)
    attention: tuple[Site, ...]
    positions: tuple[Site, ...]
    reductions: tuple[Site, ...]
    blockers: tuple[Site, ...]
    outputs: tuple[tuple[int, int], ...] = ()  # outputs carrying the sequence: (output index, sequence dim)

    @property
    def runs(self) -> bool:
        """Can this forward run context-parallel?"""
        return bool(self.length) and not self.blockers


def _symbols(size: object) -> set:
    return set(size.node.expr.free_symbols) if isinstance(size, torch.SymInt) else set()


def _seq_dims(node: object, s: sympy.Symbol) -> list[int]:
    """The dims of ``node``'s value whose size involves the sequence length ``s``."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return []
    return [i for i, size in enumerate(val.shape) if s in _symbols(size)]


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
    inputs, attention, positions, reductions, blockers = [], [], [], [], []
    for node in gm.graph.nodes:
        if node.op == "placeholder" and _seq_dims(node, s):
            inputs.append((node.name, _seq_dims(node, s)[0]))
        if node.op != "call_function" or op_rule(node.target) is not None and op_rule(node.target).kind == "sym_size":
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
        if not operands:
            continue
        reason = _blocked(node, operands, s, cp, attention, reductions, site)
        if reason:
            blockers.append(Site(node.name, site.where, reason))
    for r in reductions:
        _loss_targets(gm, r, inputs, blockers)
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    outputs = tuple((i, _seq_dims(x, s)[0]) for i, x in enumerate(out.args[0]) if _seq_dims(x, s))
    return ContextFacts(str(s), tuple(inputs), tuple(attention), tuple(positions), tuple(reductions),
                        tuple(blockers), outputs)


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
    while isinstance(t, fx.Node) and t.op == "call_function" and op_rule(t.target) is not None \
            and op_rule(t.target).kind in ("view", "flatten", "same_shape"):
        t = t.args[0]
    if not isinstance(t, fx.Node) or t.op != "placeholder" or any(name == t.name for name, _ in inputs):
        return
    known = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    like = [(name, d) for name, d in inputs if _hint_shape(known[name]) == _hint_shape(t)]
    if like:
        inputs.append((t.name, like[0][1]))
    else:
        blockers.append(Site(loss.node, loss.where, f"the loss's targets ({t.name}) have no sequence dim that "
                                                    "matches an input's"))


def _blocked(node: fx.Node, operands: list[fx.Node], s, cp: int, attention: list, reductions: list,
             site: Site) -> str:
    """Why ``node`` (which reads the sequence through ``operands``) cannot run on a chunk; '' where it can
    (recording attention and reductions on the way)."""
    rule = op_rule(node.target)
    kind = rule.kind if rule is not None else None
    if kind == "sdpa":
        if arg_named(node, "attn_mask") is not None:
            return "attention with an explicit mask: ring attention takes a causal flag or none"
        if arg_named(node, "dropout_p", 0.0):
            return "attention dropout: not run as ring attention"
        causal = bool(arg_named(node, "is_causal", False))
        attention.append(Site(site.node, site.where, "causal" if causal else "full"))
        return ""
    if kind in ("cross_entropy", "nll_loss"):
        reductions.append(Site(site.node, site.where, "loss: the mean over every counted token of the group"))
        return ""
    if kind in _NEUTRAL or kind in _PER_TOKEN:
        return ""
    if any(len(_seq_dims(a, s)) > 1 for a in operands):
        return ""  # inside a hand-written attention, refused once where its scores are made (below)
    if len(_seq_dims(node, s)) > 1:
        return "a hand-written attention's (sequence × sequence) scores: not run as SDPA yet"
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
        picked = {i for i, ix in enumerate(node.args[1]) if ix is not None}
        return "picks positions by index (x[:, [-1]] and the like)" if picked & dims else ""
    if kind == "norm":
        ndim, norm = node.args[0].meta["val"].dim(), len(node.args[1])
        return f"{node.target} normalizes over the sequence" if dims & set(range(ndim - norm, ndim)) else ""
    try:
        ask_torch(node, {a: _seq_dims(a, s)[0] for a in operands}, cp)
    except TorchRefused as e:
        return f"{e} (with the sequence sharded)"
    return ""
