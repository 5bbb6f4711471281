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

from autotp.errors import ShardingError
from autotp.analysis.ops import (FACTORIES, NO_OUTPUT, NORMS, RANDOM_P_ARG, REDUCTIONS, SAME_SHAPE, SOFTMAX, SPLITS, STAT_KINDS,
                        VIEWS, Rewrite, Unshardable, arg_of, is_guard, legacy_empty, ndim_of, reduction_args,
                        slice_range, split_dims, unflattened_sequence_of_one)
from autotp.analysis.shapes import Fingerprinter, is_static, normalize_dim, view_groups
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


class _Propagator:
    def __init__(self, fp: Fingerprinter, tp: int, where: str):
        self.fp = fp
        self.tp = tp
        self.where = where
        self.region = Region()
        self._kinds: dict[str, str] | None = None

    # -- helpers ---------------------------------------------------------------------------------
    def spec(self, x: object) -> Sharding | None:
        s = self.region.specs.get(x) if isinstance(x, fx.Node) else None
        return s if isinstance(s, Sharding) else None

    def rewrite(self, node: fx.Node, arg: int, index: int | None, old: int, new: int) -> None:
        if old != new:
            self.region.rewrites.append(Rewrite(node.name, arg, index, old, new))

    # -- rules -----------------------------------------------------------------------------------
    def visit(self, node: fx.Node) -> None:
        t = node.target
        if t in NO_OUTPUT:
            return
        grouped = [self.spec(a) for a in node.all_input_nodes if self.spec(a) is not None and self.spec(a).group]
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
        elif t in (aten.transpose.int, aten.t.default, aten.numpy_T.default, aten.permute.default,
                   aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            self.region.specs[node] = self.move(node)
        elif t is aten.slice.Tensor:
            self.region.specs[node] = self.slice(node)
        elif t is aten.flatten.using_ints:
            self.region.specs[node] = self.flatten(node)
        elif t is aten.select.int:
            s = self.spec(node.args[0])
            d = normalize_dim(node.args[1], ndim_of(node.args[0]))
            if d == s.dim or (s.inner and d == s.inner[0]):
                raise Unshardable(node, "select on the sharded dim")
            self.region.specs[node] = s.moved(s.dim - (d < s.dim), None if not s.inner else s.inner[0] - (d < s.inner[0]))
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
        elif t in (aten.index_put_.default, aten.index_put.default):
            self.region.specs[node] = self.index_put(node, node.args[0], node.args[1], node.args[2])
        elif t in (aten.index_copy_.default, aten.index_copy.default):  # cache.index_copy_(2, pos, k)
            d = normalize_dim(node.args[1], ndim_of(node))
            self.region.specs[node] = self.index_put(node, node.args[0], [None] * d + [node.args[2]], node.args[3])
        elif t is aten.scaled_dot_product_attention.default:
            self.region.specs[node] = self.sdpa(node)
        else:
            raise Unshardable(node, f"no sharding rule for {t}")

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
        if x.target in FACTORIES and len(x.users) == 1:
            self._set_view_size(x, list(x.args[0]), xd, sum(g.size for g in s.segments), s.local_size, arg=0)
            return
        if self._learned(x):
            raise Unshardable(node, f"replicated operand {x.name} spans the sharded dim and depends on a parameter")
        self.region.slices.append((node, x, xd, s))

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
        seen, todo = set(), [x]
        while todo:
            n = todo.pop()
            if n in seen or n in self.region.specs or n in self.region.stats:
                continue
            seen.add(n)
            if self._parameter(n) is not None:
                return True
            todo.extend(n.all_input_nodes)
        return False

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

    def repeat_interleave(self, node: fx.Node) -> Sharding:
        """``k.repeat_interleave(n_rep, dim=1)`` (grouped-query kv heads to query heads): each rank repeats its
        own kv heads; where kv heads are fewer than tp, a rank holds one and repeats it for its q heads only."""
        s = self.spec(node.args[0])
        reps, d = node.args[1], arg_of(node, 2, "dim", None)
        if d is None or s.inner or s.outer or arg_of(node, 3, "output_size", None) is not None:
            raise Unshardable(node, "repeat_interleave of a flattened or merged sharded tensor")
        if normalize_dim(d, ndim_of(node)) != s.dim:
            return s
        seg = s.single()
        q = self.tp // seg.parts if seg else 0
        if seg is None or not is_static(reps) or reps % q:
            raise Unshardable(node, "repeat_interleave of the sharded dim that does not split by rank")
        self.rewrite(node, 1, None, reps, reps // q)
        return Sharding(s.dim, (Segment(seg.size * reps, self.tp),))

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

    def stack(self, node: fx.Node) -> Sharding:
        tensors = node.args[0]
        specs = {self.spec(x) for x in tensors}
        if len(specs) != 1 or None in specs:
            raise Unshardable(node, "stack of tensors sharded differently")
        s = specs.pop()
        d = normalize_dim(arg_of(node, 1, "dim", 0), ndim_of(node))
        shift = lambda x: x + (x >= d)  # noqa: E731 - a new dim at d
        return s.moved(shift(s.dim), None if not s.inner else shift(s.inner[0]))

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

    def move(self, node: fx.Node) -> Sharding:
        s = self.spec(node.args[0])
        nd_in, nd_out = ndim_of(node.args[0]), ndim_of(node)
        t = node.target
        if t in (aten.transpose.int, aten.t.default, aten.numpy_T.default, aten.permute.default):
            if t is aten.permute.default:
                perm = [normalize_dim(d, nd_in) for d in node.args[1]]
            else:
                perm = list(range(nd_in))
                a, b = (0, 1) if t is not aten.transpose.int else (normalize_dim(node.args[1], nd_in), normalize_dim(node.args[2], nd_in))
                if nd_in >= 2 or t is aten.transpose.int:
                    perm[a], perm[b] = perm[b], perm[a]
            where = {src: dst for dst, src in enumerate(perm)}
            return s.moved(where[s.dim], None if not s.inner else where[s.inner[0]])
        in_shape = self.fp.shape(node.args[0])
        if t is aten.unsqueeze.default:
            d = normalize_dim(node.args[1], nd_out)
            shift = lambda x: x + (x >= d)  # noqa: E731
        else:
            if t is aten.squeeze.default:
                gone = [i for i, n in enumerate(in_shape) if n == 1]
            else:
                dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
                gone = [normalize_dim(d, nd_in) for d in dims if in_shape[normalize_dim(d, nd_in)] == 1]
            shift = lambda x: x - sum(g < x for g in gone)  # noqa: E731
        return s.moved(shift(s.dim), None if not s.inner else shift(s.inner[0]))

    def slice(self, node: fx.Node) -> Sharding:
        s = self.spec(node.args[0])
        d = normalize_dim(arg_of(node, 1, "dim", 0), ndim_of(node.args[0]))
        if d == s.dim or (s.inner and d == s.inner[0]):
            full = self.fp.shape(node.args[0])[d]
            r = slice_range(node, full)
            if r == (0, full):
                return s
            # one whole segment of a fused projection (``qkv[..., q_size:q_size + kv_size]``): its local block
            offset = local = 0
            for seg in s.segments:
                if r == (offset, offset + seg.size) and not s.inner and not s.outer:
                    if r[0] != local:
                        self.rewrite(node, 2, None, arg_of(node, 2, "start", 0), local)
                    end = arg_of(node, 3, "end", None)
                    if is_static(end) and end < full:
                        self.rewrite(node, 3, None, end, local + seg.local())
                    return Sharding(d, (seg,))
                offset, local = offset + seg.size, local + seg.local()
            raise Unshardable(node, "a partial slice of the sharded dim")
        return s

    def flatten(self, node: fx.Node) -> Sharding:
        s = self.spec(node.args[0])
        nd = ndim_of(node.args[0])
        start, end = normalize_dim(arg_of(node, 1, "start_dim", 0), nd), normalize_dim(arg_of(node, 2, "end_dim", -1), nd)
        if end > start and (start <= s.dim <= end or (s.inner and start <= s.inner[0] <= end)):
            src = self.fp.shape(node.args[0])  # merges like the equivalent view, which has no sizes to rewrite
            gi = [i for i in range(start, end + 1) if src[i] != 1 or i == s.dim]
            return self._view_merge(node, s, None, src, self.fp.shape(node), gi, start)
        shift = lambda x: x - (end - start) if x > end else x  # noqa: E731
        return s.moved(shift(s.dim), None if not s.inner else shift(s.inner[0]))

    def view(self, node: fx.Node) -> Sharding:
        s = self.spec(node.args[0])
        src, dst = self.fp.shape(node.args[0]), self.fp.shape(node)
        shape_arg = list(node.args[1])
        for gi, gj in view_groups(src, dst):
            if s.dim not in gi:
                if s.inner and s.inner[0] in gi:
                    raise Unshardable(node, "view regroups the broadcast dim of replicated heads")
                continue
            gi_real = [i for i in gi if src[i] != 1 or i == s.dim]
            gj_real = split_dims(gj, dst)
            if s.outer:
                return self._view_outer(node, s, shape_arg, dst, gi_real, gj_real)
            if len(gi_real) == 1 and unflattened_sequence_of_one(gj_real, dst, src[s.dim]):
                gj_real = gj_real[1:]
            if len(gi_real) == 1 and len(gj_real) == 1:  # the sharded dim passes through
                j = gj_real[0]
                if s.inner:
                    raise Unshardable(node, "view moves replicated heads")
                if is_static(shape_arg[j]):  # the local size itself (a padded vocab's too)
                    if shape_arg[j] != -1:
                        self.rewrite(node, 1, j, shape_arg[j], s.local_size)
                else:
                    self._set_view_size(node, shape_arg, j, sum(g.size for g in s.segments), s.local_size)
                return s.moved(j)
            if len(gi_real) == 1:  # the sharded dim splits: [.., N, ..] -> [.., n1, n2, ..]
                return self._view_split(node, s, shape_arg, dst, gj_real)
            if len(gj_real) == 1:  # dims merge into the sharded one: [.., a, b, ..] -> [.., a*b, ..]
                return self._view_merge(node, s, shape_arg, src, dst, gi_real, gj_real[0])
            raise Unshardable(node, "view regroups the sharded dim with others")
        raise Unshardable(node, "sharded dim lost in view")

    def _set_view_size(self, node, shape_arg, j, full, local, arg: int = 1) -> None:
        """Scale size ``shape_arg[j]`` by ``local / full``: a constant, or ``x * c`` computed at run time."""
        v = shape_arg[j]
        if is_static(v):
            if v != -1:
                if v * local % full:
                    raise Unshardable(node, f"size {v} does not scale by {local}/{full}")
                self.rewrite(node, arg, j, v, v * local // full)
            return
        c = [a for a in v.args if is_static(a)] if isinstance(v, fx.Node) and v.target is operator.mul else []
        if len(c) != 1 or c[0] * local % full:
            raise Unshardable(node, "the size of the sharded dim is computed at run time")
        self.region.rewrites.append(Rewrite(node.name, arg, j, c[0], c[0] * local // full, v.name))

    def _view_outer(self, node, s, shape_arg, dst, gi, gj) -> Sharding:
        """Views of heads folded under the batch (``[b·h, s, d]``): passed through, or unfolded again."""
        full, local = sum(g.size for g in s.segments), s.local_size
        if len(gi) == 1 and len(gj) == 1:
            self._set_view_size(node, shape_arg, gj[0], full, local)
            return s.moved(gj[0])
        if len(gi) == 1 and len(gj) == 2 and dst[gj[1]] == full:  # [b·h, ..] -> [b, h, ..]
            self._set_view_size(node, shape_arg, gj[1], full, local)
            return Sharding(gj[1], s.segments)
        raise Unshardable(node, "view regroups heads folded under the batch")

    def _view_split(self, node, s, shape_arg, dst, gj) -> Sharding:
        n1 = dst[gj[0]]
        seg = s.single()
        if seg is not None and seg.inner:
            return self._view_groups(node, seg, shape_arg, dst, gj)
        if seg is not None:
            if n1 % seg.parts:
                raise ShardingError(f"{self.where}: {n1} heads are not divisible into {seg.parts} parts (tp={self.tp})",
                                    hint=f"choose a tp that divides {n1}")
            self._set_view_size(node, shape_arg, gj[0], n1, n1 // seg.parts)
            return Sharding(gj[0], (Segment(n1, seg.parts),))
        n2 = dst[gj[-1]] if len(gj) == 2 else 0
        if n2 and not s.inner and all(g.size % n2 == 0 and (g.size // n2) % g.parts == 0 for g in s.segments) \
                and n1 == sum(g.size // n2 for g in s.segments):  # [q heads | k | v] -> [heads, d]
            heads = tuple(Segment(g.size // n2, g.parts) for g in s.segments)
            self._set_view_size(node, shape_arg, gj[0], n1, sum(g.local() for g in heads))
            return Sharding(gj[0], heads)
        k = len(s.segments)
        if n1 == k and len(gj) > 1 and len({x for x in s.segments}) == 1:  # [k segments, heads, d]
            n2 = dst[gj[1]]
            parts = s.segments[0].parts
            if n2 % parts:
                raise ShardingError(f"{self.where}: {n2} heads are not divisible by tp={self.tp}")
            self._set_view_size(node, shape_arg, gj[1], n2, n2 // parts)
            return Sharding(gj[1], (Segment(n2, parts),))
        raise Unshardable(node, "view splits a fused dim across its segments")

    def _view_groups(self, node, seg: Segment, shape_arg, dst, gj) -> Sharding:
        """``[.., G·w] -> [.., G, w/d, d]`` of a grouped segment: each rank's groups, and the per-group dim
        with its inner segments in units of it (q heads, k, v)."""
        width = seg.size // seg.groups
        unit = width // dst[gj[1]] if len(gj) > 1 and width % dst[gj[1]] == 0 else 0
        if dst[gj[0]] != seg.groups or not unit or any(i.size % unit for i in seg.inner):
            raise Unshardable(node, f"view {[dst[j] for j in gj]} cuts across the groups of a fused per-group layout")
        units = tuple(Segment(i.size // unit, i.parts) for i in seg.inner)
        self._set_view_size(node, shape_arg, gj[0], seg.groups, seg.groups // seg.parts)
        self._set_view_size(node, shape_arg, gj[1], dst[gj[1]], sum(u.local() for u in units))
        return Sharding(gj[0], (Segment(seg.groups, seg.parts),), group=(gj[1], units))

    def group_read(self, node: fx.Node, s: Sharding) -> None:
        """Reads of a grouped view: a slice, select or split that picks one inner segment of every group
        gives the q heads (split among the ranks sharing a group), the k or the v head; whole slices of other
        dims keep the layout. Anything else cannot tell q from k and v apart."""
        gd, units = s.group
        t, nd = node.target, ndim_of(node.args[0])
        d = normalize_dim(arg_of(node, 2 if t in SPLITS else 1, "dim", 0), nd) if t in (aten.slice.Tensor, aten.select.int, *SPLITS) else None
        if t is aten.slice.Tensor and d != gd and d != s.dim:
            self.region.specs[node] = s
            return
        if d != gd or t is aten.unbind.int or t is aten.chunk.default:
            raise Unshardable(node, f"{t} of a fused per-group layout before its q, k and v are read apart")
        starts = [sum(u.size for u in units[:i]) for i in range(len(units))]
        local = [sum(u.local() for u in units[:i]) for i in range(len(units))]
        if t in SPLITS:
            sizes = [self.fp.shape(o)[gd] for o in node.meta["val"]]
            if sizes != [u.size for u in units] or t is not aten.split_with_sizes.default:
                raise Unshardable(node, f"split {sizes} of a fused per-group layout {[u.size for u in units]}")
            for i, (old, u) in enumerate(zip(node.args[1], units)):
                self.rewrite(node, 1, i, old, u.local())
            self.region.specs[node] = tuple(self._picked(s, gd, u, keep=True) for u in units)
            return
        full = sum(u.size for u in units)
        if t is aten.select.int:
            i = node.args[2] % full if isinstance(node.args[2], int) else None
            k = starts.index(i) if i in starts else None
            if k is None or units[k].size != 1:
                raise Unshardable(node, "select inside the q heads of a fused per-group layout")
            self.rewrite(node, 2, None, node.args[2], local[k])
            self.region.specs[node] = self._picked(s, gd, units[k], keep=False)
            return
        r = slice_range(node, full)
        k = next((k for k, u in enumerate(units) if r == (starts[k], starts[k] + u.size)), None)
        if k is None:
            raise Unshardable(node, f"slice {r} of a fused per-group layout {[u.size for u in units]}")
        start, end = arg_of(node, 2, "start", None), arg_of(node, 3, "end", None)
        if not isinstance(start, int) or len(node.args) < 3:
            raise Unshardable(node, "a slice of a fused per-group layout without a static start")
        self.rewrite(node, 2, None, start, local[k])
        if is_static(end):
            self.rewrite(node, 3, None, end, local[k] + units[k].local())
        self.region.specs[node] = self._picked(s, gd, units[k], keep=True)

    def _picked(self, s: Sharding, gd: int, u: Segment, keep: bool) -> Sharding:
        """One inner segment of every group: sharded by groups, and where a group is shared by several ranks
        its heads (q) carry the rest of the split on the per-group dim (k and v: held whole there)."""
        copies = self.tp // s.segments[0].parts
        dim = s.dim if keep or gd > s.dim else s.dim - 1
        if keep and copies > 1 and u.parts == copies:
            return Sharding(dim, s.segments, inner=(gd, copies))
        return Sharding(dim, s.segments)

    def _view_merge(self, node, s, shape_arg, src, dst, gi, j) -> Sharding:
        seg = s.single()
        if gi[-1] == s.dim and not s.inner:  # [b, h, ..] -> [b·h, ..]: heads folded under the batch
            if shape_arg is not None:
                self._set_view_size(node, shape_arg, j, seg.size if seg else sum(g.size for g in s.segments), s.local_size)
            return Sharding(j, s.segments, outer=True)
        if seg is None or gi[0] != s.dim:
            raise Unshardable(node, "view merges the sharded dim under another dim")
        parts = seg.parts
        if s.inner:
            if s.inner[0] != s.dim + 1 or s.inner[0] not in gi:
                raise Unshardable(node, "replicated heads merged without their repeat dim")
            parts *= s.inner[1]
        merged = dst[j]
        if shape_arg is not None:
            self._set_view_size(node, shape_arg, j, merged, merged // parts)
        return Sharding(j, (Segment(merged, parts),))

    def expand(self, node: fx.Node) -> Sharding:
        s = self.spec(node.args[0])
        if s.outer:
            raise Unshardable(node, "expand of heads folded under the batch")
        sizes = list(node.args[1])
        off = len(sizes) - ndim_of(node.args[0])
        in_shape = self.fp.shape(node.args[0])
        d = s.dim + off
        seg = s.single()
        if seg is not None and seg.size == 1 and in_shape[d - off] == 1 and is_static(sizes[d]) and sizes[d] > 1:
            # one kv head (multi-query) expanded to the query heads: each rank expands to its own q heads
            if sizes[d] % self.tp:
                raise Unshardable(node, f"{sizes[d]} heads are not divisible by tp={self.tp}")
            self.rewrite(node, 1, d, sizes[d], sizes[d] // self.tp)
            return Sharding(d, (Segment(sizes[d], self.tp),))
        if is_static(sizes[d]) and sizes[d] != -1:
            self.rewrite(node, 1, d, sizes[d], s.local_size)
        if seg is not None and seg.parts < self.tp and s.inner is None:
            # replicated kv heads: the repeat dim right after the heads carries the rest of the split
            e = d + 1
            q = self.tp // seg.parts
            if e < len(sizes) and in_shape[e - off] == 1 and is_static(sizes[e]) and sizes[e] > 1:
                if sizes[e] % q:
                    raise ShardingError(f"{self.where}: repeat of {sizes[e]} kv groups is not divisible by {q}")
                self.rewrite(node, 1, e, sizes[e], sizes[e] // q)
                return Sharding(d, s.segments, (e, q))
        return s.moved(d, None if not s.inner else s.inner[0] + off)

    def split(self, node: fx.Node) -> tuple[Sharding | None, ...]:
        s = self.spec(node.args[0])
        t = node.target
        nd = ndim_of(node.args[0])
        dim_idx = 1 if t is aten.unbind.int else 2
        d = normalize_dim(arg_of(node, dim_idx, "dim", 0), nd)
        outs = node.meta["val"]
        if d != s.dim and not (s.inner and d == s.inner[0]):
            return tuple(s for _ in outs)
        if t is aten.unbind.int or s.inner or s.outer:
            raise Unshardable(node, "unbind of the sharded dim")
        sizes = [self.fp.shape(o)[d] for o in outs]
        if t is aten.chunk.default and len(s.segments) == 1:
            # equal chunks of a contiguous shard would mix ranks' blocks; segments must follow the chunks
            raise Unshardable(node, "chunk of a contiguously sharded dim")
        if tuple(sizes) != tuple(g.size for g in s.segments):
            raise Unshardable(node, f"split sizes {sizes} do not follow the segments {[g.size for g in s.segments]}")
        local = [g.local() for g in s.segments]
        if t is aten.split.Tensor and len(set(local)) == 1:
            self.rewrite(node, 1, None, node.args[1], local[0])
        elif t in (aten.split_with_sizes.default, aten.split.sizes):
            for i, (old, new) in enumerate(zip(node.args[1], local)):
                self.rewrite(node, 1, i, old, new)
        elif t is not aten.chunk.default:
            raise Unshardable(node, f"{t} of the sharded dim with unequal local segments")
        return tuple(Sharding(d, (g,)) for g in s.segments)

    def cat(self, node: fx.Node) -> Sharding:
        # torch.cat skips 1-D empty tensors (a cache's lazily made ``torch.tensor([])``): they take no part
        tensors = [x for x in node.args[0] if not legacy_empty(x)]
        d = normalize_dim(arg_of(node, 1, "dim", 0), ndim_of(node))
        specs = {self.spec(x) for x in tensors} - {None}
        if len(specs) != 1:
            raise Unshardable(node, "cat of tensors sharded differently")
        s = specs.pop()
        for x in tensors:
            if self.spec(x) is None:
                self._local_input(node, x, s)
        if d == s.dim or (s.inner and d == s.inner[0]):
            raise Unshardable(node, "cat along the sharded dim")
        return s

    def _local_input(self, node: fx.Node, x: object, s: Sharding) -> None:
        """A replicated graph input concatenated with a sharded value (a KV cache's past keys and the new
        ones) is taken as this rank's shard of it: the cache the graph returned last call, kept local."""
        if not (isinstance(x, fx.Node) and x.op == "placeholder" and ndim_of(x) == ndim_of(node)) or s.inner or s.outer:
            raise Unshardable(node, "cat of sharded and replicated tensors")
        for u in x.users:
            if u is not node and not is_guard(u) \
                    and not (u.target is aten.sym_size.int and normalize_dim(u.args[1], ndim_of(x)) != s.dim):
                raise Unshardable(node, f"graph input {x.name} is concatenated with a sharded value and used whole")
        self.region.specs[x] = s
        self.region.inputs.append(x)

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
        q, k, v = node.args[:3]
        mask = arg_of(node, 3, "attn_mask", None)
        gqa = bool(node.kwargs.get("enable_gqa", False))
        sq, sk, sv = self.spec(q), self.spec(k), self.spec(v)
        if sq is None or sk is None or sv is None:
            raise Unshardable(node, "attention with replicated q, k or v")
        nd = ndim_of(q)
        if sq.dim != nd - 3 or sk.dim != nd - 3 or sv.dim != nd - 3 or sk != sv:
            raise Unshardable(node, "attention not sharded by heads")
        if sq != sk and not gqa:
            raise Unshardable(node, f"q and k heads sharded differently: {sq} vs {sk}")
        if sq.inner or sk.inner:
            raise Unshardable(node, "attention over unmerged replicated heads")
        ops = [q] + ([mask] if isinstance(mask, fx.Node) else [])
        return self.batched(node, ops, 2)


def propagate(columns: dict[fx.Node, Sharding], row: fx.Node, row_x: fx.Node, fp: Fingerprinter, tp: int,
              where: str) -> Region:
    """Propagate the column shardings to ``row``; raise :class:`Unshardable` if the region leaks."""
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
    if rs is None or rs.dim != ndim_of(row_x) - 1 or rs.inner or rs.outer:
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
            if u.target is aten.sym_size.int:
                continue
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
