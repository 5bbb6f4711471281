"""Propagation rules for the ops that compute with the sharded dim in place: elementwise ops, softmax,
reductions and norms (over the sharded dim: statistics completed by one all-reduce), batched matmuls and
attention, writes into buffers and new tensors shaped like a sharded one. Each ``_on_<kind>`` handler
serves one kind of :mod:`~autotp.analysis.op_rules` and gives the output's :class:`Sharding` (None: the
node stays unrecorded); :class:`~autotp.analysis.propagate.Propagator` mixes them in.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autotp.analysis.op_rules import OpRule, op_rule
from autotp.analysis.ops import Pieces, Strided, Unshardable, arg_of, held_whole, ndim_of, reduction_args
from autotp.analysis.pair_region import ParamCut, StatFact
from autotp.analysis.shapes import is_static, normalize_dim
from autotp.shard_spec import Segment, Sharding, shard_tensor


class ValueRules:
    """Rules of :class:`~autotp.analysis.propagate.Propagator` that keep the sharded dim where it is."""

    # -- one handler per kind ----------------------------------------------------------------------
    def _on_pointwise(self, node: fx.Node, rule: OpRule) -> Sharding:
        return self.pointwise(node)

    _on_expand_as = _on_pointwise  # a replicated value broadcast to a sharded one's shape

    def _on_same_shape(self, node: fx.Node, rule: OpRule) -> Sharding | None:
        others = [a for i, a in enumerate(node.args) if i != rule.dtype_arg]
        if rule.dtype_arg is not None and all(self.spec(a) is None for a in others):
            return None  # reads only the dtype of the sharded value (``W.type_as(x)``: a weight cast for the matmul)
        return self.pointwise(node)

    def _on_softmax(self, node: fx.Node, rule: OpRule) -> Sharding:
        s = self.spec(node.args[0])
        if normalize_dim(node.args[1], ndim_of(node)) == s.dim:
            raise Unshardable(node, "softmax over the sharded dim")
        return s

    def _on_complex_view(self, node: fx.Node, rule: OpRule) -> Sharding:
        """``view_as_complex`` pairs up the last dim, ``view_as_real`` adds one: the sharded dim must be another."""
        s = self.spec(node.args[0])
        if s.inner or (rule.form == "complex" and s.dim == ndim_of(node.args[0]) - 1):
            raise Unshardable(node, "complex view of the sharded dim")
        return s

    def _on_max_min(self, node: fx.Node, rule: OpRule) -> tuple[Sharding, Sharding]:
        """(values, indices) along an unsharded dim: softmax's shift."""
        s, nd = self.spec(node.args[0]), ndim_of(node.args[0])
        d, keep = normalize_dim(node.args[1], nd), arg_of(node, 2, "keepdim", False)
        if d == s.dim or s.inner:
            raise Unshardable(node, f"{node.target} over the sharded dim")
        out = s if keep else s.moved(s.dim - (d < s.dim))
        return out, out

    def _on_matmul(self, node: fx.Node, rule: OpRule) -> Sharding:
        free = self._free_rows(node)
        return free if free is not None else self.batched(node, [node.args[0], node.args[1]], 2)

    def _free_rows(self, node: fx.Node) -> Sharding | None:
        """``a @ b`` with ``a`` sharded on its rows or ``b`` on its columns, the other replicated: each rank's
        rows (columns) of the product are its own (DTensor's matmul strategy: Shard(-2) @ Replicate, Replicate
        @ Shard(-1)); a state-space scan's readout ``h @ C.unsqueeze(-1)`` of channel-cut states ``h (b, l, d, n)``."""
        a, b = node.args[0], node.args[1]
        sa, sb = self.spec(a), self.spec(b)
        if (sa is None) == (sb is None) or min(ndim_of(a), ndim_of(b)) < 2:
            return None
        x, s, at = (a, sa, -2) if sa is not None else (b, sb, -1)
        if s.inner or s.outer or s.dim != ndim_of(x) + at:
            return None
        self._enter_if_learned(node, b if x is a else a)
        return s.moved(ndim_of(node) + at)

    def _on_triangle(self, node: fx.Node, rule: OpRule) -> Sharding:
        """``tril``/``triu`` keep a triangle of the last two dims (a chunk's causal mask over positions): a tensor
        sharded on any other dim (heads) keeps its sharding."""
        s, nd = self.spec(node.args[0]), ndim_of(node)
        if s.dim >= nd - 2 or (s.inner and s.inner[0] >= nd - 2):
            raise Unshardable(node, f"{node.target} of the sharded dim")
        return s

    def _on_unfold(self, node: fx.Node, rule: OpRule) -> Sharding:
        """``x.unfold(d, k, step)`` (a short convolution's windows over the sequence, ``(b, C, s + k - 1) ->
        (b, C, s, k)``): the windows of dim ``d`` are in place of it and their ``k`` taps a new last dim, so a
        tensor sharded on any other dim (the channels) keeps its sharding: each rank's windows are its own."""
        s = self.spec(node.args[0])
        d = normalize_dim(arg_of(node, 1, "dimension"), ndim_of(node.args[0]))
        if s.dim == d or (s.inner and s.inner[0] == d):
            raise Unshardable(node, f"{node.target} of the sharded dim: its windows would span ranks")
        return s

    def _on_conv(self, node: fx.Node, rule: OpRule) -> Sharding:
        """A depthwise convolution over the sequence (``groups`` = channels, one filter per channel: the short
        convolution of Mamba and of gated linear attention) of channels sharded on dim 1: each rank convolves
        its own channels with their filters. The weight ``(C, 1, k)`` and the bias are sharded on dim 0 with the
        channels, and ``groups`` becomes this rank's channel count."""
        x, w = node.args[0], node.args[1]
        s, shape = self.spec(x), self.fp.shape(x)
        groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
        if s is None or s.dim != 1 or s.inner or s.outer or self.spec(w) is not None:
            raise Unshardable(node, f"{node.target} of a tensor not sharded on its channels")
        if groups != shape[1] or not isinstance(w, fx.Node) or self.fp.shape(w)[:2] != [shape[1], 1]:
            raise Unshardable(node, f"{node.target} over sharded channels mixes them (groups={groups}, "
                                    f"{shape[1]} channels): only a depthwise convolution stays local")
        found = self._filters(w, shape[1])
        if found is None:
            raise Unshardable(node, f"{node.target}'s filters are not a parameter read by it alone")
        param, chain = found
        for n in chain + self._other_reads(param, shape[1]):
            # ``weight.squeeze(1)`` then ``.unsqueeze(1)`` (transformers' reference causal conv), and the
            # parameter's other reads, cut alike: each keeps the channels on dim 0
            self.region.specs[n] = s.moved(0)
        self.region.params.append(ParamCut(param, 0, s.moved(0)))
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if isinstance(bias, fx.Node):
            if self._parameter(bias) is None:
                raise Unshardable(node, f"{node.target}'s bias is not a parameter")
            self.region.params.append(ParamCut(bias, 0, s.moved(0)))
        if len(node.args) <= 6:
            raise Unshardable(node, f"{node.target}'s groups is not given where it can be made this rank's")
        self.rewrite(node, 6, None, groups, s.local_size)
        return s

    def _filters(self, w: fx.Node, channels: int) -> tuple[fx.Node, list[fx.Node]] | None:
        """The parameter a depthwise convolution's filters ``w`` are, read through casts and squeezes or
        unsqueezes of size-1 dims that keep the channels first; and the nodes on the way."""
        chain = []
        while w.op == "call_function":
            rule = op_rule(w.target)
            moves = rule is not None and rule.kind == "move" and rule.form in ("insert", "drop")
            if rule is None or not (rule.cast or moves) or len(w.users) != 1 or self.fp.shape(w)[0] != channels:
                return None
            if moves and any(normalize_dim(d, max(ndim_of(w), ndim_of(w.args[0]))) == 0
                             for d in (w.args[1] if isinstance(w.args[1], (list, tuple)) else [w.args[1]])):
                return None
            chain.append(w)
            w = w.args[0]
        if self._parameter(w) is None or self._other_reads(w, channels, chain[-1] if chain else None) is None:
            return None
        return w, chain

    def _other_reads(self, param: fx.Node, channels: int, read: fx.Node | None = None) -> list[fx.Node] | None:
        """The nodes of ``param``'s reads other than ``read`` (the filters' own chain) when each is a chain of
        casts and size-1 squeezes/unsqueezes that keep the channels first and ends in nothing (Nemotron-H's
        reference path computes ``conv1d.weight.squeeze(1)`` for a fused kernel, then convolves with the
        module: ``(C, k)`` read by no op), or in another depthwise convolution's filters (which its own visit
        cuts alike, on the same channels, or finds outside the region); None where a read does anything else."""
        out, todo = [], [u for u in param.users if u is not read]
        while todo:
            u = todo.pop()
            rule = op_rule(u.target) if u.op == "call_function" else None
            if rule is not None and rule.kind == "conv" and len(u.args) > 1 and u.args[1] is not None \
                    and u.all_input_nodes.count(u.args[1]) == 1 and u.args[1] in out + [param]:
                continue  # filters of a depthwise convolution: cut by its own rule
            moves = rule is not None and rule.kind == "move" and rule.form in ("insert", "drop")
            if rule is None or not (rule.cast or moves) or u.args[0] not in out + [param] \
                    or self.fp.shape(u)[:1] != [channels]:
                return None
            if moves and any(normalize_dim(d, max(ndim_of(u), ndim_of(u.args[0]))) == 0
                             for d in (u.args[1] if isinstance(u.args[1], (list, tuple)) else [u.args[1]])):
                return None
            out.append(u)
            todo.extend(u.users)
        return out

    def _on_index_put(self, node: fx.Node, rule: OpRule) -> Sharding:
        return self.index_put(node, node.args[0], node.args[1], node.args[2])

    def _on_index_copy(self, node: fx.Node, rule: OpRule) -> Sharding:
        """``cache.index_copy_(2, pos, k)``: ``cache[:, :, pos] = k``."""
        d = normalize_dim(node.args[1], ndim_of(node))
        return self.index_put(node, node.args[0], [None] * d + [node.args[2]], node.args[3])

    def _on_new_like(self, node: fx.Node, rule: OpRule) -> Sharding:
        """``x.new_empty([b, n, s, d])`` of a tensor sharded by heads on dim ``i``, with ``n`` its heads: a
        buffer of this rank's heads (DeepSeek's key, filled by in-place copies of the per-head parts)."""
        s, size = self.spec(node.args[0]), list(node.args[1])
        full = sum(g.size for g in s.segments)
        d = s.dim + len(size) - ndim_of(node.args[0])  # dims aligned from the right, as broadcasting aligns them:
        # mamba_simple's state ``A.new_zeros((b, d_inner, n))`` of the per-channel ``A (d_inner, n)``; a
        # linear-attention state ``q.new_zeros(b·h, d_k, d_v)`` of q's heads folded under the batch (``outer``,
        # the size ``b·h`` computed at run time: :meth:`_set_view_size` scales its ``h``)
        if held_whole(s) and len(s.segments) == 1:
            # of one head every rank holds whole (DeepSeek-V4's buffer of pooled keys, (b, w, 2m, d) of the key
            # projection's (b, w, m, 2d), or its mask (b, 1, s, w + 1)): whole on every rank too, whatever its
            # sizes, named by a dim of static size (the aligned one where it is static)
            at = next((j for j in [d, *range(len(size))] if 0 <= j < len(size) and is_static(size[j])
                       and isinstance(size[j], int) and size[j] >= 0), None)
            if at is not None:
                return Sharding(at, (Segment(size[at], 1),))
        width = None if d < 0 else size[d] if is_static(size[d]) else \
            self.fp.size(size[d].meta["val"]) if isinstance(size[d], fx.Node) and s.outer else None
        if s.inner or width is None or width != self.fp.shape(node.args[0])[s.dim]:
            raise Unshardable(node, "a new tensor whose sharded dim is not its input's")
        self._set_view_size(node, size, d, full, s.local_size)
        return s.moved(d)

    def _on_copy(self, node: fx.Node, rule: OpRule) -> Sharding:
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
                    if result is not None and aligned != result and aligned.dim == result.dim \
                            and self._broadcast_whole(node, result, aligned):
                        # a value every rank holds whole, of size 1 on the dim the other is cut on (a mask of one
                        # head's keys added to the scores of every head): broadcast to this rank's part of it
                        result = result if held_whole(aligned) else aligned
                        continue
                    if result is not None and aligned != result and held_whole(result) and held_whole(aligned):
                        # values every rank holds whole (a key head (b, s, d) and its statistics (b, s, 1)): so is
                        # their result, named as the one that spans the output's dim (not broadcast to it)
                        out = self.fp.shape(node)
                        result = next((t for t in (result, aligned)
                                       if out[t.dim] == sum(g.size for g in t.segments)), result)
                        continue
                    if result is not None and aligned != result:
                        raise Unshardable(node, f"operands sharded differently: {result} vs {aligned}")
                    result = aligned
        for a in [*node.args, *node.kwargs.values()]:
            for x in (a if isinstance(a, (list, tuple)) else [a]):
                if ndim_of(x) is not None and self.spec(x) is None:
                    self._replicated_operand(node, x, result)
        return result

    def _stat_scale(self, node: fx.Node, s: Sharding, kind: str) -> float:
        """Summing the ranks' partial statistics: a mean over the sharded dim is the ranks' mean of means (also
        with blocks held by several ranks, all equal-sized); a sum counts each replicated block once."""
        if s.inner or s.outer or (len(s.segments) > 1 and any(g.parts != self.tp for g in s.segments)):
            raise Unshardable(node, f"{node.target} over a sharded dim of unequal blocks")
        return 1.0 / self.tp if kind != "sum" else s.segments[0].parts / self.tp

    def _on_norm(self, node: fx.Node, rule: OpRule) -> Sharding:
        """rms_norm / layer_norm: over unsharded dims (per head) it passes the sharding through and its
        weight enters through f; over the sharded dim (the whole projection width) each rank normalises its
        slice with statistics completed by one all-reduce, and the weight is sharded with the heads."""
        s = self.spec(node.args[0])
        nd = ndim_of(node)
        nshape = list(node.args[1])
        first = nd - len(nshape)
        weights = [w for w in (node.args[i] for i in rule.weights if i < len(node.args)) if isinstance(w, fx.Node)]
        if s.dim < first and not (s.inner and s.inner[0] >= first):
            for w in weights:
                self._enter_if_learned(node, w)
            return s
        self.region.stats[node] = StatFact(rule.stat, self._stat_scale(node, s, "mean"))
        wd = s.dim - first
        if is_static(nshape[wd]):
            self.rewrite(node, 1, wd, nshape[wd], nshape[wd] * s.local_size // sum(g.size for g in s.segments))
        for w in weights:
            if self._parameter(w) is None:
                raise Unshardable(node, f"the weight {w.name} of a norm over the sharded dim is not a parameter")
            self.region.params.append(ParamCut(w, wd - (len(nshape) - ndim_of(w)), s))
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
            self.region.params.append(ParamCut(dst, s.dim, s))
            self.region.specs[dst] = s
        elif sd != sv:
            raise Unshardable(node, f"operands sharded differently: {sd} vs {sv}")
        return s

    def _on_baddbmm(self, node: fx.Node, rule: OpRule) -> Sharding:
        inp, b1, b2 = node.args[:3]
        result = self.batched(node, [b1, b2], 2)
        if isinstance(inp, fx.Node):
            si = self.spec(inp)
            if si is None:
                self._replicated_operand(node, inp, result)
            elif si.moved(si.dim + 3 - ndim_of(inp)) != result:
                raise Unshardable(node, f"operands sharded differently: {si} vs {result}")
        return result

    def _on_reduction(self, node: fx.Node, rule: OpRule) -> Sharding | None:
        s = self.spec(node.args[0])
        nd = ndim_of(node.args[0])
        r = reduction_args(node)
        dims = [normalize_dim(d, nd) for d in (range(nd) if r.dims is None else r.dims)]
        if s.dim in dims and held_whole(s) and len(s.segments) == 1 and r.keepdim:
            # statistics over one head every rank holds whole (a multi-query key head's norm): each rank computes
            # them whole, with no all-reduce, held whole alike (b, s, 1)
            return Sharding(s.dim, (Segment(1, 1),))
        if s.dim in dims or (s.inner and s.inner[0] in dims):
            kind = rule.stat
            finite = isinstance(r.param, (int, float)) and 0 < r.param < float("inf")
            if kind is None or (kind == "norm" and not finite):
                raise Unshardable(node, f"{node.target} reduces the sharded dim")
            self.region.stats[node] = StatFact(kind, self._stat_scale(node, s, "mean" if kind == "mean" else "sum"))
            return None  # replicated once the statistics are all-reduced
        if r.keepdim:
            return s
        shift = lambda x: x - sum(d < x for d in dims)  # noqa: E731
        return s.moved(shift(s.dim), None if not s.inner else shift(s.inner[0]))

    def _broadcast_whole(self, node: fx.Node, a: Sharding, b: Sharding) -> bool:
        """Is one of ``a``, ``b`` (on the same dim of ``node``'s output) held whole with size 1 there, broadcast
        against the other?"""
        return any(held_whole(x) and [g.size for g in x.segments] == [1] and not held_whole(y)
                   and self.fp.shape(node)[y.dim] == sum(g.size for g in y.segments) for x, y in ((a, b), (b, a)))

    def copies_of_one_head(self, x: fx.Node) -> bool:
        """Whether ``x``'s heads are copies of one head every rank holds (the propagator tracks them)."""
        return False

    def _meets_as(self, x: fx.Node, s: Sharding, sq: Sharding) -> bool:
        """Does ``x`` (k or v of attention), cut as ``s``, give each rank the heads its query heads (cut as ``sq``)
        read? So it does where both cuts hold the same heads on every rank, however spelled (kv heads held whole
        and repeated to their query heads, ``[n_kv whole, repeats cut]``, against query heads cut per piece,
        DiffLlama's ``[(2, 2), (2, 2)]``), and where ``x``'s heads are copies of one head every rank holds
        (DiffLlama's half of v, one kv head, repeated) in as many local heads."""
        full = self.fp.shape(x)[s.dim]
        width = [sum(g.size for g in c.segments) for c in (s, sq)]
        if s.dim != sq.dim or s.inner or sq.inner or s.group or sq.group or not is_static(full) \
                or any(full % w if c.outer else full != w for c, w in zip((s, sq), width)):
            return False
        # the heads each rank holds under either cut (``outer``: [full / width whole, segments])
        held = [[shard_tensor(torch.arange(full), 0, c.segments, self.tp, r, c.outer) for c in (s, sq)]
                for r in range(self.tp)]
        if self.copies_of_one_head(x):
            return all(a.numel() == b.numel() for a, b in held)
        return all(torch.equal(a, b) for a, b in held)

    def head_minor(self, node: fx.Node, a: Sharding, b: Sharding) -> None:
        """Raise :class:`Strided` where heads cut in order (``a`` or ``b``) meet on the same dim heads repeated
        head-minor, ``[n_rep whole, kv heads cut]`` (an ``outer`` sharding): query head h reads kv head
        h % n_kv, so each rank's query heads in order would read other ranks' kv heads. The pair is analysed
        again with the in-order column cut with that stride; where the kv heads are fewer than tp no stride
        gives each rank its own (their copies sit on adjacent ranks, Megatron's way), and that is the reason."""
        plain, minor = (a, b) if b.outer else (b, a)
        if plain.outer or not minor.outer or plain.dim != minor.dim or plain.inner or minor.inner \
                or plain.group or minor.group:
            return
        heads, period = sum(g.size for g in plain.segments), sum(g.size for g in minor.segments)
        if heads % period or heads == period:
            return
        kv = f"{period} kv heads repeated head-minor (query head h reads kv head h % {period})"
        if any(g.parts != self.tp or g.inner for g in minor.segments):
            raise Unshardable(node, f"{kv} are fewer than tp={self.tp}: each kv head's query heads are not on the "
                                    "ranks that hold it")
        raise Strided(node, f"{kv} meet {heads} query heads cut in order", heads // period)

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
                self.head_minor(node, result, aligned)
                raise Unshardable(node, f"operands sharded differently: {result} vs {aligned}")
            result = aligned
        for x in operands:
            nd = ndim_of(x)
            if nd is None or self.spec(x) is not None:
                continue
            xd = result.dim - (out_nd - nd)
            if xd >= 0 and xd < nd - core and self.fp.shape(x)[xd] != 1:
                # a parameter of fewer dims is a per-head weight broadcast over the batch (a block-diagonal gate
                # ``(heads, i, j)`` against ``(b, heads, s, i)``): cut with the heads
                if (nd != out_nd and self._parameter(x) is None) \
                        or self.fp.shape(x)[xd] != self.fp.shape(node)[result.dim]:
                    raise Unshardable(node, f"replicated operand {x.name} spans the sharded batch dim")
                # a recurrent state started as zeros(b, heads, dk, dv), or a per-head parameter: this rank's heads
                self._local_operand(node, x, xd, result)
                continue
            self._enter_if_learned(node, x)
        return result

    def _on_sdpa(self, node: fx.Node, rule: OpRule) -> Sharding:
        """Attention per head: q, k and v sharded alike by heads; or one k and v head broadcast over the q
        heads (``(b, 1, s, d)``, multi-query), which every rank holds whole."""
        q, k, v = node.args[:3]
        mask = arg_of(node, 3, "attn_mask", None)
        gqa = bool(node.kwargs.get("enable_gqa", False))
        sq, sk, sv = self.spec(q), self.spec(k), self.spec(v)
        nd = ndim_of(q)
        if sq is None:
            raise Unshardable(node, "attention with replicated q")
        sk, sv = (sq if s is not None and s != sq and self._meets_as(x, s, sq) else s for x, s in ((k, sk), (v, sv)))
        for s in (sk, sv):  # v read by its halves of kv heads (DiffLlama) against q cut in order: cut q per piece
            if s is not None and len(s.segments) > 1 and len(set(s.segments)) == 1 and s.dim == sq.dim \
                    and not (s.inner or s.outer or s.group or sq.inner or sq.outer or sq.group) \
                    and sq.single() is not None and not sq.single().inner:
                raise Pieces(node, f"k or v cut in {len(s.segments)} equal pieces meets query heads cut in order",
                             len(s.segments))
        broadcast = [x for x, s in ((k, sk), (v, sv)) if s is None]
        if any(self.fp.shape(x)[nd - 3] != 1 for x in broadcast):
            raise Unshardable(node, "attention with replicated k or v of several heads")
        if sq.dim != nd - 3 or any(s is not None and s.dim != nd - 3 for s in (sk, sv)) \
                or (sk is not None and sv is not None and sk != sv):
            raise Unshardable(node, "attention not sharded by heads")
        if sk is not None and sq != sk and not gqa:
            self.head_minor(node, sq, sk)
            raise Unshardable(node, f"q and k heads sharded differently: {sq} vs {sk}")
        if sq.inner or (sk is not None and sk.inner):
            raise Unshardable(node, "attention over unmerged replicated heads")
        for x in broadcast:
            self._enter_if_learned(node, x)
        ops = [q] + ([mask] if isinstance(mask, fx.Node) else [])
        return self.batched(node, ops, 2)
