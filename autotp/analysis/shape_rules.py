"""Propagation rules for the ops that move, regroup, cut or join the sharded dim: transposes, views (heads
split, merged, folded under the batch, a grouped layout read apart), slices, splits, concatenation, expand
and repeats. Each rule gives the output's :class:`Sharding` and records the integer constants that change
(:class:`~autotp.analysis.ops.Rewrite`). Each ``_on_<kind>`` handler serves one kind of
:mod:`~autotp.analysis.op_rules`; :class:`~autotp.analysis.propagate.Propagator` mixes them in.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from autotp.analysis.op_rules import OpRule, kind_of, op_rule
from autotp.analysis.ops import (Pieces, Unshardable, arg_named, arg_of, held_whole, is_guard, legacy_empty, moved_dim,
                                 ndim_of, slice_range, split_dims, unflattened_sequence_of_one)
from autotp.analysis.shapes import is_static, normalize_dim, view_groups
from autotp.plan.plan import Rewrite
from autotp.errors import ShardingError
from autotp.shard_spec import Segment, Sharding


def _grouped_segments(sizes: list[int], segments: tuple[Segment, ...]) -> tuple[tuple[Segment, ...], ...] | None:
    """The segments each piece of a split holds: consecutive runs whose sizes add up to the pieces' (a fused
    ``q | k | v | ff`` split into 4 where ff is gate | up); None where a piece would cut a segment."""
    pieces, i = [], 0
    for n in sizes:
        run = []
        while i < len(segments) and sum(g.size for g in run) < n:
            run.append(segments[i])
            i += 1
        if sum(g.size for g in run) != n:
            return None
        pieces.append(tuple(run))
    return tuple(pieces) if i == len(segments) else None


class ShapeRules:
    """Rules of :class:`~autotp.analysis.propagate.Propagator` that change where the sharded dim is."""

    def _on_move(self, node: fx.Node, rule: OpRule) -> Sharding:
        """Transposes, unsqueezes and squeezes: the sharded dim (and a repeat dim) go where the op puts them."""
        s, shape = self.spec(node.args[0]), self.fp.shape(node.args[0])
        return s.moved(moved_dim(node, s.dim, shape), None if not s.inner else moved_dim(node, s.inner[0], shape))

    def _on_slice(self, node: fx.Node, rule: OpRule) -> Sharding:
        s = self.spec(node.args[0])
        d = normalize_dim(arg_of(node, 1, "dim", 0), ndim_of(node.args[0]))
        if d == s.dim and held_whole(s) and len(s.segments) == 1 and is_static(self.fp.shape(node)[d]):
            # any slice of one head every rank holds (a multi-query key's rotary part) is held whole alike
            return Sharding(d, (Segment(self.fp.shape(node)[d], 1),))
        if d == s.dim or (s.inner and d == s.inner[0]):
            full = self.fp.shape(node.args[0])[d]
            step = arg_of(node, 4, "step", 1)
            if step != 1:
                return self._strided(node, s, full, step)
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

    def _strided(self, node: fx.Node, s: Sharding, full: int, step: object) -> Sharding:
        """``h[..., 0::2]`` / ``h[..., 1::2]`` of the sharded dim (gate and up interleaved, GPT-OSS's experts):
        each rank's blocks start at a multiple of the step and hold a multiple of it, so the rank's own
        elements of the pick are its local ``0::2`` / ``1::2``."""
        start, end = arg_of(node, 2, "start", 0) or 0, arg_of(node, 3, "end", None)
        ok = is_static(step) and step > 1 and is_static(start) and 0 <= start < step \
            and (end is None or (is_static(end) and end >= full)) and not s.inner and not s.outer \
            and all(g.size % (g.parts * step) == 0 and not g.inner for g in s.segments)
        if not ok:
            raise Unshardable(node, "a strided slice of the sharded dim that does not stay within each rank's block")
        return Sharding(s.dim, tuple(Segment(g.size // step, g.parts) for g in s.segments))

    def _on_select(self, node: fx.Node, rule: OpRule) -> Sharding:
        """``f[:, :, -2]`` of Falcon's ``[b, s, n_heads + 2, d]``: the one k (or v) head, a segment every rank
        holds, at its local position; the result is held whole. A select inside split heads cannot be local."""
        s = self.spec(node.args[0])
        d = normalize_dim(node.args[1], ndim_of(node.args[0]))
        if d != s.dim and not (s.inner and d == s.inner[0]):
            return s.moved(s.dim - (d < s.dim), None if not s.inner else s.inner[0] - (d < s.inner[0]))
        i, full, out = node.args[2], self.fp.shape(node.args[0])[d], self.fp.shape(node)
        offset = local = 0
        for seg in s.segments if isinstance(i, int) and out and not (s.inner or s.outer) else ():
            if offset <= i % full < offset + seg.size and seg.parts == 1 and not seg.inner:
                at = local + i % full - offset
                self.rewrite(node, 2, None, i, at if i >= 0 else at - s.local_size)
                return Sharding(len(out) - 1, (Segment(out[-1], 1),))
            offset, local = offset + seg.size, local + seg.local()
        raise Unshardable(node, "select on the sharded dim")

    def _on_index(self, node: fx.Node, rule: OpRule) -> Sharding | tuple[Sharding | None, ...]:
        """``x[ids]``: rows of a sharded value gathered by replicated indices of the leading dims, none of them
        the sharded dim (attention's output per token slot regrouped by expert, ``(b·s·k, n·d)[order]``): each
        rank gathers the same rows of its own columns; the sharded dim keeps its place after the indexed dims,
        which become the indices' dims. Any other index is torch's rule's to answer."""
        x, indices = node.args[0], node.args[1]
        s = self.spec(x)
        tensors = [i for i in indices if isinstance(i, fx.Node)]
        # integer indices, one per leading dim (a boolean mask reads several dims as one: torch's rule's to answer)
        vals = [i.meta.get("val") for i in tensors]
        ints = all(isinstance(v, torch.Tensor) and not v.dtype.is_floating_point and v.dtype != torch.bool for v in vals)
        if s is None or not tensors or len(tensors) != len(indices) or not ints \
                or any(self.spec(i) is not None for i in tensors) \
                or s.dim < len(indices) or (s.inner and s.inner[0] < len(indices)):
            return self._on_torch(node, rule)
        shift = max(ndim_of(i) for i in tensors) - len(indices)  # the indexed dims, replaced by the indices' dims
        return s.moved(s.dim + shift, None if not s.inner else s.inner[0] + shift)

    def _on_flatten(self, node: fx.Node, rule: OpRule) -> Sharding:
        s = self.spec(node.args[0])
        nd = ndim_of(node.args[0])
        start, end = normalize_dim(arg_of(node, 1, "start_dim", 0), nd), normalize_dim(arg_of(node, 2, "end_dim", -1), nd)
        if end > start and (start <= s.dim <= end or (s.inner and start <= s.inner[0] <= end)):
            src = self.fp.shape(node.args[0])  # merges like the equivalent view, which has no sizes to rewrite
            gi = [i for i in range(start, end + 1) if src[i] != 1 or i == s.dim]
            return self._view_merge(node, s, None, src, self.fp.shape(node), gi, start)
        shift = lambda x: x - (end - start) if x > end else x  # noqa: E731
        return s.moved(shift(s.dim), None if not s.inner else shift(s.inner[0]))

    def _on_view(self, node: fx.Node, rule: OpRule) -> Sharding:
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
                return self._view_outer(node, s, shape_arg, src, dst, gi_real, gj_real)
            if len(gi_real) > 1 and len(gj_real) == 2 and gi_real[-1] == s.dim and not s.inner:
                return self._view_fold(node, s, shape_arg, dst, gj_real)
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
            return self._view_regroup(node, s, shape_arg, dst, gi_real, gj_real)
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
        if len(c) == 1 and c[0] * local % full == 0:
            self.region.rewrites.append(Rewrite(node.name, arg, j, c[0], c[0] * local // full, v.name))
            return
        # any other size computed at run time (``k.reshape(q.shape[0] // n_rep, s, d)``: heads folded under the
        # batch, ``floordiv(4·b, 2)``): a view infers it from this rank's elements, the other sizes being local
        hint = v.meta.get("val") if isinstance(v, fx.Node) else None
        hint = getattr(getattr(hint, "node", None), "hint", None)
        if kind_of(node.target) != "view" or arg != 1 or hint is None or \
                any(is_static(a) and a == -1 for i, a in enumerate(shape_arg) if i != j):
            raise Unshardable(node, "the size of the sharded dim is computed at run time")
        self.region.rewrites.append(Rewrite(node.name, arg, j, int(hint), -1, inferred=v.name))

    def _view_outer(self, node, s, shape_arg, src, dst, gi, gj) -> Sharding:
        """Views of heads folded under the batch (``[b·h, s, d]``): passed through, or unfolded again."""
        full, local = sum(g.size for g in s.segments), s.local_size
        if len(gi) == 1 and len(gj) == 1:
            self._set_view_size(node, shape_arg, gj[0], full, local)
            return s.moved(gj[0])
        if len(gi) == 1 and len(gj) >= 2 and dst[gj[-1]] == full:  # [b·h, ..] -> [b, h, ..], [b·s·h] -> [b, s, h]
            self._set_view_size(node, shape_arg, gj[-1], full, local)
            return Sharding(gj[-1], s.segments)
        if len(gi) == 1 and len(gj) == 2 and gi[0] == s.dim and is_static(dst[gj[1]]):
            # [k·W] -> [k·W/d, d]: a strided projection's features into heads, the k blocks still whole
            n2 = dst[gj[1]]
            if all(g.size % n2 == 0 and (g.size // n2) % g.parts == 0 for g in s.segments):
                self._set_view_size(node, shape_arg, gj[0], full, local)
                return Sharding(gj[0], tuple(Segment(g.size // n2, g.parts) for g in s.segments), outer=True)
        if len(gi) == 2 and len(gj) == 1 and gi[0] == s.dim and is_static(src[gi[1]]):
            # [k·W, d] -> [k·W·d]: heads merged with their head dim, the k blocks still whole
            n2 = src[gi[1]]
            self._set_view_size(node, shape_arg, gj[0], full, local)
            return Sharding(gj[0], tuple(Segment(g.size * n2, g.parts) for g in s.segments), outer=True)
        if len(gi) == 2 and len(gj) >= 2 and gi[0] == s.dim and is_static(src[gi[1]]) \
                and dst[gj[-1]] == full * src[gi[1]] and not any(g.inner for g in s.segments):
            # [k·h, d] -> [.., h·d] with the leading dims k: heads unfolded from under the batch and merged with
            # their head dim (a gated norm over each head, ``(b·s·h, d) -> (b, s, h·d)``, Qwen3.5's linear
            # attention): every head stays whole, so the last dim holds this rank's heads first
            n2 = src[gi[1]]
            self._set_view_size(node, shape_arg, gj[-1], full * n2, local * n2)
            return Sharding(gj[-1], tuple(Segment(g.size * n2, g.parts) for g in s.segments))
        raise Unshardable(node, "view regroups heads folded under the batch")

    def _view_regroup(self, node, s, shape_arg, dst, gi, gj) -> Sharding:
        """``[.., n, d] -> [.., m, e]`` with ``n·d == m·e``, the sharded dim outermost (CodeGen's fused projection
        read as 4 chunks of q | v | k, the q of the chunks ``(b, s, 4, 256)`` viewed as 16 heads of 64): a rank's
        chunks are one run of the flattened group, the same run as its ``m / tp`` heads where tp divides ``m``."""
        seg, m = s.single(), dst[gj[0]]
        if seg is not None and not (seg.inner or s.inner) and gi[0] == s.dim and is_static(m) and m % seg.parts:
            # heads regrouped into fewer groups than ranks (DeepSeek-V4's grouped output projection, 2 groups of
            # 2 heads at tp 4): what reads each group whole would need the parts of it other ranks hold
            raise Unshardable(node, f"view regroups the sharded dim (of {seg.size}, cut in {seg.parts}) with the "
                                    f"dims after it into {m} groups of {dst[gj[1]]}: {m} groups are not divisible "
                                    f"by tp={seg.parts}, so a group would span ranks")
        if seg is None or seg.inner or s.inner or gi[0] != s.dim or not is_static(m) or m % seg.parts:
            raise Unshardable(node, "view regroups the sharded dim with others")
        self._set_view_size(node, shape_arg, gj[0], m, m // seg.parts)
        return Sharding(gj[0], (Segment(m, seg.parts),))

    def _view_fold(self, node, s, shape_arg, dst, gj) -> Sharding:
        """``[b, s, h·d] -> [b·s·h, d]``: heads folded under the batch with their head dim split off (a gated norm
        over each head, OLMo-Hybrid's ``g_proj(x).reshape(-1, d)``): each rank's rows are its own heads of every
        token, ``outer`` over the leading dims."""
        d = dst[gj[1]]
        if not is_static(d) or any(g.inner or g.size % d for g in s.segments):
            raise Unshardable(node, "view folds the sharded dim under the batch across its heads")
        few = next((g for g in s.segments if (g.size // d) % g.parts), None)
        if few is not None:  # JetMoE's 2 kv heads of each query slot at tp 4: a rank would hold half a head
            raise Unshardable(node, f"view splits the sharded dim into heads of {d}: {few.size // d} heads are not "
                                    f"divisible by tp={few.parts}")
        out = Sharding(gj[0], tuple(Segment(g.size // d, g.parts) for g in s.segments), outer=True)
        self._set_view_size(node, shape_arg, gj[0], sum(g.size for g in out.segments), out.local_size)
        return out

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
        t, nd, rule = node.target, ndim_of(node.args[0]), op_rule(node.target)
        kind = rule.kind if rule is not None else None
        d = normalize_dim(arg_named(node, "dim", 0), nd) if kind in ("slice", "select", "split") else None
        if kind == "slice" and d != gd and d != s.dim:
            self.region.specs[node] = s
            return
        if d != gd or rule.form in ("unbind", "chunks"):
            raise Unshardable(node, f"{t} of a fused per-group layout before its q, k and v are read apart")
        starts = [sum(u.size for u in units[:i]) for i in range(len(units))]
        local = [sum(u.local() for u in units[:i]) for i in range(len(units))]
        if kind == "split":
            sizes = [self.fp.shape(o)[gd] for o in node.meta["val"]]
            if sizes != [u.size for u in units] or rule.form != "sizes":
                raise Unshardable(node, f"split {sizes} of a fused per-group layout {[u.size for u in units]}")
            for i, (old, u) in enumerate(zip(node.args[1], units)):
                self.rewrite(node, 1, i, old, u.local())
            self.region.specs[node] = tuple(self._picked(s, gd, u, keep=True) for u in units)
            return
        full = sum(u.size for u in units)
        if kind == "select":
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
        rest = [src[i] for i in gi[1:]]
        if seg is None and gi[0] == s.dim and not s.inner and all(is_static(n) for n in rest) \
                and not any(g.inner for g in s.segments):
            # several segments merged with whole dims after them (kv heads cut per piece and their repeats,
            # ``(b, n_kv, n_rep, s, d) -> (b, n_kv·n_rep, s, d)``): each segment's heads keep their repeats
            segs = tuple(Segment(g.size * math.prod(rest), g.parts) for g in s.segments)
            if shape_arg is not None:
                self._set_view_size(node, shape_arg, j, dst[j], sum(g.local() for g in segs))
            return Sharding(j, segs)
        if gi[0] != s.dim and not s.inner:
            # ``(b, n, s, E) -> (b·n·s, E)``: a rank's heads would be rows lying apart, s of them at a time, which
            # no cut of one dim describes (heads folded under the batch have nothing after them)
            at, sizes = gi.index(s.dim), node.args[0].meta["val"].shape  # as captured: symbolic sizes by name
            before, after = ("·".join(str(sizes[i]) for i in part) for part in (gi[:at], gi[at + 1:]))
            raise Unshardable(node, f"view folds the sharded dim (of {src[s.dim]}) into one dim with {before} "
                                    f"before it and {after} after it: each rank's rows would lie apart, {after} at a "
                                    "time, which no cut describes")
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

    def _unfolded(self, x: fx.Node, s: Sharding) -> Sharding | None:
        """An ``outer`` cut ``[k whole, segments]`` of a static ``k`` as the segments listed k times, which hold the
        same heads on every rank (a half of DiffLlama's kv heads tiled by ``repeat(1, 2, 1, 1)``, ``[2 whole,
        (n/2, tp)]``, before repeat_kv expands it); None where ``k`` is not static (heads under the batch)."""
        full, width = self.fp.shape(x)[s.dim], sum(g.size for g in s.segments)
        if s.inner or s.group or not is_static(full) or full % width or any(g.inner for g in s.segments):
            return None
        return Sharding(s.dim, s.segments * (full // width))

    def _on_expand(self, node: fx.Node, rule: OpRule) -> Sharding:
        s = self.spec(node.args[0])
        if s is None:  # a replicated value broadcast to a sharded one's shape (``broadcast_to``)
            return self.pointwise(node)
        if s.outer:
            s = self._unfolded(node.args[0], s)
            if s is None:
                raise Unshardable(node, "expand of heads folded under the batch")
        sizes = list(node.args[1])
        off = len(sizes) - ndim_of(node.args[0])
        in_shape = self.fp.shape(node.args[0])
        d = s.dim + off
        seg = s.single()
        grown = self._grown(node, s, in_shape, sizes, off)
        if grown is not None:
            return grown
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

    def _on_repeat(self, node: fx.Node, rule: OpRule) -> Sharding:
        """``k.repeat(1, n, 1, 1)`` of one kv head held whole: as its expand; other dims tile locally."""
        s = self.spec(node.args[0])
        reps = list(node.args[1])
        in_shape = self.fp.shape(node.args[0])
        off = len(reps) - len(in_shape)
        if off < 0:  # torch.tile's counts of the last dims only; as repeat's, they are read from the left
            raise Unshardable(node, f"{node.target} with fewer counts than its input's dims")
        tiled = [j for j, n in enumerate(reps) if not (is_static(n) and n == 1) and j >= off and in_shape[j - off] != 1]
        grown = None if tiled else self._grown(node, s, in_shape, reps, off)
        if grown is not None:
            return grown
        dims = [s.dim + off, *([s.inner[0] + off] if s.inner else [])]
        n = reps[s.dim + off]
        if not s.inner and s.group is None and is_static(n) and n > 1:
            # kv heads tiled head-minor (``k.repeat(1, n_rep, 1, 1)``): [n_rep copies, heads]; each rank tiles
            # its own heads, so it holds [n_rep whole, its heads]; the repeat count stays
            return Sharding(s.dim + off, s.segments, outer=True)
        if s.outer or any(not (is_static(reps[d]) and reps[d] == 1) for d in dims):
            raise Unshardable(node, "repeat of the sharded dim")
        return s.moved(s.dim + off, None if not s.inner else s.inner[0] + off)

    def _grown(self, node: fx.Node, s: Sharding, in_shape: list[int], sizes: list, off: int) -> Sharding | None:
        """A value held whole (one kv head) expanded or repeated along one size-1 dim to ``n`` (the query
        heads): each rank makes only its own n / tp copies, so that dim is split like the queries' heads.
        ``sizes``: the expand's sizes or the repeat's counts (the same where the input has size 1)."""
        if not held_whole(s):
            return None
        grown = [j for j, n in enumerate(sizes) if is_static(n) and n > 1 and (j < off or in_shape[j - off] == 1)]
        if len(grown) != 1:
            return None
        j = grown[0]
        if sizes[j] % self.tp:
            raise Unshardable(node, f"{sizes[j]} heads are not divisible by tp={self.tp}")
        self.rewrite(node, 1, j, sizes[j], sizes[j] // self.tp)
        return Sharding(j, (Segment(sizes[j], self.tp),))

    def _on_split(self, node: fx.Node, rule: OpRule) -> tuple[Sharding | None, ...]:
        s = self.spec(node.args[0])
        t, form = node.target, rule.form
        d = normalize_dim(arg_named(node, "dim", 0), ndim_of(node.args[0]))
        outs = node.meta["val"]
        if d != s.dim and not (s.inner and d == s.inner[0]):
            if form == "unbind":  # each piece drops dim d: a sharded dim after it moves one to the left
                s = s.moved(s.dim - (d < s.dim), None if not s.inner else s.inner[0] - (d < s.inner[0]))
            return tuple(s for _ in outs)
        if form == "unbind" or s.inner or s.outer:
            raise Unshardable(node, "unbind of the sharded dim")
        sizes = [self.fp.shape(o)[d] for o in outs]
        if held_whole(s):  # one head every rank holds (rotate_half's halves of a multi-query key): cut alike
            pieces = tuple((Segment(n, 1),) for n in sizes)
        else:
            if len(s.segments) == 1 and len(sizes) > 1 and len(set(sizes)) == 1:
                # equal pieces of a contiguous shard would mix ranks' blocks; segments must follow the pieces
                raise Pieces(node, f"{len(sizes)} equal pieces of a contiguously sharded dim", len(sizes))
            pieces = _grouped_segments(sizes, s.segments)
        if pieces is None:
            raise Unshardable(node, f"split sizes {sizes} do not follow the segments {[g.size for g in s.segments]}")
        local = [sum(g.local() for g in piece) for piece in pieces]
        if form == "size" and len(set(local)) == 1:
            self.rewrite(node, 1, None, node.args[1], local[0])
        elif form == "sizes":
            for i, (old, new) in enumerate(zip(node.args[1], local)):
                self.rewrite(node, 1, i, old, new)
        elif form != "chunks":
            raise Unshardable(node, f"{t} of the sharded dim with unequal local segments")
        return tuple(Sharding(d, piece) for piece in pieces)

    def _on_cat(self, node: fx.Node, rule: OpRule) -> Sharding:
        # torch.cat skips 1-D empty tensors (a cache's lazily made ``torch.tensor([])``): they take no part
        tensors = [x for x in node.args[0] if not legacy_empty(x)]
        d = normalize_dim(arg_of(node, 1, "dim", 0), ndim_of(node))
        specs = {self.spec(x) for x in tensors} - {None}
        pieces = [self.spec(x) for x in tensors]
        if len(specs) > 1 and all(held_whole(p) and p.dim == d for p in pieces) and is_static(self.fp.shape(node)[d]):
            # parts of one head every rank holds whole, joined back (its rotary part after the rest): one head
            return Sharding(d, (Segment(self.fp.shape(node)[d], 1),))
        if len(specs) > 1 and all(p is not None and p.dim == d and not (p.inner or p.outer or p.group)
                                  for p in pieces):
            # pieces each cut on the cat dim, unlike (a gated delta net's q, k (b, s, nk·dk) and v (b, s, nv·dv),
            # each cut by key-head groups, joined for its convolution): rank r's pieces joined are its block of
            # each, in order: the segments of a fused projection
            return Sharding(d, tuple(g for p in pieces for g in p.segments))
        if len(specs) > 1 and all(held_whole(p) for p in specs) and None not in pieces:
            # values every rank holds whole, each naming another dim (one key head (b, 1, s, d) by its head dim,
            # the keys pooled from it (b, 1, s/m, d) by their features): the join is whole on every rank too,
            # named by the head dim of size 1 where one names it (each rank expands it to its own heads)
            out = self.fp.shape(node)
            return next((p for p in pieces if p.dim != d and out[p.dim] == 1), pieces[0])
        if len(specs) != 1:
            raise Unshardable(node, "cat of tensors sharded differently")
        s = specs.pop()
        if (d == s.dim and held_whole(s) and len(s.segments) == 1
                and all(self.spec(x) is not None for x in tensors)):  # rotate_half's halves of one whole head
            return Sharding(d, (Segment(self.fp.shape(node)[d], 1),))
        if held_whole(s) and len(s.segments) == 1 and d != s.dim and not any(
                self.spec(x) is None and isinstance(x, fx.Node) and x.op == "placeholder" for x in tensors):
            # one head every rank holds whole joined with replicated values along another dim (DeepSeek-V4's
            # attention mask and the mask of its pooled keys, along the keys): whole on every rank
            for x in tensors:
                if self.spec(x) is None:
                    self._enter_if_learned(node, x)
            return s
        if d == s.dim and not (s.inner or s.outer or s.group) and len(set(tensors)) == len(tensors) > 1 \
                and all(self.spec(x) is not None for x in tensors):
            # distinct values cut alike joined along their cut dim (Kimi's q, k and v projections, (b, s, h·d)
            # each by heads, joined for one convolution): rank r's pieces joined are its block of each, in order,
            # the segments of a fused projection (one value repeated is the case below)
            return Sharding(d, tuple(g for x in tensors for g in self.spec(x).segments))
        if d == s.dim and not s.inner and s.group is None and len({self.fp.shape(x)[d] for x in tensors}) == 1 \
                and all(self.spec(x) is not None for x in tensors):
            # pieces cut alike joined along their cut dim (``torch.cat([k] * n_rep, dim=1)``: kv heads repeated
            # head-minor): [pieces, heads] with each rank's own heads of every piece, the pieces whole
            return Sharding(d, s.segments, outer=True)
        for x in tensors:
            if self.spec(x) is None and not self.expanded_head(x, s) and not self.viewed_parameter(x, s) \
                    and not self._local_factory(x, s):
                self._local_input(node, x, s)
        if d == s.dim or (s.inner and d == s.inner[0]):
            raise Unshardable(node, "cat along the sharded dim")
        return s

    def expanded_head(self, x: object, s: Sharding) -> bool:
        """Is ``x`` one replicated head expanded to all heads, which each rank expands to its own instead
        (see :meth:`autotp.analysis.propagate.Propagator.expanded_head`)?"""
        return False

    def viewed_parameter(self, x: object, s: Sharding) -> bool:
        """Is ``x`` a parameter per head, viewed and expanded to meet the heads ``s`` shards (made this
        rank's; see :meth:`autotp.analysis.propagate.Propagator.viewed_parameter`)?"""
        return False

    def _local_factory(self, x: object, s: Sharding) -> bool:
        """``torch.zeros(b, pad, width)`` made in the forward and read only by this cat (a left padding of
        channel-cut windows, RecurrentGemma's shifted-window convolution): each rank makes its own channels'."""
        if not (isinstance(x, fx.Node) and kind_of(x.target) == "factory" and len(x.users) == 1) \
                or s.inner or s.outer or ndim_of(x) is None or s.dim >= ndim_of(x):
            return False
        full = sum(g.size for g in s.segments)
        if self.fp.shape(x)[s.dim] != full:
            return False
        self._set_view_size(x, list(x.args[0]), s.dim, full, s.local_size, arg=0)
        return True

    def _local_input(self, node: fx.Node, x: object, s: Sharding) -> None:
        """A replicated graph input concatenated with a sharded value (a KV cache's past keys and the new
        ones) is taken as this rank's shard of it: the cache the graph returned last call, kept local."""
        if not (isinstance(x, fx.Node) and x.op == "placeholder" and ndim_of(x) == ndim_of(node)) or s.inner or s.outer:
            raise Unshardable(node, "cat of sharded and replicated tensors")
        for u in x.users:
            if u is not node and not is_guard(u) \
                    and not (kind_of(u.target) == "sym_size" and normalize_dim(u.args[1], ndim_of(x)) != s.dim):
                raise Unshardable(node, f"graph input {x.name} is concatenated with a sharded value and used whole")
        self.region.specs[x] = s
        self.region.inputs.append(x)

    def _on_stack(self, node: fx.Node, rule: OpRule) -> Sharding:
        tensors = node.args[0]
        specs = {self.spec(x) for x in tensors}
        if len(specs) != 1 or None in specs:
            raise Unshardable(node, "stack of tensors sharded differently")
        s = specs.pop()
        d = normalize_dim(arg_of(node, 1, "dim", 0), ndim_of(node))
        shift = lambda x: x + (x >= d)  # noqa: E731 - a new dim at d
        return s.moved(shift(s.dim), None if not s.inner else shift(s.inner[0]))

    def _on_repeat_interleave(self, node: fx.Node, rule: OpRule) -> Sharding:
        """``k.repeat_interleave(n_rep, dim=1)`` (grouped-query kv heads to query heads): each rank repeats its
        own kv heads; where kv heads are fewer than tp, a rank holds one and repeats it for its q heads only."""
        s = self.spec(node.args[0])
        reps, d = node.args[1], arg_of(node, 2, "dim", None)
        size = node.kwargs.get("output_size")  # the repeated dim's size (export writes it: ``(b, l, 8, n) -> 128``)
        if d is None or s.inner:
            raise Unshardable(node, "repeat_interleave of a flattened or merged sharded tensor")
        if normalize_dim(d, ndim_of(node)) != s.dim:
            return s
        seg = s.single()
        q = self.tp // seg.parts if seg else 0
        if seg is None or not is_static(reps) or reps % q or not (size is None or is_static(size)):
            raise Unshardable(node, "repeat_interleave of the sharded dim that does not split by rank")
        self.rewrite(node, 1, None, reps, reps // q)
        if size is not None:  # Nemotron-H's B and C: each rank's groups repeated for its own heads
            self.rewrite(node, "output_size", None, size, size // self.tp)
        # kv heads folded under the batch ([b·n_kv, s, d]) stay folded: each rank repeats its own to [b·n_q, ..]
        return Sharding(s.dim, (Segment(seg.size * reps, self.tp),), outer=s.outer)
