"""Sharding propagation through the region between column-parallel and row-parallel matmuls.

Starting from the outputs of the column matmuls (sharded on their last dim), every node that consumes a
sharded value gets a :class:`Sharding` by a rule for its op; the rule also records which integer
constants of the node change (a view's head count, a split's sizes, an expand's repeat count). The region
is valid when every sharded value ends at the row matmul, contracted on its last dim. Anything else —
an op with no rule, a reduction over the sharded dim, a sharded value that escapes — raises
:class:`Unshardable`, and the caller replicates the pair instead of guessing.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from autotp.analysis.channels import after_reduction, beside_reductions
from autotp.analysis.einsum_rules import EinsumRules
from autotp.analysis.op_rules import OP_RULES, OpRule, handler, kind_of, op_rule, permutes
from autotp.analysis.ops import (Unshardable, held_whole, is_guard, is_random, ndim_of, permutation, reaches,
                                 unseen_write)
from autotp.analysis.pair_region import (Entering, OperandSlice, ParamCut, PairRegion, SharedValues, StatFact,
                                         from_alone)
from autotp.analysis.shape_rules import ShapeRules
from autotp.analysis.shapes import Fingerprinter, is_static, normalize_dim, view_groups
from autotp.analysis.torch_rules import TorchRefused, ask_torch
from autotp.analysis.value_rules import ValueRules
from autotp.analysis.function_rules import FunctionRefused, Operand, check_function
from autotp.plan.plan import Rewrite
from autotp.operators.functions import FunctionCall, arg_index, call_of, is_result, result_count, result_index
from autotp.errors import ShardingError
from autotp.shard_spec import Segment, Sharding, local_runs, strided

__all__ = ["Propagator", "PairRegion", "propagate"]


def _param_view(target: object) -> bool:
    """What a per-head parameter passes through on its way to meet the heads: a view, an expand, an unsqueeze,
    a cast (Hugging Face Mamba's ``dt_proj.bias.float()[:, None]``)."""
    rule = op_rule(target)
    return rule is not None and (rule.kind in ("view", "expand") or rule.form == "insert" or rule.cast)


def _rule_target(node: fx.Node) -> object:
    """The op whose rule places ``node``: its own, or for an in-place op the table does not list whose write no
    other node sees (:func:`~autotp.analysis.ops.unseen_write`), its functional form's."""
    if node.target in OP_RULES:
        return node.target
    return unseen_write(node) or node.target


class Propagator(ShapeRules, ValueRules, EinsumRules):
    """Tensor-parallel sharding propagation: :meth:`visit` each node that reads a sharded value, in graph order.

    The node's op is looked up in :mod:`~autotp.analysis.op_rules` and its kind's ``_on_<kind>`` handler
    gives the node's :class:`Sharding` (:class:`ShapeRules`: ops that move the sharded dim, :class:`ValueRules`:
    ops that compute along it), recording in :attr:`region` what else changes; an op with no handler, or a
    handler that cannot keep the sharding local, raises :class:`Unshardable`. Other analyses reuse it through
    :attr:`region`, :meth:`spec`, :meth:`rewrite` and :meth:`visit` (the vocab-parallel heads).
    """

    def __init__(self, fp: Fingerprinter, tp: int, where: str):
        self.fp = fp
        self.tp = tp
        self.where = where  # the region's name, for errors
        self.region = PairRegion()
        self._broadcast: frozenset[fx.Node] = frozenset()  # operands of the node being visited read as replicated
        self._checked: set[FunctionCall] = set()  # the model's autograd Functions checked to run on shards
        self._entered: dict[FunctionCall, fx.Node] = {}  # each Function entered: its first node visited
        self._copies: set[fx.Node] = set()  # values whose heads are copies of one head every rank holds

    # -- public interface ------------------------------------------------------------------------
    def spec(self, x: object) -> Sharding | None:
        """The sharding of ``x`` as the node being visited reads it (None: replicated, or not a tensor)."""
        s = self.region.specs.get(x) if isinstance(x, fx.Node) and x not in self._broadcast else None
        return s if isinstance(s, Sharding) else None

    def rewrite(self, node: fx.Node, arg: int | str, index: int | None, old: int, new: int) -> None:
        """Record that the integer ``node.args[arg]`` (its element ``index``) becomes ``new`` on each rank."""
        if old != new:
            self.region.rewrites.append(Rewrite(node.name, arg, index, old, new))

    def visit(self, node: fx.Node) -> None:
        """Give ``node`` (which reads a sharded value) its sharding by its op's rule, or raise Unshardable."""
        rule = op_rule(node.target)
        if rule is not None and rule.kind == "no_output":
            return
        call = call_of(node)
        marks = self._marks()
        self._broadcast = self.broadcast_whole(node)
        try:
            self._dispatch(node, rule)
            self._note_copies(node, rule)
        finally:
            self._broadcast = frozenset()
        if call is not None:
            self._inside_function(node, call, marks)

    def copies_of_one_head(self, x: fx.Node) -> bool:
        return x in self._copies

    def _note_copies(self, node: fx.Node, rule: OpRule | None) -> None:
        """One head every rank holds, expanded or repeated to several (DiffLlama's half of v, one kv head,
        ``.repeat(1, 2, 1, 1)``), and the shape ops after it: whichever rank holds which of them, it holds copies
        of that head (:meth:`_meets_as`)."""
        out = self.region.specs.get(node)
        ins = [x for x in node.all_input_nodes if self.spec(x) is not None]
        if rule is None or rule.kind not in ("expand", "repeat", "view", "move") or not isinstance(out, Sharding) \
                or len(ins) != 1:
            return
        x, s = ins[0], self.spec(ins[0])
        if x in self._copies or (rule.kind in ("expand", "repeat") and held_whole(s) and not held_whole(out)
                                 and self.fp.shape(x)[s.dim] == 1):
            self._copies.add(node)

    def check_functions(self) -> None:
        """Check every model's own autograd Function the propagation entered whose results it did not reach: a
        loss helper that takes the vocab-sharded logits and returns the (whole) loss computed before it never
        has a sharded result, and is refused here (its result is whole) rather than run on shards unchecked."""
        for call, node in list(self._entered.items()):
            if call not in self._checked:
                self._check(node, call)

    def _marks(self) -> tuple[int, ...]:
        r = self.region
        return len(r.slices), len(r.entering), len(r.params), len(r.stats), len(r.random_nodes), len(r.inputs)

    def _inside_function(self, node: fx.Node, call: FunctionCall, marks: tuple[int, ...]) -> None:
        """A node of the model's own autograd Function: the graph calls the Function itself on the shards, so
        nothing may be inserted inside it (a collective, a slice, a sharded parameter), and at its first result
        the Function is run on random shards to check that its forward and backward stay local."""
        if self._marks() != marks:
            raise Unshardable(node, f"inside the custom autograd Function {call.name()}: sharding it would need "
                                    "communication or slicing inside the model's own code")
        self._entered.setdefault(call, node)
        if is_result(node) and call not in self._checked:
            self._check(node, call)

    def _check(self, node: fx.Node, call: FunctionCall) -> None:
        """Run ``call``'s Function on random shards laid out as propagation found its arguments and results
        (a result propagation did not reach is whole); Unshardable at ``node`` unless it gives each rank its
        shards, forward and backward."""
        args = [n for n in node.graph.nodes if call_of(n) == call and arg_index(n) is not None]
        args.sort(key=arg_index)
        outs = [n for n in node.graph.nodes if call_of(n) == call and is_result(n)]
        results: list[Operand | None] = [None] * (result_count(outs[0]) if outs else 0)
        for o in outs:
            s = self.spec(o.args[0])  # the result itself: the markers after this one are not visited yet
            if s is not None and (s.inner or s.outer or s.group):
                raise Unshardable(node, f"{call.name()} gives a result laid out in a way no check describes")
            results[result_index(o)] = _operand(o, s)
        operands = []
        for a in args:
            s = self.spec(a)
            if s is None and self._learned(a.args[0]):
                raise Unshardable(node, f"{call.name()} reads the whole {a.args[0].name}, which needs a gradient, "
                                        "with sharded arguments: its gradient on each rank would be partial")
            operands.append(_operand(a, s))
        try:
            check_function(call, operands, results, self.tp)
        except FunctionRefused as e:
            raise Unshardable(node, str(e)) from None
        self._checked.add(call)

    def broadcast_whole(self, node: fx.Node) -> frozenset[fx.Node]:
        """Operands that every rank holds whole (a single kv head: Megatron replicates it on every rank) and
        that meet a split operand of ``node`` with size 1 on its sharded dims (``(b, 1, s, d)`` keys against
        ``(b, n/t, s, d)`` queries, broadcast by the op): each rank broadcasts them over its own heads, so the
        op's rule reads them as replicated operands. Their gradient on each rank covers only its heads; the
        weight block they come from is held by every rank and its gradient is summed over the group."""
        specs = {x: s for x in node.all_input_nodes if (s := self.spec(x)) is not None}
        split = [(x, s) for x, s in specs.items() if not held_whole(s)]
        whole = [x for x, s in specs.items() if held_whole(s)]
        if not split or not whole:
            return frozenset()
        out = []
        for x in whole:
            shape, nd = self.fp.shape(x), ndim_of(x)
            # broadcasting aligns dims from the right (batch dims of a matmul and attention too)
            at = [d - ndim_of(y) + nd for y, s in split for d in [s.dim, *([s.inner[0]] if s.inner else [])]]
            if all(d < 0 or shape[d] == 1 for d in at):
                out.append(x)
        return frozenset(out)

    def _dispatch(self, node: fx.Node, rule: OpRule | None) -> None:
        grouped = [s for a in node.all_input_nodes if (s := self.spec(a)) is not None and s.group]
        if grouped:
            return self.group_read(node, grouped[0])
        found = handler(self, _rule_target(node))
        if found is None:
            raise Unshardable(node, f"no sharding rule for {node.target}, in autotp's table or torch's")
        on, rule = found
        if is_random(node, rule):
            self.region.random_nodes.append(node)
        out = on(node, rule)
        if out is not None:
            self.region.specs[node] = out

    # -- the kinds read as they are --------------------------------------------------------------
    def _on_sym_size(self, node: fx.Node, rule: OpRule) -> None:
        s = self.spec(node.args[0])
        if s is not None and normalize_dim(node.args[1], ndim_of(node.args[0])) in (s.dim, (s.inner or (None,))[0]):
            raise Unshardable(node, "the size of the sharded dim is read at run time")

    def _on_getitem(self, node: fx.Node, rule: OpRule) -> Sharding | None:
        parent = self.region.specs.get(node.args[0])
        if not isinstance(parent, tuple):
            raise Unshardable(node, "indexing a sharded tensor")
        return parent[node.args[1]]

    def _on_torch(self, node: fx.Node, rule: OpRule) -> Sharding | tuple[Sharding | None, ...]:
        """An op autotp's table does not list: DTensor's sharding strategy for it (:func:`ask_torch`) says
        where its outputs are sharded; a replicated operand it reads as a shard is sliced (or, a parameter,
        sharded), any other that is learned gets its gradient summed."""
        sharded = {x: s for x in node.all_input_nodes if (s := self.spec(x)) is not None}
        first = next(iter(sharded.values()))
        if all(held_whole(s) and len(s.segments) == 1 for s in sharded.values()) and node.args \
                and node.args[0] in sharded and list(self.fp.shape(node)) == list(self.fp.shape(node.args[0])):
            # every sharded operand is one head every rank holds whole: each rank computes the op whole, as one
            # device does (DeepSeek-V4's mask of the pooled keys each query chose, scattered in place), and holds
            # its output whole alike
            for x in node.all_input_nodes:
                if x not in sharded and ndim_of(x) is not None:
                    self._enter_if_learned(node, x)
            return sharded[node.args[0]]
        # heads folded under the batch (``outer``: ``[b, heads]`` flattened, a rank's heads not one block of
        # the dim) are read as torch reads a block only by an op that keeps the dim and slices nothing else
        # (``cumsum`` over time of ``(b·h, s)`` gates): each row of the dim is computed from itself alone
        if any(s.inner or s.group or s.segments != first.segments or s.outer != first.outer
               for s in sharded.values()):
            raise Unshardable(node, f"{node.target} reads a sharded value laid out in a way torch's rules do not "
                                    "describe")
        # a dim whose blocks are fewer than the ranks (2 key heads at tp 4: each held by 2 ranks) is cut as
        # torch would cut it into that many blocks: each rank's block is one of them
        parts = {g.parts for g in first.segments}
        blocks = parts.pop() if len(parts) == 1 else self.tp
        try:
            answer = ask_torch(node, {x: s.dim for x, s in sharded.items()}, blocks, op=_rule_target(node))
        except TorchRefused as e:
            raise Unshardable(node, str(e)) from None
        if first.outer and (answer.slices or any(d not in (None, first.dim) for d in answer.outputs)
                            or any(s.dim != first.dim for s in sharded.values())):
            raise Unshardable(node, f"{node.target} reads heads folded under the batch other than row by row")
        outs = tuple(None if d is None else first.moved(d) for d in answer.outputs)
        out = next((o for o in outs if o is not None), None)
        if out is None:
            raise Unshardable(node, f"{node.target} gives no tensor from a sharded one")
        sliced = {x for x, _ in answer.slices}
        for x, xd in answer.slices:
            self._local_operand(node, x, xd, out)
        for x in node.all_input_nodes:
            if x not in sharded and x not in sliced and ndim_of(x) is not None:
                self._enter_if_learned(node, x)
        return outs[0] if len(outs) == 1 else outs

    # -- replicated operands that meet sharded values --------------------------------------------
    def expanded_head(self, x: object, s: Sharding) -> bool:
        """``k_rot.expand(-1, n, -1, -1)``: one replicated head (a rotary key part shared by all heads) expanded
        to all heads, read only where it meets heads sharded by ``s``: each rank expands it to its own heads
        (the expand's size rewritten), and its gradient, partial on each rank, is summed (f)."""
        if not (isinstance(x, fx.Node) and kind_of(x.target) == "expand" and len(x.users) == 1) \
                or s.inner or s.outer or ndim_of(x) != ndim_of(x.args[0]) or self.fp.shape(x.args[0])[s.dim] != 1:
            return False
        self._set_view_size(x, list(x.args[1]), s.dim, sum(g.size for g in s.segments), s.local_size)
        self._enter_if_learned(x, x.args[0])
        return True

    def _replicated_operand(self, node: fx.Node, x: fx.Node, s: Sharding) -> None:
        """A replicated operand of an op with sharded output ``s``, broadcast against it."""
        out_nd, nd = ndim_of(node), ndim_of(x)
        shape, out_shape = self.fp.shape(x), self.fp.shape(node)
        for d in [s.dim] + ([s.inner[0]] if s.inner else []):
            xd = d - (out_nd - nd)
            if xd >= 0 and shape[xd] != 1 and out_shape[d] != 1:
                return self._local_operand(node, x, xd, s)
        self._enter_if_learned(node, x)

    def _enter_if_learned(self, node: fx.Node, x: fx.Node) -> None:
        """A per-head norm's weight (or any value computed from parameters) meets sharded heads: each rank's
        gradient for it covers only its heads, so it enters through f and its gradient is summed. A value
        computed from a mixer's reducing projection (Jamba's normed B read by the scan) has its gradient summed
        by the reduction's all-reduce: only the parameters beside it on the way enter."""
        if not self._learned(x):
            return
        found = beside_reductions(self.region, x, self._learned) if after_reduction(self.region, x) \
            else [Entering(node, x)]
        self.region.entering += [e for e in found if e not in self.region.entering]

    def _local_operand(self, node: fx.Node, x: fx.Node, xd: int, s: Sharding) -> None:
        """A replicated operand that spans the sharded dim becomes this rank's slice (Replicate -> Shard, no
        communication): a parameter (a whole-width norm's weight) is sharded itself; a constant-filled
        factory (``zeros(b·heads, s, s)``) is made local-sized; any other value that needs no gradient (ALiBi
        slopes, a mask with a head dim, built from buffers and inputs) is sliced where it is used."""
        if s.inner or xd != s.dim - (ndim_of(node) - ndim_of(x)) or \
                self.fp.shape(x)[xd] != self.fp.shape(node)[s.dim]:
            raise Unshardable(node, f"replicated operand {x.name} spans the sharded dim")
        if self._parameter(x) is not None and not s.outer:
            self.region.params.append(ParamCut(x, xd, s))
            return
        picked = self._gathered_parameter(x)
        if picked is not None and not s.outer and xd >= picked[1]:  # bias[ids]: one expert's bias per slot
            self.region.params.append(ParamCut(picked[0], xd - picked[1] + 1, s))
            self.region.specs[x] = s.moved(xd)
            return
        if self.viewed_parameter(x, s.moved(xd)) or self.elementwise_parameter(x, s.moved(xd)) \
                or self.picked_parameter(x, s.moved(xd)):
            return
        if kind_of(x.target) in ("factory", "new_like") and len(x.users) == 1:
            # zeros made in the forward (a recurrent state ``x.new_zeros(b, heads, dk, dv)``: x gives its dtype only)
            at = 0 if kind_of(x.target) == "factory" else 1
            self._set_view_size(x, list(x.args[at]), xd, sum(g.size for g in s.segments), s.local_size, arg=at)
            return
        if self._learned(x):
            self._summed_slice(node, x, s)
        self.region.slices.append(OperandSlice(node, x, xd, s))

    def _summed_slice(self, node: fx.Node, x: fx.Node, s: Sharding) -> None:
        """``x``, learned, is sliced at ``node``: exact where its gradient is summed over the ranks. So it is when
        ``x`` is computed from reducing projections' outputs, read only on the way to ``node`` (Doge's per-kv-head
        gate ``exp(A * softplus(dt_proj(v)))``, ``(b, s, n_kv)``, expanded to a ``(b, heads, s, s)`` mask): each
        rank's gradient covers its own heads, the reductions' backward all-reduce sums it, and a parameter on the
        way (``A``, ``(n_kv,)``) enters through its own f. Otherwise, where ``x`` multiplies the sharded value and
        every rank holds a block of its own (no block on several ranks, whose gradients would be counted once per
        rank), ``x`` enters through f whole and is sliced after it: Gemma's per-layer input ``(b, s, d_pl)``
        scaling the gate's output ``(b, s, d_pl/t)`` elementwise. Its gradient on each rank is its own slice's,
        zero elsewhere, and f's all-reduce puts the pieces together: one all-reduce of ``x``'s size backward,
        where cutting the whole value's producers instead would cut them on the same features (a norm over them:
        statistics all-reduced forward too). A value added to the cut features is not taken so: it is the
        residual stream, which would then run through the region to the next matmul that reads it (an LM head
        made a row, its logits all-reduced), where Megatron ends the pair before the add."""
        chain = _between(self.region, x)
        if chain and all(u in chain or u is node or kind_of(u.target) == "sym_size" for n in chain for u in n.users):
            found = [Entering(n, a) for n in chain for a in n.all_input_nodes
                     if a not in chain and a not in self.region.reduced and self._learned(a)]
            self.region.entering += [e for e in found if e not in self.region.entering]
            return
        rule = op_rule(_rule_target(node))  # an in-place product nothing else sees is read as its functional form
        if rule is not None and rule.scales and not (s.inner or s.outer or s.group) \
                and all(g.parts == self.tp and not g.inner for g in s.segments):
            if Entering(node, x) not in self.region.entering:
                self.region.entering.append(Entering(node, x))
            return
        raise Unshardable(node, f"replicated operand {x.name} spans the sharded dim and depends on a parameter")

    def elementwise_parameter(self, x: fx.Node, s: Sharding) -> bool:
        """A value computed from one parameter by elementwise ops alone and read only here (a gated linear
        attention's per-head decay ``-A_log.float().exp()``): the parameter is sharded with the heads, and
        each rank computes its own heads' values."""
        if s.inner or s.outer:
            return False
        chain, unread, node = [], [], x
        while node.op == "call_function":
            rule, ins = op_rule(node.target), node.all_input_nodes
            if chain and _param_view(node.target) and not rule.cast:
                break  # a view of what the chain reads: followed below
            # beside this read, x may give its dtype to new tensors (``A.new_zeros((b, d, n))``, cut alike)
            others = [u for u in node.users if not (node is x and kind_of(u.target) == "new_like" and u.args[0] is x)]
            dead = self._unread(node)
            # x itself may have other readers (RWKV's decay ``-exp(time_decay)``, read at every step of its loop):
            # it is cut for all of them, and one outside the region is refused as a sharded value escaping it
            if rule is None or not (rule.kind == "pointwise" or rule.cast) or len(ins) != 1 \
                    or (node is not x and len([u for u in others if u not in dead]) != 1) \
                    or self.fp.shape(ins[0]) != self.fp.shape(node):
                return False
            chain.append(node)
            unread += dead
            node = ins[0]
        dead = self._unread(node) if self._parameter(node) is not None else []
        if chain and self._parameter(node) is None and node.op == "call_function" and _param_view(node.target) \
                and len(node.users) == 1 and self.viewed_parameter(node, s):
            # elementwise ops of a view of a parameter (Dory's ``(sqk * c).view(-1, 1, d).square()``)
            for n in chain + unread:
                self.region.specs[n] = s
            return True
        if not chain or self._parameter(node) is None:
            return False
        for n in chain + unread + dead:
            self.region.specs[n] = s
        self.region.params.append(ParamCut(node, s.dim, s))
        return True

    def _unread(self, x: fx.Node) -> list[fx.Node]:
        """The values computed from ``x`` by elementwise ops and casts of its shape that nothing reads (Nemotron-H
        computes ``-exp(A_log.float())`` twice, once for a fused kernel's path it does not take): cut alike with
        ``x`` at no cost. Users of ``x`` that lead anywhere else are not listed: the caller judges them."""
        out = []
        for u in x.users:
            branch, todo = [], [u]
            while todo and branch is not None:
                n = todo.pop()
                rule = op_rule(n.target) if n.op == "call_function" else None
                if rule is None or not (rule.kind == "pointwise" or rule.cast) or len(n.all_input_nodes) != 1 \
                        or self.fp.shape(n) != self.fp.shape(x):
                    branch = None
                else:
                    branch.append(n)
                    todo.extend(n.users)
            out += branch or []
        return out

    def picked_parameter(self, x: fx.Node, s: Sharding) -> bool:
        """``w[k]``: one row of a parameter picked by a constant index and read only here (RecurrentGemma's
        temporal convolution weights its shifted window ``k`` by ``w[k]``, ``w (width, channels)``): the parameter
        is cut on the dim the row keeps, so every pick of it is this rank's channels."""
        if s.inner or s.outer or kind_of(x.target) != "select" or len(x.users) != 1 \
                or not isinstance(x.args[0], fx.Node) or self._parameter(x.args[0]) is None:
            return False
        w, d = x.args[0], normalize_dim(x.args[1], ndim_of(x.args[0]))
        pd = s.dim if s.dim < d else s.dim + 1  # the parameter's dim that the row's sharded dim is
        if any(kind_of(u.target) != "select" or normalize_dim(u.args[1], ndim_of(w)) != d for u in w.users):
            return False  # every read of w picks a row the same way, so one cut serves them all
        self.region.specs[x] = s
        self.region.params.append(ParamCut(w, pd, s.moved(pd)))
        return True

    def viewed_parameter(self, x: object, s: Sharding) -> bool:
        """A parameter with one entry per head, reshaped and expanded to meet the heads on dim ``s.dim`` of
        ``x`` (GPT-OSS's attention sinks: ``sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)`` concatenated
        to the scores): the parameter is sharded with the heads, and the sizes on the way become local. Its dims
        may be reordered on the way (a short convolution's static taps ``w (k, C)`` read per head as
        ``w.T.view(n, C/n, k)``): the parameter is cut on the dim the heads come from."""
        if not isinstance(x, fx.Node) or s.inner or s.outer:
            return False
        chain, node, d, segs = [], x, s.dim, s.segments
        while node.op == "call_function" and (_param_view(node.target) or permutes(node.target)) \
                and len(node.users) == 1:
            src, full = node.args[0], sum(g.size for g in segs)
            if not isinstance(src, fx.Node) or self.fp.shape(node)[d] != full:
                return False
            # a view names the dim it keeps or splits by its grouping, not by a size that may repeat (4 heads
            # viewed from (C, 4) taps); a flat per-head parameter split into heads: (n·d,) -> (n, 1, d)
            at, scale = ([permutation(node)[d]], 1) if permutes(node.target) else self._split_from(node, src, d)
            if not at:
                at = [i for i, n in enumerate(self.fp.shape(src)) if n == full]
            if len(at) != 1:
                return False
            chain.append((node, d, segs))
            node, d, segs = src, at[0], tuple(Segment(g.size * scale, g.parts) for g in segs)
        if not chain:
            return False
        if self._parameter(node) is None:
            # views of a value computed from one parameter elementwise (Hugging Face Mamba's
            # A[None, :, None, :] of A = -exp(A_log.float()), (d_inner, n) -> (1, d_inner, 1, n)): the
            # parameter is cut on the dim the views keep, and the views' sizes become local as above
            if not self.elementwise_parameter(node, Sharding(d, segs)):
                return False
        else:
            self.region.params.append(ParamCut(node, d, Sharding(d, segs)))
        for n, dim, at_segs in chain:
            # a permute's list is its dims' order, not sizes
            size = list(n.args[1]) if len(n.args) > 1 and isinstance(n.args[1], (list, tuple)) \
                and not permutes(n.target) else None
            full = sum(g.size for g in at_segs)
            if size is not None and is_static(size[dim]) and size[dim] != -1:
                self._set_view_size(n, size, dim, full, Sharding(dim, at_segs).local_size)
            self.region.specs[n] = Sharding(dim, at_segs)
        return True

    def _split_from(self, view: fx.Node, src: fx.Node, d: int) -> tuple[list[int], int]:
        """([the dim of ``src``], k) where ``view`` splits that one dim into dims whose first (size > 1) is ``d``
        and whose others multiply to k (each element of ``d`` is k contiguous elements of ``src``); else ([], 1)."""
        if kind_of(view.target) != "view":
            return [], 1
        src_shape, dst = self.fp.shape(src), self.fp.shape(view)
        for gi, gj in view_groups(src_shape, dst):
            real_i, real_j = [i for i in gi if src_shape[i] != 1], [j for j in gj if dst[j] != 1]
            if d in gj and len(real_i) == 1 and real_j and real_j[0] == d and all(is_static(dst[j]) for j in gj):
                return real_i, math.prod(dst[j] for j in real_j[1:])
        return [], 1

    def _gathered_parameter(self, x: fx.Node) -> tuple[fx.Node, int] | None:
        """(P, leading dims) for ``P[ids]``, a parameter's rows picked by replicated indices (an expert's bias for
        each token slot), read by nothing else."""
        if kind_of(x.target) == "index" and self._parameter(x.args[0]) is not None and len(x.args[1]) == 1 \
                and isinstance(x.args[1][0], fx.Node) and self.spec(x.args[1][0]) is None and len(x.users) == 1:
            return x.args[0], ndim_of(x.args[1][0])
        return None

    def _state(self, x: fx.Node) -> str | None:
        """"parameter" or "buffer" for a module tensor read by ``x``: looked up in its own module, not by
        listing the graph's (which would cost every region the whole model's names)."""
        gm = x.graph.owning_module if x.op == "get_attr" else None
        if gm is None:
            return None
        path, _, leaf = x.target.rpartition(".")
        try:
            mod = gm.get_submodule(path) if path else gm
        except AttributeError:
            return None
        return "parameter" if leaf in mod._parameters else "buffer" if leaf in mod._buffers else None

    def _parameter(self, x: fx.Node) -> str | None:
        return x.target if self._state(x) == "parameter" else None

    def _learned(self, x: fx.Node) -> bool:
        """Whether ``x`` is computed from a parameter outside this region (so it needs a gradient that no
        collective of the region already carries)."""
        # an integer or boolean value (topk's indices, a mask of the keys they choose) carries no gradient
        return reaches(x, lambda n: self._parameter(n) is not None,
                       lambda n: n in self.region.specs or n in self.region.stats or _discrete(n))

def _row_input(p: Propagator, row: fx.Node, x: fx.Node, x_dim: int, fp: Fingerprinter, tp: int, where: str
               ) -> Sharding:
    """How a row-parallel matmul's input ``x`` is cut on the dim it contracts; Unshardable where it is not."""
    rs = p.spec(x)
    if rs is not None and rs.outer and rs.inner is None and rs.group is None and is_static(fp.shape(x)[rs.dim]):
        # heads cut with a stride (grouped-query attention over kv heads repeated head-minor): the row's input
        # features are [n_rep whole, this rank's heads]; its weight's rows are cut alike
        rs = strided(rs, fp.shape(x)[rs.dim])
    if rs is None or rs.dim != x_dim % ndim_of(x) or rs.inner or rs.outer:
        raise Unshardable(row, "the row-parallel input is not sharded on its contracted dim")
    copies = max(r.copies for r in local_runs(rs.segments, tp))
    if copies > 1:
        # heads fewer than ranks reach the row matmul: the ranks holding a copy would each add it
        raise ShardingError(f"{where}: the {sum(g.size for g in rs.segments)} features entering the row-parallel "
                            f"matmul come in {tp // copies} blocks of heads, fewer than "
                            f"tp={tp}", hint="choose a tp that divides the number of query heads")
    return rs


def _between(region: PairRegion, x: fx.Node) -> set[fx.Node]:
    """The replicated values ``x`` is computed from after the region's reducing projections (``x`` included; empty
    where it reads none of them)."""
    seen, todo = set(), [x]
    while todo and region.reduced:  # what x is computed from, up to the reductions; shapes and masks carry nothing
        n = todo.pop()
        if n in seen or n in region.specs or _discrete(n) or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        seen.add(n)
        if n not in region.reduced:
            todo += n.all_input_nodes
    index = {n: i for i, n in enumerate(x.graph.nodes)}
    after: set[fx.Node] = set()
    for n in sorted(seen, key=index.__getitem__):
        if n not in region.reduced and any(a in region.reduced or a in after for a in n.all_input_nodes):
            after.add(n)
    return after


def _discrete(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and not (val.dtype.is_floating_point or val.dtype.is_complex)


def _operand(node: fx.Node, s: Sharding | None) -> Operand:
    val = node.meta["val"]
    shape = tuple(d if isinstance(d, int) else d.node.hint for d in val.shape)
    return Operand(shape, val.dtype, None if s is None else s.dim)


def propagate(columns: dict[fx.Node, Sharding], row: fx.Node, row_x: fx.Node, fp: Fingerprinter, tp: int,
              where: str, x_dim: int = -1, reduces: dict[fx.Node, tuple[fx.Node, int]] | None = None,
              sides: dict[fx.Node, tuple[fx.Node, int]] | None = None, shared: SharedValues | None = None
              ) -> PairRegion:
    """Propagate the column shardings to ``row`` (which contracts ``x_dim`` of ``row_x``); raise
    :class:`Unshardable` if the region leaks. ``reduces``: parameter matmuls inside the region (node -> its
    input and the dim it contracts) that reduce a channel-cut value, as Mamba's Δ/B/C projection does: each
    is row-parallel, its output completed by one all-reduce forward and backward (a ``sum`` statistic) and
    read whole after it, also by the columns its output feeds (``dt_proj``). ``sides``: other parameter
    matmuls (node -> input, contracted dim) where sharded values end as they do at ``row``: a parallel
    block's feed-forward output projection reading the ``ff`` segment of the one fused ``q | k | v | ff``
    column; each is row-parallel, its partial output completed by g (``PairRegion.sides``). ``shared``: values
    earlier regions cut that this one reads cut, and the embedding columns whose values may leave the region cut
    (``PairRegion.shared``)."""
    reduces, sides = reduces or {}, sides or {}
    shared = shared or SharedValues({}, frozenset())
    p = Propagator(fp, tp, where)
    p.region.specs.update(columns)
    seeds = {n: s for n, s in shared.seeds.items() if n not in columns}
    p.region.specs.update(seeds)  # read as they were cut; each one's other readers are their own regions'
    started = False
    for node in row.graph.nodes:
        if node in columns:
            started = True
            continue
        if not started or node.op != "call_function":
            continue
        if node is row:
            if sides.keys() <= p.region.sides.keys():
                break
            continue  # a side row after it (the feed-forward's output projection after attention's)
        if node in sides:
            x, d = sides[node]
            p.region.sides[node] = _row_input(p, node, x, d, fp, tp, where)
            continue
        if node in reduces:
            x, d = reduces[node]
            s = p.spec(x)
            if s is None or s.dim != d % ndim_of(x) or s.inner or s.outer or s.group:
                raise Unshardable(node, "the reducing projection's input is not sharded on its contracted dim")
            copies = {r.copies for r in local_runs(s.segments, tp)}
            if len(copies) != 1:
                raise Unshardable(node, "the reducing projection's input has blocks held by different numbers of ranks")
            # kv heads fewer than tp (Doge's gate of 2 kv heads at tp 4): each block's partial sum is on
            # ``copies`` ranks, counted once; its weight's copies have their gradients summed
            p.region.stats[node] = StatFact("sum", 1.0 / copies.pop())
            p.region.reduced[node] = s
            continue
        if any(isinstance(a, fx.Node) and a in p.region.specs for a in node.all_input_nodes):
            p.visit(node)
    p.check_functions()
    p.region.row_input = _row_input(p, row, row_x, x_dim, fp, tp, where)
    for x in p.region.params:
        # a buffer sharded with the heads must be read nowhere else; a parameter read by other blocks too (a layer
        # applied again in a loop) is checked once every pair is found: each reader in a pair, all cut alike
        if p._parameter(x.node) is None and any(u not in p.region.specs and u not in p.region.stats
                                                for u in x.node.users):
            raise Unshardable(x.node, f"{x.node.target} spans the sharded dim and is also used outside {where}")
    mine = frozenset(c for c in columns if c in shared.embeddings)
    for n in list(p.region.specs):
        if n in seeds:
            continue
        for u in n.users:
            rule = op_rule(u.target)
            kind = rule.kind if rule is not None else None
            if u in p.region.specs or u in p.region.stats or u is row or u in p.region.sides or kind == "no_output" \
                    or is_guard(u):
                continue
            if kind == "sym_size" or (rule is not None and rule.dtype_arg is not None
                                      and all(a is not n for i, a in enumerate(u.args) if i != rule.dtype_arg)):
                continue  # reads a size or the dtype
            if kind == "getitem" and isinstance(p.region.specs[n], tuple):
                continue
            spec = p.region.specs[n]
            if u.op == "output" and isinstance(spec, Sharding) and spec.inner is None and not spec.outer:
                # returned to the caller (e.g. the keys and values of a KV cache): gathered when read
                if n not in p.region.outputs:
                    p.region.outputs.append(n)
                continue
            if mine and isinstance(spec, Sharding) and from_alone(n, mine, p.region.specs):
                p.region.shared[n] = spec  # read by a later region, cut alike (checked once all pairs are found)
                continue
            raise Unshardable(u, f"sharded value {n.name} escapes the region")
    for n in seeds:
        del p.region.specs[n]
    return p.region
