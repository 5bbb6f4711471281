"""Sequence parallelism: which values between the column→row pairs can hold a slice of the sequence.

Tensor parallelism leaves everything outside the pair regions (a column→row pair's span) replicated: the
residual stream, the norms, dropout, the embedding sums. With sequence parallelism (Korthikanti et al. 2022) each rank holds
``s/t`` of the sequence there instead:

- the sequence dim is the one attention mixes: the size of a softmax's or matmul's contracted dim, or the
  query length of ``scaled_dot_product_attention``, inside the pairs (dataflow and shapes, not names);
- *seeds*: a row-parallel output (or a vocab-parallel embedding's) is reduce-scattered along it instead of
  all-reduced; a flat ``[b·s, h]`` row output (GPT-2's Conv1D) right after the view that gives it its
  sequence dim back;
- the sequence slice propagates through ops that treat every position alike: pointwise ops, residual adds,
  dropout, norms and reductions over other dims, views and transposes that keep the dim whole;
- *sinks*: the input of a pair's column matmuls or of an LM head is all-gathered (also through a
  ``[.., h] -> [N, h]`` view, gathered before it);
- a replicated operand that spans the sequence (position embeddings) is cut to this rank's slice; a
  learned one that is broadcast over it (a norm's weight, a row bias) gets partial gradients, summed;
- anything else that reads a sequence slice (an index over positions, a view merging the sequence with
  the batch, a returned value) gets it gathered first and computes replicated, as plain tensor
  parallelism does: correct numbers, with the reason recorded.

Read-only: the planner turns :class:`SeqFacts` into a :class:`~autotp.plan.plan.SequencePlan`.
"""
from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import sympy
import torch
import torch.fx as fx

from autotp.analysis.pairs import Analysis
from autotp.analysis.matmuls import module_path
from autotp.analysis.op_rules import OpRule, handler, kind_of
from autotp.analysis.ops import arg_named, arg_of, is_guard, is_random, moved_dim, ndim_of, reduction_args
from autotp.analysis.shapes import Fingerprinter, normalize_dim, view_groups
from autotp.analysis.torch_rules import TorchRefused, ask_torch
from autotp.analysis.vocab import VocabFacts
from autotp.operators.functions import call_of


class _Whole(Exception):
    """The op needs the whole sequence: its sequence-sharded inputs are gathered."""


class LeaveFact(NamedTuple):
    """Where a sequence slice starts: a row output ``(b, s, h)`` reduce-scattered instead of all-reduced."""

    module: str  # the pair (or embedding) whose output it is
    source: fx.Node  # the row matmul or embedding
    node: fx.Node  # what is reduce-scattered: ``source``, or the view giving a flat ``[b·s, h]`` its sequence dim
    dim: int  # the sequence dim of ``node``


class EnterFact(NamedTuple):
    """Where a sequence slice ends: the input of a pair's column matmuls (or an LM head), all-gathered."""

    module: str
    x: fx.Node  # the matmuls' input
    source: fx.Node  # the sequence-sharded value gathered: ``x``, or the value a flattening view ``x`` reads
    dim: int  # the sequence dim of ``source``
    flatten: bool  # ``x`` is ``source.view(N, h)``: gathered before the view


class GatherFact(NamedTuple):
    """A sequence-sharded value that some ops need whole: gathered for them (they compute replicated)."""

    dim: int  # its sequence dim
    consumers: list[fx.Node]  # the ops that read it whole
    reason: str  # why the first of them needs the whole sequence


class SliceFact(NamedTuple):
    """A replicated operand spanning the sequence (position embeddings ``(1, s, h)``), cut to this rank's slice."""

    consumer: fx.Node
    value: fx.Node
    dim: int  # the value's sequence dim
    grad: bool  # it is learned: its gradient slices are all-gathered


class SummedGrad(NamedTuple):
    """A learned value broadcast over the sequence slice (a norm's weight ``(h,)``): each rank's gradient is
    partial, and is summed over the ranks."""

    consumer: fx.Node
    value: fx.Node  # a parameter (``grads``) or a value computed from one (``enter_grads``: Megatron's f)


class SizeFact(NamedTuple):
    """A size argument of a view or expand that is the sequence length: it becomes the local length."""

    node: fx.Node
    arg: int  # which argument (the size list)
    index: int  # which entry of it
    dim: int  # the input dim whose run-time size it takes; -1: keep the entry (an expand's)


@dataclass
class SeqFacts:
    length: tuple[fx.Node, int] | None = None  # graph input and dim holding the sequence length
    leaves: list[LeaveFact] = field(default_factory=list)
    enters: list[EnterFact] = field(default_factory=list)
    gathers: dict[fx.Node, GatherFact] = field(default_factory=dict)  # sequence-sharded value -> its gather
    slices: list[SliceFact] = field(default_factory=list)
    grads: list[SummedGrad] = field(default_factory=list)  # parameters
    enter_grads: list[SummedGrad] = field(default_factory=list)  # learned values that are not parameters
    sizes: list[SizeFact] = field(default_factory=list)
    random_nodes: list[fx.Node] = field(default_factory=list)
    dims: dict[fx.Node, int] = field(default_factory=dict)  # sequence-sharded value -> its sequence dim
    notes: list[str] = field(default_factory=list)


def _symbol(v: object) -> sympy.Symbol | None:
    if isinstance(v, torch.SymInt) and isinstance(v.node.expr, sympy.Symbol):
        return v.node.expr
    return None


def _shape(node: object) -> tuple:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def sequence_symbol(a: Analysis) -> sympy.Symbol | None:
    """The size attention mixes positions over, inside the pairs: a softmax's dim, a batched matmul's
    contracted dim, the query and key length of scaled_dot_product_attention (the most frequent)."""
    found: Counter[sympy.Symbol] = Counter()
    for p in a.pairs:
        for n in p.region.specs:
            kind, sizes = kind_of(n.target), []
            if kind == "softmax":
                sizes = [_shape(n)[normalize_dim(n.args[1], ndim_of(n))]]
            elif kind == "matmul":
                sizes = [_shape(n.args[0])[-1]]
            elif kind == "baddbmm":
                sizes = [_shape(n.args[1])[-1]]
            elif kind == "sdpa":
                sizes = [_shape(n.args[0])[-2], _shape(n.args[1])[-2]]
            found.update(s for s in map(_symbol, sizes) if s is not None)
    return found.most_common(1)[0][0] if found else None


class _Sequence:
    def __init__(self, gm: fx.GraphModule, a: Analysis, v: VocabFacts, seq: sympy.Symbol):
        self.gm, self.seq, self.facts, self.tp = gm, seq, SeqFacts(), a.tp
        self.fp = Fingerprinter(gm)
        self.params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
        self.inside: dict[fx.Node, str] = {}  # nodes of the pair regions -> their module
        self.sinks: dict[fx.Node, tuple[str, list[fx.Node]]] = {}  # column / head input -> module, matmuls
        self.matmul_x: dict[fx.Node, tuple[str, fx.Node]] = {}  # column / head matmul -> module, input
        for p in a.pairs:
            for n in [*p.region.specs, *p.region.stats, *(c.node for c in p.columns)]:
                self.inside[n] = p.name
            for c in p.columns:
                self.sinks.setdefault(c.x, (p.name, []))[1].append(c.node)
                self.matmul_x[c.node] = (p.name, c.x)
        for h in v.heads:
            for n in [*h.specs, *(x.node for x in h.losses), h.matmul.node]:
                self.inside[n] = h.matmul.module
            self.sinks.setdefault(h.matmul.x, (h.matmul.module, []))[1].append(h.matmul.node)
            self.matmul_x[h.matmul.node] = (h.matmul.module, h.matmul.x)
        self.tuples: dict[fx.Node, int] = {}  # split outputs: the sequence dim of every piece
        self.learned: dict[fx.Node, bool] = {}
        self.entered: set[tuple[str, fx.Node]] = set()

    # -- sizes --------------------------------------------------------------------------------------------
    def seq_dim(self, node: fx.Node) -> int | None:
        """The dim of ``node`` that is the sequence, when exactly one is."""
        dims = [i for i, s in enumerate(_shape(node)) if _symbol(s) == self.seq]
        return dims[0] if len(dims) == 1 else None

    def spans(self, x: fx.Node, xd: int) -> bool:
        return 0 <= xd < len(_shape(x)) and self.fp.shape(x)[xd] != 1

    def is_learned(self, x: fx.Node) -> bool:
        """Computed from a parameter or a floating graph input: it may need a gradient."""
        if x not in self.learned:
            seen, todo, out = set(), [x], False
            while todo and not out:
                n = todo.pop()
                if n in seen:
                    continue
                seen.add(n)
                val = n.meta.get("val")
                out = (n.op == "get_attr" and n.target in self.params) or \
                    (n.op == "placeholder" and isinstance(val, torch.Tensor) and val.is_floating_point())
                todo.extend(n.all_input_nodes)
            self.learned[x] = out
        return self.learned[x]

    # -- seeds ---------------------------------------------------------------------------------------------
    def seeds(self, a: Analysis, v: VocabFacts) -> dict[fx.Node, int]:
        at: dict[fx.Node, int] = {}
        for p, row in ((p, m.node) for p in a.pairs for m in (p.row, *p.sides)):  # a parallel block's two rows
            d = self.seq_dim(row)
            if d is not None:
                self.facts.leaves.append(LeaveFact(p.name, row, row, d))
                at[row] = d
                continue
            (view, *more) = list(row.users) or [None]
            d = self.seq_dim(view) if view is not None and not more and kind_of(view.target) == "view" else None
            if d is None:
                self.facts.notes.append(f"{p.name}: the output {row.name} {tuple(_shape(row))} has no sequence dim "
                                        "of its own: all-reduced")
                continue
            self.facts.leaves.append(LeaveFact(p.name, row, view, d))  # [b·s, h] -> [b, s, h], then reduce-scattered
            at[view] = d
        for node, w, _ in v.embeddings:
            d = self.seq_dim(node)
            if d is not None:
                self.facts.leaves.append(LeaveFact(module_path(node) or w, node, node, d))
                at[node] = d
        return at

    # -- propagation ---------------------------------------------------------------------------------------
    def run(self, at: dict[fx.Node, int]) -> None:
        dims = self.facts.dims
        for n in self.gm.graph.nodes:
            if n in at:
                dims[n] = at[n]
                continue
            if not any(x in dims or x in self.tuples for x in n.all_input_nodes) or kind_of(n.target) == "no_output" \
                    or is_guard(n):
                continue
            if n.op == "output":
                self.gather(n, "returned by the forward")
                continue
            if self.sink(n):
                continue
            if n in self.inside:
                self.gather(n, f"read inside the pair region of {self.inside[n]}")
                continue
            f = self.facts
            marks = [len(x) for x in (f.slices, f.grads, f.enter_grads, f.sizes, f.random_nodes)]
            try:
                d = self.visit(n)
            except _Whole as e:  # undo what the rule recorded before it gave up: n computes replicated
                for x, m in zip((f.slices, f.grads, f.enter_grads, f.sizes, f.random_nodes), marks):
                    del x[m:]
                self.tuples.pop(n, None)
                self.gather(n, str(e))
                continue
            if d is not None:
                dims[n] = d

    def gather(self, n: fx.Node, why: str) -> None:
        for x in n.all_input_nodes:
            if x in self.facts.dims:
                self.facts.gathers.setdefault(x, GatherFact(self.facts.dims[x], [], why)).consumers.append(n)

    def sink(self, n: fx.Node) -> bool:
        """A column / LM-head matmul reading a sequence slice, or the flattening view in front of it."""
        dims = self.facts.dims
        if n in self.matmul_x and self.matmul_x[n][1] in dims:
            module, x = self.matmul_x[n]
            source, flatten = x, False
        elif n in self.sinks and kind_of(n.target) == "view" and n.args[0] in dims \
                and set(n.users) <= set(self.sinks[n][1]) and self._flattens(n):
            module, x = self.sinks[n][0], n
            source, flatten = n.args[0], True
        else:
            return False
        if (module, x) not in self.entered:
            self.entered.add((module, x))
            self.facts.enters.append(EnterFact(module, x, source, dims[source], flatten))
        return True

    def _flattens(self, view: fx.Node) -> bool:
        """``[.., h] -> [N, h]``: every dim but the last merged into one."""
        src, dst = self.fp.shape(view.args[0]), self.fp.shape(view)
        return len(dst) == 2 and dst[-1] == src[-1] and dst[0] * dst[1] == _prod(src)

    def visit(self, n: fx.Node) -> int | None:
        """The sequence dim of ``n``'s output by its op's rule (None: not a tensor sliced along it); raises
        :class:`_Whole` where ``n`` needs the whole sequence."""
        if n.op != "call_function":
            raise _Whole(f"{n.op} {n.target}")
        if (call := call_of(n)) is not None:
            raise _Whole(f"inside the custom autograd Function {call.name()}, whose backward is the model's own code")
        found = handler(self, n.target)
        if found is None:
            raise _Whole(f"no sequence-parallel rule for {n.target}, in autotp's table or torch's")
        on, rule = found
        if is_random(n, rule):
            self.facts.random_nodes.append(n)  # each rank's tokens differ: a per-rank stream
        return on(n, rule)

    # -- one handler per kind ------------------------------------------------------------------------------
    def _on_sym_size(self, n: fx.Node, rule: OpRule) -> None:
        if normalize_dim(n.args[1], ndim_of(n.args[0])) == self.facts.dims[n.args[0]]:
            raise _Whole("reads the length of the sequence")
        return None

    def _on_getitem(self, n: fx.Node, rule: OpRule) -> int:
        if n.args[0] in self.tuples:
            return self.tuples[n.args[0]]
        raise _Whole("indexes a tuple")

    def _on_pointwise(self, n: fx.Node, rule: OpRule) -> int:
        return self.pointwise(n, [*n.args, *n.kwargs.values()])

    _on_same_shape = _on_pointwise

    def _on_select(self, n: fx.Node, rule: OpRule) -> int:
        d = self.facts.dims[n.args[0]]
        s = normalize_dim(n.args[1], ndim_of(n.args[0]))
        if s == d:
            raise _Whole("selects one position")
        return d - (s < d)

    def _on_torch(self, n: fx.Node, rule: OpRule) -> int | None:
        """An op autotp's table does not list: DTensor's sharding strategy for it says where the sequence
        goes (:func:`ask_torch`)."""
        split = {x: self.facts.dims[x] for x in n.all_input_nodes if x in self.facts.dims}
        try:
            answer = ask_torch(n, split, self.tp)
        except TorchRefused as e:
            raise _Whole(str(e)) from None
        dims = {d for d in answer.outputs if d is not None}
        if len(dims) != 1:
            raise _Whole(f"{n.target} gives results split along different dims")
        sliced = {x for x, _ in answer.slices}
        for x, xd in answer.slices:
            self.replicated_operand(n, x, xd)
        for x in n.all_input_nodes:
            if x not in split and x not in sliced and ndim_of(x) is not None:
                self.replicated_operand(n, x, -1)
        (d,) = dims
        if len(answer.outputs) > 1:
            self.tuples[n] = d
            return None
        return d

    # -- rules ---------------------------------------------------------------------------------------------
    def pointwise(self, n: fx.Node, operands: list) -> int:
        tensors = [x for a in operands for x in (a if isinstance(a, (list, tuple)) else [a])
                   if isinstance(x, fx.Node) and ndim_of(x) is not None]
        out_nd = ndim_of(n)
        aligned = {self.facts.dims[x] + out_nd - ndim_of(x) for x in tensors if x in self.facts.dims}
        if len(aligned) != 1:
            raise _Whole("operands split along different dims")
        d = aligned.pop()
        for x in tensors:
            if x not in self.facts.dims:
                self.replicated_operand(n, x, d - (out_nd - ndim_of(x)))
        return d

    def replicated_operand(self, n: fx.Node, x: fx.Node, xd: int) -> None:
        """A replicated tensor meeting sequence slices at ``n``: sliced where it spans the sequence (position
        embeddings); else, if learned, its gradient is partial on each rank and gets summed."""
        if self.spans(x, xd):
            if _symbol(_shape(x)[xd]) != self.seq:
                raise _Whole(f"operand {x.name} spans the sequence dim with another size")
            self.facts.slices.append(SliceFact(n, x, xd, self.is_learned(x)))
        elif self.is_learned(x):
            if x.op == "get_attr" and x.target in self.params:
                self.facts.grads.append(SummedGrad(n, x))
            else:
                self.facts.enter_grads.append(SummedGrad(n, x))

    def _on_norm(self, n: fx.Node, rule: OpRule) -> int:
        x = n.args[0]
        d = self.facts.dims.get(x)
        if d is None or d >= ndim_of(n) - len(n.args[1]):
            raise _Whole("normalizes over the sequence")
        for w in (n.args[i] for i in rule.weights if i < len(n.args)):
            if isinstance(w, fx.Node):
                self.replicated_operand(n, w, d - (ndim_of(n) - ndim_of(w)))
        return d

    def _on_reduction(self, n: fx.Node, rule: OpRule) -> int:
        x = n.args[0]
        d, nd = self.facts.dims[x], ndim_of(x)
        r = reduction_args(n)
        dims = [normalize_dim(i, nd) for i in (range(nd) if r.dims is None else r.dims)]
        if d in dims:
            raise _Whole("reduces over the sequence")
        if r.keepdim:
            return d
        return d - sum(i < d for i in dims)

    def _on_view(self, n: fx.Node, rule: OpRule) -> int:
        x = n.args[0]
        d = self.facts.dims[x]
        src, dst = self.fp.shape(x), self.fp.shape(n)
        for gi, gj in view_groups(src, dst):
            if d not in gi:
                continue
            gi_real = [i for i in gi if src[i] != 1 or i == d]
            gj_real = [j for j in gj if dst[j] != 1]
            if gi_real != [d] or len(gj_real) != 1:
                raise _Whole("a view merges or splits the sequence dim")
            j = gj_real[0]
            if n.args[1][j] != -1:
                self.facts.sizes.append(SizeFact(n, 1, j, d))  # the local length, read from the input
            return j
        raise _Whole("a view loses the sequence dim")

    def _on_move(self, n: fx.Node, rule: OpRule) -> int:
        return moved_dim(n, self.facts.dims[n.args[0]], self.fp.shape(n.args[0]))

    def _on_expand(self, n: fx.Node, rule: OpRule) -> int:
        x = n.args[0]
        sizes = n.args[1]
        j = self.facts.dims[x] + len(sizes) - ndim_of(x)
        if sizes[j] != -1:
            self.facts.sizes.append(SizeFact(n, 1, j, -1))  # keep the local length
        return j

    def _on_slice(self, n: fx.Node, rule: OpRule) -> int:
        d = self.facts.dims[n.args[0]]
        if normalize_dim(arg_of(n, 1, "dim", 0), ndim_of(n)) != d:
            return d
        start, end, step = arg_of(n, 2, "start", None), arg_of(n, 3, "end", None), arg_of(n, 4, "step", 1)
        if start in (None, 0) and step == 1 and (end is None or (isinstance(end, int) and end >= sys.maxsize)):
            return d
        raise _Whole("slices the sequence")

    def _on_split(self, n: fx.Node, rule: OpRule) -> None:
        x = n.args[0]
        d, nd = self.facts.dims[x], ndim_of(x)
        s = normalize_dim(arg_named(n, "dim", 0), nd)
        if s == d:
            raise _Whole("splits the sequence")
        self.tuples[n] = d - (s < d) if rule.form == "unbind" else d
        return None

    def _on_cat(self, n: fx.Node, rule: OpRule) -> int:
        tensors = [x for x in n.args[0] if ndim_of(x) == ndim_of(n)]
        d = self.pointwise(n, tensors)
        if normalize_dim(arg_of(n, 1, "dim", 0), ndim_of(n)) == d:
            raise _Whole("concatenates along the sequence")
        return d


def _prod(xs: list[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def analyze_sequence(gm: fx.GraphModule, a: Analysis, v: VocabFacts) -> SeqFacts:
    """Where the sequence is split, gathered and reduce-scattered in ``gm`` (see the module docstring)."""
    seq = sequence_symbol(a)
    if seq is None:
        return SeqFacts(notes=["no dim that attention mixes positions over was found (or the sequence length "
                               "was fixed at capture): plain tensor parallelism"])
    s = _Sequence(gm, a, v, seq)
    s.run(s.seeds(a, v))
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            d = s.seq_dim(node)
            if d is not None:
                s.facts.length = (node, d)
                break
    return s.facts
