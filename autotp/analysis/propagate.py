"""Sharding propagation through the region between column-parallel and row-parallel matmuls.

Starting from the outputs of the column matmuls (sharded on their last dim), every node that consumes a
sharded value gets a :class:`Sharding` by a rule for its op; the rule also records which integer
constants of the node change (a view's head count, a split's sizes, an expand's repeat count). The region
is valid when every sharded value ends at the row matmul, contracted on its last dim. Anything else —
an op with no rule, a reduction over the sharded dim, a sharded value that escapes — raises
:class:`Unshardable`, and the caller replicates the pair instead of guessing.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autotp.analysis.ops import (FACTORIES, NO_OUTPUT, NORMS, RANDOM_P_ARG, REDUCTIONS, SAME_SHAPE, SOFTMAX, SPLITS,
                                 STAT_KINDS, TRANSPOSES, VIEWS, Rewrite, Unshardable, arg_of, held_whole, is_guard,
                                 ndim_of, reaches, reduction_args)
from autotp.analysis.shape_rules import ShapeRules
from autotp.analysis.shapes import Fingerprinter, is_static, normalize_dim
from autotp.errors import ShardingError
from autotp.plan.shard_spec import Segment, Sharding

aten = torch.ops.aten


@dataclass
class Region:
    specs: dict[fx.Node, Sharding | tuple[Sharding | None, ...]] = field(default_factory=dict)
    rewrites: list[Rewrite] = field(default_factory=list)
    random_nodes: list[fx.Node] = field(default_factory=list)
    row_input: Sharding | None = None
    outputs: list[fx.Node] = field(default_factory=list)  # sharded values the graph returns (a KV cache)
    inputs: list[fx.Node] = field(default_factory=list)  # graph inputs taken as local shards (a KV cache)
    # replicated operands cut to this rank's slice where a sharded value meets them (per-head constants):
    # (consumer, operand, operand dim, segments)
    slices: list[tuple[fx.Node, fx.Node, int, tuple[Segment, ...]]] = field(default_factory=list)
    # replicated operands computed from parameters, used with sharded values: their gradient comes back
    # partial on each rank, so they get Megatron's f (all-reduce backward): (consumer, operand)
    entering: list[tuple[fx.Node, fx.Node]] = field(default_factory=list)
    # statistics over the sharded dim (a norm over the whole projection width): each rank reduces its own
    # slice, one all-reduce of the b·s statistics completes them: node -> (kind, scale of the sum)
    stats: dict[fx.Node, tuple[str, float]] = field(default_factory=dict)
    # parameters that span the sharded dim (that norm's weight) are sharded with it, and so are buffers that
    # sharded values are written into (a KV cache): (get_attr, dim, sharding)
    params: list[tuple[fx.Node, int, Sharding]] = field(default_factory=list)


# what a per-head parameter passes through on its way to meet the heads
_PARAM_VIEWS = {aten.view.default, aten.reshape.default, aten.expand.default, aten.unsqueeze.default,
                aten._unsafe_view.default}


class _Propagator(ShapeRules):
    def __init__(self, fp: Fingerprinter, tp: int, where: str):
        self.fp = fp
        self.tp = tp
        self.where = where
        self.region = Region()
        self._kinds: dict[str, str] | None = None
        self._broadcast: frozenset[fx.Node] = frozenset()  # operands of the node being visited read as replicated

    # -- helpers ---------------------------------------------------------------------------------
    def spec(self, x: object) -> Sharding | None:
        s = self.region.specs.get(x) if isinstance(x, fx.Node) and x not in self._broadcast else None
        return s if isinstance(s, Sharding) else None

    def rewrite(self, node: fx.Node, arg: int, index: int | None, old: int, new: int) -> None:
        if old != new:
            self.region.rewrites.append(Rewrite(node.name, arg, index, old, new))

    # -- rules -----------------------------------------------------------------------------------
    def visit(self, node: fx.Node) -> None:
        if node.target in NO_OUTPUT:
            return
        self._broadcast = self.broadcast_whole(node)
        try:
            self._visit(node)
        finally:
            self._broadcast = frozenset()

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

    def _visit(self, node: fx.Node) -> None:
        t = node.target
        grouped = [s for a in node.all_input_nodes if (s := self.spec(a)) is not None and s.group]
        if grouped:
            return self.group_read(node, grouped[0])
        if t is aten.sym_size.int:
            s = self.spec(node.args[0])
            if s is not None and normalize_dim(node.args[1], ndim_of(node.args[0])) in (s.dim, (s.inner or (None,))[0]):
                raise Unshardable(node, "the size of the sharded dim is read at run time")
            return
        if t is operator.getitem:
            parent = self.region.specs.get(node.args[0])
            if isinstance(parent, tuple):
                out = parent[node.args[1]]
                if out is not None:
                    self.region.specs[node] = out
                return
            raise Unshardable(node, "indexing a sharded tensor")
        if t in RANDOM_P_ARG:
            p = arg_of(node, RANDOM_P_ARG[t], "dropout_p" if t is aten.scaled_dot_product_attention.default else "p", 0.0)
            if not (isinstance(p, (int, float)) and p == 0):
                self.region.random_nodes.append(node)
        if t is aten.type_as.default and self.spec(node.args[0]) is None:
            return  # reads only the dtype of the sharded value (``W.type_as(x)``: a weight cast for the matmul)
        if t in SAME_SHAPE or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags):
            self.region.specs[node] = self.pointwise(node)
        elif t in SOFTMAX:
            s = self.spec(node.args[0])
            if normalize_dim(node.args[1], ndim_of(node)) == s.dim:
                raise Unshardable(node, "softmax over the sharded dim")
            self.region.specs[node] = s
        elif t in VIEWS:
            self.region.specs[node] = self.view(node)
        elif t is aten.expand.default or (t is aten.broadcast_to.default and self.spec(node.args[0]) is not None):
            self.region.specs[node] = self.expand(node)
        elif t in (aten.expand_as.default, aten.broadcast_to.default):  # a replicated value broadcast to sharded
            self.region.specs[node] = self.pointwise(node)
        elif t in TRANSPOSES or t in (aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                                      aten.squeeze.default):
            self.region.specs[node] = self.move(node)
        elif t is aten.slice.Tensor:
            self.region.specs[node] = self.slice(node)
        elif t is aten.flatten.using_ints:
            self.region.specs[node] = self.flatten(node)
        elif t is aten.select.int:
            self.region.specs[node] = self.select(node)
        elif t in SPLITS:
            self.region.specs[node] = self.split(node)
        elif t is aten.cat.default:
            self.region.specs[node] = self.cat(node)
        elif t is aten.stack.default:
            self.region.specs[node] = self.stack(node)
        elif t in (aten.view_as_complex.default, aten.view_as_real.default):
            sp = self.spec(node.args[0])
            if sp.inner or (t is aten.view_as_complex.default and sp.dim == ndim_of(node.args[0]) - 1):
                raise Unshardable(node, "complex view of the sharded dim")
            self.region.specs[node] = sp
        elif t in REDUCTIONS:
            out = self.reduction(node)
            if out is not None:
                self.region.specs[node] = out
        elif t in NORMS:
            self.region.specs[node] = self.norm(node)
        elif t in (aten.matmul.default, aten.bmm.default):
            self.region.specs[node] = self.batched(node, [node.args[0], node.args[1]], 2)
        elif t is aten.baddbmm.default:
            self.region.specs[node] = self.baddbmm(node)
        elif t is aten.repeat_interleave.self_int:
            self.region.specs[node] = self.repeat_interleave(node)
        elif t is aten.repeat.default:
            self.region.specs[node] = self.repeat(node)
        elif t in (aten.index_put_.default, aten.index_put.default):
            self.region.specs[node] = self.index_put(node, node.args[0], node.args[1], node.args[2])
        elif t in (aten.index_copy_.default, aten.index_copy.default):  # cache.index_copy_(2, pos, k)
            d = normalize_dim(node.args[1], ndim_of(node))
            self.region.specs[node] = self.index_put(node, node.args[0], [None] * d + [node.args[2]], node.args[3])
        elif t is aten.scaled_dot_product_attention.default:
            self.region.specs[node] = self.sdpa(node)
        elif t in (aten.max.dim, aten.min.dim):  # (values, indices) along an unsharded dim: softmax's shift
            sp, nd = self.spec(node.args[0]), ndim_of(node.args[0])
            d, keep = normalize_dim(node.args[1], nd), arg_of(node, 2, "keepdim", False)
            if d == sp.dim or sp.inner:
                raise Unshardable(node, f"{t} over the sharded dim")
            out = sp if keep else sp.moved(sp.dim - (d < sp.dim))
            self.region.specs[node] = (out, out)
        elif t in (aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default):
            self.region.specs[node] = self.new_like(node)
        elif t is aten.copy_.default:
            self.region.specs[node] = self.copy_into(node)
        else:
            raise Unshardable(node, f"no sharding rule for {t}")

    def new_like(self, node: fx.Node) -> Sharding:
        """``x.new_empty([b, n, s, d])`` of a tensor sharded by heads on dim ``i``, with ``n`` its heads: a
        buffer of this rank's heads (DeepSeek's key, filled by in-place copies of the per-head parts)."""
        s, size = self.spec(node.args[0]), list(node.args[1])
        full = sum(g.size for g in s.segments)
        if s.inner or s.outer or len(size) != ndim_of(node.args[0]) or not is_static(size[s.dim]) \
                or size[s.dim] != self.fp.shape(node.args[0])[s.dim]:
            raise Unshardable(node, "a new tensor whose sharded dim is not its input's")
        self._set_view_size(node, size, s.dim, full, s.local_size)
        return s

    def copy_into(self, node: fx.Node) -> Sharding:
        """``dst.copy_(src)`` into a sharded buffer (or a slice of it): the source sharded alike; or one head
        broadcast to all (``k_rot.expand(-1, n, -1, -1)``, a part shared by the heads) that each rank expands
        to its own heads, its gradient then summed over the ranks (f)."""
        dst, src = node.args[:2]
        sd, ss = self.spec(dst), self.spec(src)
        if sd is None:
            raise Unshardable(node, "a sharded value copied into a replicated tensor")
        if ss is not None:
            if ss != sd:
                raise Unshardable(node, f"operands sharded differently: {sd} vs {ss}")
            return sd
        if ndim_of(src) != ndim_of(dst) or not self.expanded_head(src, sd):
            self._replicated_operand(node, src, sd)
        return sd

    def expanded_head(self, x: object, s: Sharding) -> bool:
        """``k_rot.expand(-1, n, -1, -1)``: one replicated head (a rotary key part shared by all heads) expanded
        to all heads, read only where it meets heads sharded by ``s``: each rank expands it to its own heads
        (the expand's size rewritten), and its gradient, partial on each rank, is summed (f)."""
        if not (isinstance(x, fx.Node) and x.target is aten.expand.default and len(x.users) == 1) \
                or s.inner or s.outer or ndim_of(x) != ndim_of(x.args[0]) or self.fp.shape(x.args[0])[s.dim] != 1:
            return False
        self._set_view_size(x, list(x.args[1]), s.dim, sum(g.size for g in s.segments), s.local_size)
        self._enter_if_learned(x, x.args[0])
        return True

    def pointwise(self, node: fx.Node) -> Sharding:
        out_nd = ndim_of(node)
        result: Sharding | None = None
        for a in [*node.args, *node.kwargs.values()]:
            for x in (a if isinstance(a, (list, tuple)) else [a]):
                nd = ndim_of(x)
                if nd is None:
                    continue
                off = out_nd - nd
                s = self.spec(x)
                if s is not None:
                    aligned = s.moved(s.dim + off, None if not s.inner else s.inner[0] + off)
                    if result is not None and aligned != result:
                        raise Unshardable(node, f"operands sharded differently: {result} vs {aligned}")
                    result = aligned
        for a in [*node.args, *node.kwargs.values()]:
            for x in (a if isinstance(a, (list, tuple)) else [a]):
                if ndim_of(x) is not None and self.spec(x) is None:
                    self._replicated_operand(node, x, result)
        return result

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
        gradient for it covers only its heads, so it enters through f and its gradient is summed."""
        if self._learned(x) and (node, x) not in self.region.entering:
            self.region.entering.append((node, x))

    def _local_operand(self, node: fx.Node, x: fx.Node, xd: int, s: Sharding) -> None:
        """A replicated operand that spans the sharded dim becomes this rank's slice (Replicate -> Shard, no
        communication): a parameter (a whole-width norm's weight) is sharded itself; a constant-filled
        factory (``zeros(b·heads, s, s)``) is made local-sized; any other value that needs no gradient (ALiBi
        slopes, a mask with a head dim, built from buffers and inputs) is sliced where it is used."""
        if s.inner or xd != s.dim - (ndim_of(node) - ndim_of(x)) or \
                self.fp.shape(x)[xd] != self.fp.shape(node)[s.dim]:
            raise Unshardable(node, f"replicated operand {x.name} spans the sharded dim")
        if self._parameter(x) is not None and not s.outer:
            self.region.params.append((x, xd, s))
            return
        picked = self._gathered_parameter(x)
        if picked is not None and not s.outer and xd >= picked[1]:  # bias[ids]: one expert's bias per slot
            self.region.params.append((picked[0], xd - picked[1] + 1, s))
            self.region.specs[x] = s.moved(xd)
            return
        if self.viewed_parameter(x, s.moved(xd)):
            return
        if x.target in FACTORIES and len(x.users) == 1:
            self._set_view_size(x, list(x.args[0]), xd, sum(g.size for g in s.segments), s.local_size, arg=0)
            return
        if self._learned(x):
            raise Unshardable(node, f"replicated operand {x.name} spans the sharded dim and depends on a parameter")
        self.region.slices.append((node, x, xd, s))

    def viewed_parameter(self, x: object, s: Sharding) -> bool:
        """A parameter with one entry per head, reshaped and expanded to meet the heads on dim ``s.dim`` of
        ``x`` (GPT-OSS's attention sinks: ``sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)`` concatenated
        to the scores): the parameter is sharded with the heads, and the sizes on the way become local."""
        if not isinstance(x, fx.Node) or s.inner or s.outer:
            return False
        full = sum(g.size for g in s.segments)
        chain, node, d = [], x, s.dim
        while node.op == "call_function" and node.target in _PARAM_VIEWS and len(node.users) == 1:
            src = node.args[0]
            at = [i for i, n in enumerate(self.fp.shape(src)) if n == full] if isinstance(src, fx.Node) else []
            if len(at) != 1 or self.fp.shape(node)[d] != full:
                return False
            chain.append((node, d))
            node, d = src, at[0]
        if not chain or self._parameter(node) is None or len(node.users) != 1:
            return False
        for n, dim in chain:
            size = list(n.args[1]) if len(n.args) > 1 and isinstance(n.args[1], (list, tuple)) else None
            if size is not None and is_static(size[dim]) and size[dim] != -1:
                self._set_view_size(n, size, dim, full, s.local_size)
            self.region.specs[n] = Sharding(dim, s.segments)
        self.region.params.append((node, d, Sharding(d, s.segments)))
        return True

    def _gathered_parameter(self, x: fx.Node) -> tuple[fx.Node, int] | None:
        """(P, leading dims) for ``P[ids]``, a parameter's rows picked by replicated indices (an expert's bias for
        each token slot), read by nothing else."""
        if x.target is aten.index.Tensor and self._parameter(x.args[0]) is not None and len(x.args[1]) == 1 \
                and isinstance(x.args[1][0], fx.Node) and self.spec(x.args[1][0]) is None and len(x.users) == 1:
            return x.args[0], ndim_of(x.args[1][0])
        return None

    def _state(self, x: fx.Node) -> str | None:
        """"parameter" or "buffer" for a module tensor read by ``x`` (names looked up once per region)."""
        if x.op != "get_attr":
            return None
        if self._kinds is None:
            gm = x.graph.owning_module
            self._kinds = {} if gm is None else {
                **{n: "buffer" for n, _ in gm.named_buffers(remove_duplicate=False)},
                **{n: "parameter" for n, _ in gm.named_parameters(remove_duplicate=False)}}
        return self._kinds.get(x.target)

    def _parameter(self, x: fx.Node) -> str | None:
        return x.target if self._state(x) == "parameter" else None

    def _learned(self, x: fx.Node) -> bool:
        """Whether ``x`` is computed from a parameter outside this region (so it needs a gradient that no
        collective of the region already carries)."""
        return reaches(x, lambda n: self._parameter(n) is not None,
                       lambda n: n in self.region.specs or n in self.region.stats)

    def _stat_scale(self, node: fx.Node, s: Sharding, kind: str) -> float:
        """Summing the ranks' partial statistics: a mean over the sharded dim is the ranks' mean of means (also
        with blocks held by several ranks, all equal-sized); a sum counts each replicated block once."""
        if s.inner or s.outer or (len(s.segments) > 1 and any(g.parts != self.tp for g in s.segments)):
            raise Unshardable(node, f"{node.target} over a sharded dim of unequal blocks")
        return 1.0 / self.tp if kind != "sum" else s.segments[0].parts / self.tp

    def norm(self, node: fx.Node) -> Sharding:
        """rms_norm / layer_norm: over unsharded dims (per head) it passes the sharding through and its
        weight enters through f; over the sharded dim (the whole projection width) each rank normalises its
        slice with statistics completed by one all-reduce, and the weight is sharded with the heads."""
        s = self.spec(node.args[0])
        nd = ndim_of(node)
        nshape = list(node.args[1])
        first = nd - len(nshape)
        weights = [w for w in node.args[2:4] if isinstance(w, fx.Node)]
        if s.dim < first and not (s.inner and s.inner[0] >= first):
            for w in weights:
                self._enter_if_learned(node, w)
            return s
        self.region.stats[node] = (NORMS[node.target], self._stat_scale(node, s, "mean"))
        wd = s.dim - first
        if is_static(nshape[wd]):
            self.rewrite(node, 1, wd, nshape[wd], nshape[wd] * s.local_size // sum(g.size for g in s.segments))
        for w in weights:
            if self._parameter(w) is None:
                raise Unshardable(node, f"the weight {w.name} of a norm over the sharded dim is not a parameter")
            self.region.params.append((w, wd - (len(nshape) - ndim_of(w)), s))
        return s

    def index_put(self, node: fx.Node, dst: fx.Node, indices: list, values: fx.Node) -> Sharding:
        """``cache[:, :, pos] = k`` (gpt-fast's KV cache), ``cache.index_copy_(2, pos, k)``: sharded keys
        written into a module buffer make the buffer sharded the same way (each rank caches its kv heads)."""
        sd, sv = self.spec(dst), self.spec(values)
        if any(self.spec(i) is not None for i in indices if isinstance(i, fx.Node)):
            raise Unshardable(node, "indexing with a sharded index")
        s = sd or sv
        if s.inner or s.outer or len(indices) > s.dim and indices[s.dim] is not None:
            raise Unshardable(node, "a write that indexes the sharded dim")
        if sv is None or ndim_of(values) != ndim_of(dst):
            raise Unshardable(node, "a replicated value written into a sharded tensor")
        if sd is None:
            if self._state(dst) != "buffer" or self.fp.shape(dst)[s.dim] != sum(g.size for g in s.segments):
                raise Unshardable(node, f"sharded values written into {dst.name}, which is not a module buffer")
            self.region.params.append((dst, s.dim, s))
            self.region.specs[dst] = s
        elif sd != sv:
            raise Unshardable(node, f"operands sharded differently: {sd} vs {sv}")
        return s

    def baddbmm(self, node: fx.Node) -> Sharding:
        inp, b1, b2 = node.args[:3]
        result = self.batched(node, [b1, b2], 2)
        if isinstance(inp, fx.Node):
            si = self.spec(inp)
            if si is None:
                self._replicated_operand(node, inp, result)
            elif si.moved(si.dim + 3 - ndim_of(inp)) != result:
                raise Unshardable(node, f"operands sharded differently: {si} vs {result}")
        return result

    def reduction(self, node: fx.Node) -> Sharding | None:
        s = self.spec(node.args[0])
        nd = ndim_of(node.args[0])
        r = reduction_args(node)
        dims = [normalize_dim(d, nd) for d in (range(nd) if r.dims is None else r.dims)]
        if s.dim in dims or (s.inner and s.inner[0] in dims):
            kind = STAT_KINDS.get(node.target)
            if kind is None or (kind == "norm" and not (isinstance(r.param, (int, float)) and 0 < r.param < float("inf"))):
                raise Unshardable(node, f"{node.target} reduces the sharded dim")
            self.region.stats[node] = (kind, self._stat_scale(node, s, "mean" if kind == "mean" else "sum"))
            return None  # replicated once the statistics are all-reduced
        if r.keepdim:
            return s
        shift = lambda x: x - sum(d < x for d in dims)  # noqa: E731
        return s.moved(shift(s.dim), None if not s.inner else shift(s.inner[0]))

    def batched(self, node: fx.Node, operands: list, core: int) -> Sharding:
        """Matmul-like op: the sharded dim must be a batch dim of the sharded operands."""
        out_nd = ndim_of(node)
        result = None
        for x in operands:
            nd = ndim_of(x)
            s = self.spec(x)
            if s is None:
                continue
            if s.dim >= nd - core or (s.inner and s.inner[0] >= nd - core):
                raise Unshardable(node, "the sharded dim is contracted outside the row-parallel matmul")
            aligned = s.moved(s.dim + out_nd - nd, None if not s.inner else s.inner[0] + out_nd - nd)
            if result is not None and aligned != result:
                raise Unshardable(node, f"operands sharded differently: {result} vs {aligned}")
            result = aligned
        for x in operands:
            nd = ndim_of(x)
            if nd is None or self.spec(x) is not None:
                continue
            xd = result.dim - (out_nd - nd)
            if xd >= 0 and xd < nd - core and self.fp.shape(x)[xd] != 1:
                raise Unshardable(node, f"replicated operand {x.name} spans the sharded batch dim")
            self._enter_if_learned(node, x)
        return result

    def sdpa(self, node: fx.Node) -> Sharding:
        """Attention per head: q, k and v sharded alike by heads; or one k and v head broadcast over the q
        heads (``(b, 1, s, d)``, multi-query), which every rank holds whole."""
        q, k, v = node.args[:3]
        mask = arg_of(node, 3, "attn_mask", None)
        gqa = bool(node.kwargs.get("enable_gqa", False))
        sq, sk, sv = self.spec(q), self.spec(k), self.spec(v)
        nd = ndim_of(q)
        if sq is None:
            raise Unshardable(node, "attention with replicated q")
        broadcast = [x for x, s in ((k, sk), (v, sv)) if s is None]
        if any(self.fp.shape(x)[nd - 3] != 1 for x in broadcast):
            raise Unshardable(node, "attention with replicated k or v of several heads")
        if sq.dim != nd - 3 or any(s is not None and s.dim != nd - 3 for s in (sk, sv)) \
                or (sk is not None and sv is not None and sk != sv):
            raise Unshardable(node, "attention not sharded by heads")
        if sk is not None and sq != sk and not gqa:
            raise Unshardable(node, f"q and k heads sharded differently: {sq} vs {sk}")
        if sq.inner or (sk is not None and sk.inner):
            raise Unshardable(node, "attention over unmerged replicated heads")
        for x in broadcast:
            self._enter_if_learned(node, x)
        ops = [q] + ([mask] if isinstance(mask, fx.Node) else [])
        return self.batched(node, ops, 2)


def propagate(columns: dict[fx.Node, Sharding], row: fx.Node, row_x: fx.Node, fp: Fingerprinter, tp: int,
              where: str, x_dim: int = -1) -> Region:
    """Propagate the column shardings to ``row`` (which contracts ``x_dim`` of ``row_x``); raise
    :class:`Unshardable` if the region leaks."""
    p = _Propagator(fp, tp, where)
    p.region.specs.update(columns)
    started = False
    for node in row.graph.nodes:
        if node in columns:
            started = True
            continue
        if not started or node.op != "call_function":
            continue
        if node is row:
            break
        if any(isinstance(a, fx.Node) and a in p.region.specs for a in node.all_input_nodes):
            p.visit(node)
    rs = p.spec(row_x)
    if rs is None or rs.dim != x_dim % ndim_of(row_x) or rs.inner or rs.outer:
        raise Unshardable(row, "the row-parallel input is not sharded on its contracted dim")
    if any(g.parts < tp for g in rs.segments):
        # heads fewer than ranks reach the row matmul: the ranks holding a copy would each add it
        raise ShardingError(f"{where}: the {sum(g.size for g in rs.segments)} features entering the row-parallel "
                            f"matmul come in {min(g.parts for g in rs.segments)} blocks of heads, fewer than "
                            f"tp={tp}", hint="choose a tp that divides the number of query heads")
    p.region.row_input = rs
    for x, _, _ in p.region.params:
        # a parameter or buffer sharded with the heads must be read nowhere else
        if any(u not in p.region.specs and u not in p.region.stats for u in x.users):
            raise Unshardable(x, f"{x.target} spans the sharded dim and is also used outside {where}")
    for n in list(p.region.specs):
        for u in n.users:
            if u in p.region.specs or u in p.region.stats or u is row or u.target in NO_OUTPUT or is_guard(u):
                continue
            if u.target is aten.sym_size.int or (u.target is aten.type_as.default and u.args[0] is not n):
                continue  # reads a size or the dtype
            if u.target is operator.getitem and isinstance(p.region.specs[n], tuple):
                continue
            spec = p.region.specs[n]
            if u.op == "output" and isinstance(spec, Sharding) and spec.inner is None and not spec.outer:
                # returned to the caller (e.g. the keys and values of a KV cache): gathered when read
                if n not in p.region.outputs:
                    p.region.outputs.append(n)
                continue
            raise Unshardable(u, f"sharded value {n.name} escapes the region")
    return p.region
