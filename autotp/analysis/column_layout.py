"""How a column matmul's output is cut: plain, fused into segments, and heads per segment.

Read ahead of propagation along the projection's output: a split, chunk or offset slices of the feature
dim give the segments of a fused projection (q | k | v, gate | up); the first view that splits a segment
into ``[heads, head_dim]`` gives the unit of sharding; a view into ``[groups, per-group layout, d]`` read
apart by slices gives a grouped segment (Falcon's ``[n_kv, q heads + k + v, d]``).
"""
from __future__ import annotations

import sys

import torch.fx as fx

from autotp.errors import ShardingError
from autotp.analysis.op_rules import kind_of, op_rule, permutes
from autotp.analysis.ops import (Unshardable, arg_named, arg_of, moved_dim, ndim_of, parts_for, permutation, slice_range,
                                 split_dims, squeezed_dims, unflattened_sequence_of_one)
from autotp.analysis.shapes import Fingerprinter, normalize_dim, view_groups
from autotp.analysis.torch_rules import TorchRefused, ask_torch
from autotp.shard_spec import Segment


def column_segments(col: fx.Node, fp: Fingerprinter, tp: int, where: str, dim: int | None = None,
                    pieces: int = 1, one_head: bool = True) -> tuple[Segment, ...]:
    """Decide how a column matmul's output is cut: plain, fused (segments), and heads per segment.

    Looks ahead along the output: a split/chunk of the feature dim gives the segments of a fused
    projection; the first view that splits each segment into [heads, head_dim] gives the unit of sharding.
    ``pieces``: the heads are read later in that many equal pieces (:class:`~autotp.analysis.ops.Pieces`), each
    a segment of its own, cut by its heads. ``one_head``: features no view splits into heads but that attention
    reads as its per-head dim are one head every rank holds (False: plain features, the guess a pair falls back
    to where that one head meets features cut by channels).
    """
    nd = ndim_of(col)
    dim = nd - 1 if dim is None else dim  # the output features (last, but a batched matmul's may be another)
    n = fp.shape(col)[dim]
    found = _probe(col, dim, n, fp, tp, where, 0, pieces)
    if found is not None:
        return found
    if pieces == 1 and one_head and _per_head_dim(col, dim, fp, 0):
        # no view into heads, and attention reads the features as its per-head dim: one head every rank holds
        # (a multi-query key head projected (b, s, d) and pooled over windows of the sequence, DeepSeek-V4's
        # compressed keys (b, 1, s/m, d), read beside the query heads)
        return (Segment(n, 1),)
    if pieces > 1:
        raise Unshardable(col, f"{where}: no view into heads to cut in {pieces} pieces")
    return (Segment(n, parts_for(n, n, tp, f"{where}: output features")),)


def _fused(found: list[tuple[tuple[Segment, ...] | None, fx.Node | None, int, str]], dim: int, fp: Fingerprinter,
           tp: int) -> tuple[Segment, ...]:
    """The segments of a fused projection from what probing each one's reader found: ``(heads, reader, size,
    what)``. A segment that no view splits into heads is plain features; beside segments split into heads, it
    is one head where attention reads it as the per-head dim (multi-query keys kept as ``(b, s, d)`` and
    unsqueezed to ``(b, 1, s, d)``): every rank holds it. A segment split again (PaLM's ``q | k | v | ff``
    whose ff is chunked into SwiGLU's halves) is fused itself: its pieces are segments of their own, unequal
    ones included ([64, 16, 16, 128, 128]); a one-head segment split again (``rotate_half``'s halves of the
    one k head) stays one whole segment."""
    beside_heads = any(heads and len(heads) == 1 for heads, _, _, _ in found)
    if not beside_heads and all(heads is None and reader is not None and kind_of(reader.target) == "slice"
                                and _per_head_dim(reader, dim, fp, 0) for heads, reader, _, _ in found):
        # slices of one head's features, each read by attention as its per-head dim (a multi-query key kept
        # (b, 1, s, d) and rotated on its last features, ``k[..., :-r] | rotate(k[..., -r:])``): one head
        return (Segment(sum(n for _, _, n, _ in found), 1),)
    out = []
    for heads, reader, n, what in found:
        if heads and len(heads) == 1:
            out.append(heads[0])
            continue
        one = beside_heads and reader is not None and _per_head_dim(reader, dim, fp, 0)
        if heads and not one and sum(h.size for h in heads) == n:
            out.extend(heads)
            continue
        out.append(Segment(n, parts_for(1 if one else n, n, tp, what)))
    return tuple(out)


def _per_head_dim(node: fx.Node, dim: int, fp: Fingerprinter, depth: int,
                  seen: set[tuple[fx.Node, int]] | None = None) -> bool:
    """Is ``dim`` of ``node`` the per-head dim of attention: the last dim of scaled_dot_product_attention's
    q, k or v, or a matrix dim of a batched matmul of activations (``q @ k.transpose(-2, -1)``, ``att @ v``;
    a parameter's matmul has a 2-D operand)? Followed through transposes, unsqueezes, slices (of it: a head's
    rotary part), views that keep it, broadcasts and elementwise ops (repeat_kv's
    ``k[:, :, None].expand(..).reshape(..)``), joins, softmaxes and sums over other dims and buffers made from it
    (keys pooled over windows of the sequence and joined to the others)."""
    # deep enough for a key pooled over windows, normed, rotated and joined to the keys before attention
    # (DeepSeek-V4's compressed keys: some 20 ops); each (node, dim) is looked at once
    seen = set() if seen is None else seen
    if depth > 24 or (node, dim) in seen:
        return False
    seen.add((node, dim))
    nd = ndim_of(node)
    for u in node.users:
        rule = op_rule(u.target)
        kind = rule.kind if rule is not None else None
        if kind == "sdpa" and node in u.args[:3] and dim == nd - 1:
            return True
        if kind == "matmul" and node in u.args[:2] and dim >= nd - 2 \
                and all((ndim_of(a) or 0) >= 3 for a in u.args[:2]):
            return True
        moved = None
        if kind == "move":
            moved = _moved(node, u, dim, fp)
        elif kind == "slice":
            # a slice of another dim keeps this one; so does one of this dim itself (a head's rotary part)
            moved = dim
        elif kind == "split" and rule.form != "unbind" and normalize_dim(arg_named(u, "dim", 0), nd) != dim:
            # pieces of another dim keep this one (DiffLlama's v chunked into its two halves of kv heads)
            if any(kind_of(g.target) == "getitem" and _per_head_dim(g, dim, fp, depth + 1, seen) for g in u.users):
                return True
        elif kind == "view":
            src, dst = fp.shape(node), fp.shape(u)
            kept = [[j for j in gj if dst[j] != 1] for gi, gj in view_groups(src, dst)
                    if [i for i in gi if src[i] != 1] == [dim]]
            moved = kept[0][0] if kept and len(kept[0]) == 1 and dst[kept[0][0]] == src[dim] else None
        elif kind in ("same_shape", "pointwise") or (rule is not None and rule.broadcasts and u.args[0] is node):
            moved = dim + ndim_of(u) - nd if ndim_of(u) is not None else None
        elif kind == "cat" or (kind == "softmax" and normalize_dim(arg_of(u, 1, "dim", -1), nd) != dim):
            # joined along any dim (keys joined along the sequence, or a head's rotary part joined back to the
            # rest), or a softmax over another dim (over a window of positions): the dim stays where it was
            moved = dim if ndim_of(u) == nd else None
        elif kind == "reduction" and ndim_of(u) is not None:
            moved = _reduced(u, node, dim, nd)
        elif kind == "new_like" and u.args[0] is node and ndim_of(u) is not None:
            # a buffer made from it, dims aligned from the right, filled with its parts (DeepSeek-V4's pooled keys)
            moved = dim + ndim_of(u) - nd if dim + ndim_of(u) - nd >= 0 else None
        if moved is not None and _per_head_dim(u, moved, fp, depth + 1, seen):
            return True
    return False


def _reduced(u: fx.Node, node: fx.Node, dim: int, nd: int) -> int | None:
    """The dim of ``u`` (a sum or mean of ``node`` over other dims: a window of positions pooled) that ``dim``
    becomes; None when ``u`` reduces ``dim`` itself (a norm's statistics) or every dim."""
    dims = arg_of(u, 1, "dim", None)
    if not isinstance(dims, (list, tuple)) or not dims:
        return None
    gone = {normalize_dim(d, nd) for d in dims}
    if dim in gone:
        return None
    return dim if ndim_of(u) == nd else dim - sum(d < dim for d in gone)


def _moved(node: fx.Node, u: fx.Node, dim: int, fp: Fingerprinter) -> int | None:
    """The dim of ``u`` (an op of kind "move" reading ``node``) that ``dim`` of ``node`` becomes; None when
    ``u`` squeezes it away."""
    shape = fp.shape(node)
    return None if dim in squeezed_dims(u, shape) else moved_dim(u, dim, shape)


def _probe(node: fx.Node, dim: int, size: int, fp, tp, where, depth, pieces: int = 1
           ) -> tuple[Segment, ...] | None:
    if depth > 12:
        return None
    nd = ndim_of(node)
    slices = [u for u in node.users
              if kind_of(u.target) == "slice" and normalize_dim(arg_of(u, 1, "dim", 0), nd) == dim]
    ranges = sorted((slice_range(u, size), i) for i, u in enumerate(slices) if slice_range(u, size) is not None)
    if len(ranges) > 1 and len(ranges) == len(slices) and ranges[0][0][0] == 0 and ranges[-1][0][1] == size \
            and all(a[0][1] == b[0][0] for a, b in zip(ranges, ranges[1:])):
        # offset slices that tile the dim: the segments of a fused projection, in order
        return _fused([(_probe(slices[i], dim, hi - lo, fp, tp, where, depth + 1), slices[i], hi - lo,
                        f"{where}: segment") for (lo, hi), i in ranges], dim, fp, tp)
    for u in node.users:
        rule = op_rule(u.target)
        kind = rule.kind if rule is not None else None
        if kind == "split" and rule.form != "unbind":
            d = normalize_dim(arg_named(u, "dim", 0), ndim_of(node))
            if d != dim:
                continue
            found = []
            getitems = {g.args[1]: g for g in u.users if kind_of(g.target) == "getitem"}
            for i, o in enumerate(u.meta["val"]):
                sz = fp.shape(o)[d]
                heads = _probe(getitems[i], d, sz, fp, tp, where, depth + 1) if i in getitems else None
                found.append((heads, getitems.get(i), sz, f"{where}: segment {i}"))
            return _fused(found, d, fp, tp)
        if kind == "view":
            src, dst = fp.shape(node), fp.shape(u)
            for gi, gj in view_groups(src, dst):
                gj_real = split_dims(gj, dst)
                if dim in gi and unflattened_sequence_of_one(gj_real, dst, size):
                    return _probe(u, gj_real[1], size, fp, tp, where, depth + 1, pieces)
                if dim in gi and len([i for i in gi if src[i] != 1]) == 1 and len(gj_real) == 2:
                    n1, n2 = dst[gj_real[0]], dst[gj_real[1]]
                    tiles = _tiling(_dim_reads(u, gj_real[0], n1, 0), n1)
                    # Falcon's multi-query [n_heads + 2, d] read by slices: q heads, one k, one v. Pieces of one
                    # row each are heads only where attention reads d as the head dim; else they are segments
                    # of features (Moshi's gate | up, ``fc1(x).view(b, s, 2, -1)[..., 0, :]``), cut below
                    if tiles and (any(hi - lo > 1 for lo, hi in tiles) or _per_head_dim(u, gj_real[1], fp, 0)):
                        return tuple(Segment((hi - lo) * n2, parts_for(hi - lo, (hi - lo) * n2, tp, f"{where}: heads"))
                                     for lo, hi in tiles)
                if dim in gi and len([i for i in gi if src[i] != 1]) == 1 and len(gj_real) > 1:
                    n1 = dst[gj_real[0]]
                    grouped = _grouped(u, [dst[j] for j in gj_real], gj_real[1], size, tp, where) \
                        if len(gj_real) > 2 and _is_segment_dim(u, gj_real[1], 0) else None
                    if grouped is not None:  # Falcon's [n_kv, group + 2, d]: each kv group's q heads, k and v
                        return (grouped,)
                    # the outer dim taken apart (q | k | v), or read whole (E relative distances gathered along, of
                    # each of the heads after it, ``(b, s, E·n) -> (b, s, E, n)``): the inner dim is the heads
                    if _is_segment_dim(u, gj_real[0], 0) or _read_whole(u, gj_real[0], fp, tp, 0):
                        n2 = dst[gj_real[1]]
                        p = parts_for(n2, size // n1, tp, f"{where}: heads")
                        return tuple(Segment(size // n1, p) for _ in range(n1))
                    if pieces > 1 and n1 % pieces == 0:  # heads read in equal pieces: each a segment
                        return tuple(Segment(size // pieces, parts_for(n1 // pieces, size // pieces, tp,
                                                                       f"{where}: heads of each of {pieces} pieces"))
                                     for _ in range(pieces))
                    return (Segment(size, parts_for(n1, size, tp, f"{where}: heads")),)
                if dim in gi and len(gj_real) == 1:
                    return _probe(u, gj_real[0], size, fp, tp, where, depth + 1, pieces)
            continue
        if kind == "move":
            nd2 = _moved(node, u, dim, fp)
            r = _probe(u, nd2, size, fp, tp, where, depth + 1, pieces) if nd2 is not None else None
            if r is not None:
                return r
        elif kind == "cat" and normalize_dim(arg_of(u, 1, "dim", 0), ndim_of(u)) != dim:
            # joined along another dim (each expert's rows, tokens split by expert counts and joined again: the
            # features of every piece are laid out alike, (T_e, 2·I) -> (ΣT_e, 2·I)): read on after the join
            r = _probe(u, dim, size, fp, tp, where, depth + 1, pieces)
            if r is not None:
                return r
        elif (kind == "conv" and u.args[0] is node and dim == 1) or \
                (kind == "slice" and normalize_dim(arg_of(u, 1, "dim", 0), nd) != dim) or \
                (kind == "torch" and u.args[0] is node and _torch_keeps(u, node, dim, fp, tp)):
            # a depthwise convolution keeps each channel where it was; a slice of another dim keeps this one, and
            # so does an op torch's rule keeps on it (a pad over time)
            r = _probe(u, dim, size, fp, tp, where, depth + 1, pieces)
            if r is not None:
                return r
        elif kind in ("same_shape", "pointwise"):
            nd_u = ndim_of(u)
            rule = op_rule(u.target)
            if nd_u is None or rule is not None and rule.dtype_arg is not None and u.args[rule.dtype_arg] is node \
                    and u.args[0] is not node:  # ``W.type_as(x)`` reads only x's dtype: x's layout ends here
                continue
            r = _probe(u, dim + nd_u - ndim_of(node), size, fp, tp, where, depth + 1, pieces)
            if r is not None:
                return r
    return None


def _torch_keeps(u: fx.Node, node: fx.Node, dim: int, fp: Fingerprinter, tp: int) -> bool:
    """Does torch's sharding rule for ``u`` (an op autotp's table does not list) keep ``node`` cut on ``dim``
    where it was, at the same size? A pad of other dims does: a causal convolution's input left-padded over
    time, ``F.pad(x (b, c, l), (k - 1, 0))``. Only an op giving one tensor of the same rank is asked."""
    if ndim_of(u) != ndim_of(node):
        return False
    try:
        answer = ask_torch(u, {node: dim}, tp)
    except TorchRefused:
        return False
    return answer.outputs[:1] == (dim,) and fp.shape(u)[dim] == fp.shape(node)[dim]


def _grouped(view: fx.Node, dims: list[int], within: int, size: int, tp: int, where: str) -> Segment | None:
    """A view ``[groups, per-group width, d]`` whose per-group dim is read apart by slices (several q heads, k,
    v): a grouped segment. Ranks hold whole groups when tp divides the groups; with fewer groups than ranks
    each group is held by tp / groups ranks that split its q heads and each hold its k and v. None when each
    group is one head of each (``[n_heads, 3, d]``, also read by unbind): a contiguous cut by heads is already
    right (and any other reading of a group reaches the row matmul as blocks fewer than tp, an error)."""
    groups, width = dims[0], dims[1]
    unit = size // (groups * width)  # elements per unit of the per-group dim (the head dim)
    tiles = _tiling(_dim_reads(view, within, width, 0), width)
    if tiles is None or all(hi - lo == 1 for lo, hi in tiles):
        return None
    parts = parts_for(groups, size, tp, f"{where}: kv groups")
    copies = tp // parts
    inner = []
    for lo, hi in tiles:
        n = hi - lo
        if n % copies and n != 1:
            raise ShardingError(f"{where}: {n} heads of each of {groups} kv groups do not divide among the "
                                f"{copies} ranks that share a group (tp={tp})", hint=f"choose a tp that divides {groups}")
        inner.append(Segment(n * unit, copies if n % copies == 0 else 1))
    return Segment(size, parts, tuple(inner))


def _dim_reads(node: fx.Node, dim: int, size: int, depth: int) -> list[tuple[int, int] | None]:
    """The ranges of ``dim`` of ``node`` that slices, selects and splits read (None for one that is not a
    static range), also behind whole slices of other dims (``f[:, :, :, :-2]``, ``f[:, :, :, g]``)."""
    out, nd = [], ndim_of(node)
    if depth > 4:
        return out
    for u in node.users:
        rule = op_rule(u.target)
        kind = rule.kind if rule is not None else None
        if kind == "select" and normalize_dim(u.args[1], nd) == dim:
            i = u.args[2]
            out.append((i % size, i % size + 1) if isinstance(i, int) else None)
        elif kind == "split" and rule.form in ("size", "sizes", "chunks") \
                and normalize_dim(arg_named(u, "dim", 0), nd) == dim:
            start = 0  # pieces of sizes given (a chunk's follow from its count)
            for o in u.meta["val"]:
                out.append((start, start + o.shape[dim]) if isinstance(o.shape[dim], int) else None)
                start += o.shape[dim]
        if permutes(u.target):  # read apart after a transpose: ``v.view(b, s, n, d).transpose(1, 2).chunk(2, 1)``
            out += _dim_reads(u, permutation(u).index(dim), size, depth + 1)
        if kind != "slice":
            continue
        d = normalize_dim(arg_of(u, 1, "dim", 0), nd)
        full = node.meta["val"].shape[d]
        if d == dim:
            out.append(slice_range(u, size))
        elif slice_range(u, full) == (0, full) if isinstance(full, int) else arg_of(u, 2, "start", 0) in (0, None) \
                and arg_of(u, 3, "end", None) in (None, sys.maxsize):
            out += _dim_reads(u, dim, size, depth + 1)
    return out


def _tiling(reads: list[tuple[int, int] | None], size: int) -> list[tuple[int, int]] | None:
    """The ranges read that tile ``[0, size)`` into several pieces, in order; else None."""
    ranges = sorted(set(reads), key=lambda r: (-1, -1) if r is None else r)
    if len(ranges) < 2 or None in ranges or ranges[0][0] != 0 or ranges[-1][1] != size \
            or any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
        return None
    return ranges


def _read_whole(node: fx.Node, dim: int, fp: Fingerprinter, tp: int, depth: int) -> bool:
    """Does an op read ``dim`` of ``node`` whole: one that autotp's table does not list, whose torch rule will not
    keep it cut (``gather`` along it: each row picks from the whole dim)? Followed through dim moves, elementwise
    ops and views that keep it a dim of its own. ProphetNet's relative logits ``(b, s, buckets, heads)`` are
    gathered along the buckets, so its heads are the dim to cut."""
    if depth > 8:
        return False
    nd = ndim_of(node)
    for u in node.users:
        kind = kind_of(u.target)
        if kind == "torch" and u.args[0] is node:
            try:
                ask_torch(u, {node: dim}, tp)
            except TorchRefused:
                return True
            continue
        moved = None
        if permutes(u.target):
            moved = permutation(u).index(dim)
        elif kind in ("same_shape", "pointwise") and ndim_of(u) == nd:
            moved = dim
        elif kind == "view":
            kept = [gj for gi, gj in view_groups(fp.shape(node), fp.shape(u)) if gi == [dim] and len(gj) == 1]
            moved = kept[0][0] if kept else None
        if moved is not None and _read_whole(u, moved, fp, tp, depth + 1):
            return True
    return False


def _is_segment_dim(node: fx.Node, dim: int, depth: int) -> bool:
    """Is ``dim`` of ``node`` later taken apart (unbind/select/split)? Then it indexes q/k/v, not heads."""
    if depth > 6:
        return False
    nd = ndim_of(node)
    for u in node.users:
        kind = kind_of(u.target)
        if kind in ("split", "select") and normalize_dim(arg_named(u, "dim", 0), nd) == dim:
            return True
        if kind == "slice":
            full = node.meta["val"].shape[dim]
            if normalize_dim(arg_of(u, 1, "dim", 0), nd) == dim and isinstance(full, int) \
                    and slice_range(u, full) not in (None, (0, full)):
                return True
            if _is_segment_dim(u, dim, depth + 1):
                return True
        if permutes(u.target):
            if _is_segment_dim(u, permutation(u).index(dim), depth + 1):
                return True
        elif kind == "same_shape":
            if _is_segment_dim(u, dim, depth + 1):
                return True
    return False
