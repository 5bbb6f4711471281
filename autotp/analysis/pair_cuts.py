"""How a column→row pair is cut: each column's segments on its output features, the region they give, and
the retries when that first cut does not hold (the query projection cut with the stride of repeated kv heads,
columns cut per piece where heads are read in equal pieces, a column taken for one head read as plain features
again). :mod:`autotp.analysis.pairs` finds the pairs and calls :func:`cut_pair` for each."""
from __future__ import annotations

import torch.fx as fx

from autotp.analysis.column_layout import column_segments
from autotp.analysis.matmuls import ParamMatmul, folded_refusal
from autotp.analysis.ops import Pieces, Strided, Unshardable
from autotp.analysis.pair_region import SharedValues
from autotp.analysis.propagate import PairRegion, propagate
from autotp.analysis.shapes import Fingerprinter
from autotp.errors import ShardingError
from autotp.shard_spec import Segment, Sharding


def cut_pair(columns: list[ParamMatmul], row: ParamMatmul, fp: Fingerprinter, tp: int, name: str,
         sides: list[ParamMatmul] = (), shared: SharedValues | None = None
         ) -> tuple[dict[fx.Node, Sharding], PairRegion]:
    """The columns' cuts (:func:`column_segments`, each on its output features) and the region they give.

    Where attention's query heads, cut in order, meet kv heads repeated head-minor (:class:`Strided`), the
    pair is propagated again with one column cut with that stride, ``[n_rep whole, width / n_rep cut]``, so
    that each rank's query heads are those of its own kv heads; the first column for which the region then
    holds is the query projection (the keys' or values' column cut so meets the others in order again)."""
    _refuse_folded(columns, row, sides, tp)
    try:
        return _cut_as(columns, row, fp, tp, name, sides, shared, one_head=True)
    except (Unshardable, ShardingError) as e:
        # a column no view splits into heads whose features some batched matmul reads as a per-head dim was
        # taken for one head every rank holds (a multi-query key head); where the pair then fails, read it as
        # plain features (a scan's channels, cut like the features they multiply), else the first reason stands
        plain = column_specs(columns, fp, tp, one_head=False)
        if plain == column_specs(columns, fp, tp, one_head=True):
            raise
        try:
            return _cut_as(columns, row, fp, tp, name, sides, shared, one_head=False)
        except (Unshardable, ShardingError):
            raise e from None


def column_specs(columns: list[ParamMatmul], fp: Fingerprinter, tp: int, one_head: bool) -> dict[fx.Node, Sharding]:
    """Each column's cut on its output features (:func:`column_segments`)."""
    specs = {}
    for c in columns:
        nd = c.node.meta["val"].dim()
        segs = column_segments(c.node, fp, tp, f"{c.module} (out_features={c.out_features})", c.y_dim % nd,
                               one_head=one_head)
        specs[c.node] = Sharding(c.y_dim % nd, segs)
    return specs


def _cut_as(columns: list[ParamMatmul], row: ParamMatmul, fp: Fingerprinter, tp: int, name: str,
            sides: list[ParamMatmul], shared: SharedValues | None, one_head: bool
            ) -> tuple[dict[fx.Node, Sharding], PairRegion]:
    """:func:`_cut` with the columns' features read as one head where attention reads them so (``one_head``) or
    as plain features."""
    specs = column_specs(columns, fp, tp, one_head)
    others = {m.node: (m.x, m.x_dim) for m in sides}
    try:
        region = propagate(specs, row.node, row.x, fp, tp, name, row.x_dim, sides=others, shared=shared)
        _refuse_folded(columns, row, sides, tp, specs, region)
        return specs, region
    except Strided as e:
        for c, s in specs.items():
            seg = s.single()
            if seg is None or seg.inner or seg.parts != tp or seg.size % e.blocks or (seg.size // e.blocks) % tp:
                continue
            tried = {**specs, c: Sharding(s.dim, (Segment(seg.size // e.blocks, tp),), outer=True)}
            try:
                return tried, propagate(tried, row.node, row.x, fp, tp, name, row.x_dim, sides=others,
                                        shared=shared)
            except Unshardable:
                continue  # not the query projection: the first attempt's reason stands
        raise
    except Pieces as e:
        return _cut_in_pieces(columns, specs, e, row, fp, tp, name, others)
    except Unshardable as e:
        blocks = _read_in_pieces(specs, tp)
        if blocks is None:
            raise
        # a column already cut per piece (DiffLlama's v by its halves of kv heads): the pieces were not met before
        # the cut failed, so cut the others per piece too; where a piece has fewer heads than ranks, that is the
        # reason (no exact cut keeps a pair on one rank), else where that fails too, the first reason stands
        for c in columns:
            s = specs[c.node]
            if s.single() is None or s.single().inner or s.outer or s.inner:
                continue
            try:
                segs = column_segments(c.node, fp, tp, f"{c.module} (out_features={c.out_features})", s.dim,
                                       pieces=blocks)
            except (ShardingError, Unshardable):
                raise e from None
            if segs[0].parts < tp:  # fewer heads in a piece than ranks: each piece's heads are held by several
                pairs = "pairs" if blocks == 2 else f"groups of {blocks}"
                raise Pieces(e.node, f"heads read in {blocks} equal pieces and paired across them (each rank needs "
                                     f"its heads of every piece): {c.module}'s {segs[0].parts} {pairs} of heads (head "
                                     f"i with head i + {segs[0].parts}) are fewer than tp={tp}, and a pair is never "
                                     "cut", blocks) from None
        try:
            return _cut_in_pieces(columns, specs, Pieces(e.node, e.reason, blocks), row, fp, tp, name, others)
        except Pieces:  # its pieces' heads, fewer than tp, reached the row
            raise
        except Unshardable:
            raise e from None


def _refuse_folded(columns: list[ParamMatmul], row: ParamMatmul, sides: list[ParamMatmul], tp: int,
                   specs: dict[fx.Node, Sharding] | None = None, region: PairRegion | None = None) -> None:
    """Unshardable where a weight flattened to a matrix (XLNet's ``(h, n, d)`` read as ``(h, n·d)``) cannot be cut
    on its heads: before the cut, where ``n`` does not split among the ranks (3 heads at tp 2; a row's 2 heads at
    tp 4), so the block is left whole with that reason rather than the plan stopping on a ShardingError; with the
    cut (``specs``, ``region``), where a rank's block of the matrix is not whole heads of ``d``."""
    mats = [(c, c.out_dim, False, specs[c.node].segments if specs else ()) for c in columns if c.kind != "embedding"]
    mats.append((row, row.in_dim, True, region.row_input.segments if region else ()))
    mats += [(m, m.in_dim, True, region.sides[m.node].segments if region else ()) for m in sides]
    for m, dim, is_row, segs in mats:
        why = folded_refusal(m, dim, tp, is_row, segs)
        if why is not None:
            raise Unshardable(m.node, why)


def _read_in_pieces(specs: dict[fx.Node, Sharding], tp: int) -> int | None:
    """The number of equal pieces one column is cut in, each held by several ranks (v read apart by its halves of
    kv heads, fewer than tp), beside a column cut in order (one segment); None where there is none."""
    plain = [s for s in specs.values() if s.single() is not None and not (s.single().inner or s.outer or s.inner)]
    pieces = [len(s.segments) for s in specs.values() if len(s.segments) > 1 and len(set(s.segments)) == 1
              and s.segments[0].parts < tp and not (s.inner or s.outer or s.group)]
    return pieces[0] if plain and pieces else None


def _cut_in_pieces(columns: list[ParamMatmul], specs: dict[fx.Node, Sharding], e: Pieces, row: ParamMatmul,
                   fp: Fingerprinter, tp: int, name: str, others: dict[fx.Node, tuple[fx.Node, int]]
                   ) -> tuple[dict[fx.Node, Sharding], PairRegion]:
    """The pair propagated again with every column cut in order cut per piece instead (:class:`Pieces`): heads
    read in ``e.blocks`` equal pieces (DiffLlama's head ``i`` paired with head ``i + n/2``, 4 query heads of 16 at
    tp 2: q ``[(32, 2), (32, 2)]``, rank 0 heads 0 and 2), so that a rank's heads of one piece meet its heads of
    the others. Pieces with fewer heads than ranks cannot be cut so: Unshardable, naming them."""
    tried = dict(specs)
    for c in columns:
        s = specs[c.node]
        if s.single() is None or s.single().inner or s.outer or s.inner:
            continue  # already cut per piece (v read apart by its halves of kv heads)
        where = f"{c.module} (out_features={c.out_features})"
        tried[c.node] = Sharding(s.dim, column_segments(c.node, fp, tp, where, s.dim, pieces=e.blocks))
    try:
        return tried, propagate(tried, row.node, row.x, fp, tp, name, row.x_dim, sides=others)
    except ShardingError as why:  # a piece's heads fewer than tp reach the row: no exact Megatron cut
        raise Pieces(e.node, f"heads read in {e.blocks} equal pieces and paired across them (each rank needs its "
                             f"heads of every piece): {str(why).splitlines()[0].removeprefix(name + ': ')}", e.blocks
                     ) from None
