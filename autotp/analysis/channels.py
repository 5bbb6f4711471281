"""Channel-parallel mixers: the matmuls of one block that are cut by its inner width (channels) together.

A state-space mixer (Mamba) is not one column→row pair: its input projection makes the channels (x | z, cut
column-parallel per segment), a *reducing* projection reads the channel-cut x and gives a few replicated
features (Δ, B, C: ``x_proj``, ``(b, l, d_inner) -> (b, l, r + 2n)``), a projection of those makes channels
again (``dt_proj``, ``(b, l, r) -> (b, l, d_inner)``), and the output projection reads the channels back.
Megatron cuts it as one region: the input and Δ projections column-parallel, the reducing projection
row-parallel with one all-reduce of its ``b·l·(r + 2n)`` outputs (forward, and backward: every rank's
channels read them), the output projection row-parallel; the convolution, ``A_log``, ``D`` and the scan are
per channel and stay local.

Read from the dataflow alone: among the parameter matmuls that feed the output projection, those fed by
none of the others are the columns (level 0); a matmul fed by columns is a reduction (level 1); one fed by
reductions is a column again (level 2), and so on. :func:`channel_form` says which is which; the
propagation (:func:`~autotp.analysis.propagate.propagate` with ``reduces``) checks that the cut stays local.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch.fx as fx

from autotp.analysis.matmuls import ParamMatmul
from autotp.analysis.ops import Unshardable, reaches
from autotp.analysis.pair_region import Entering, PairRegion


class ChannelForm(NamedTuple):
    columns: list[ParamMatmul]  # in graph order: the sources first, then columns fed by reductions
    reduces: list[ParamMatmul]  # row-parallel inside the region, each completed by one all-reduce


def channel_form(found: frozenset[fx.Node], feed: dict[fx.Node, frozenset[fx.Node]],
                 by_node: dict[fx.Node, ParamMatmul], uses: dict[tuple[str, int | None], int],
                 index, through: bool = False) -> ChannelForm | None:
    """``found``: the parameter matmuls that reach ``row``'s input with no other in between (``index``: a node's
    place in the graph). The channel form
    when some of them feed others (a mixer, not a two-matmul pair), alternating columns and reductions by
    level (``through``: the feeders were found through per-head matmuls, which the region computes with, so
    columns alone make a form); None where the matmuls do not layer so (a reduction fed by a reduction, an embedding among them, a
    reduction with a bias every rank would add, a weight used elsewhere too)."""
    if not found or any(n not in by_node for n in found):
        return None
    fed_by = {n: feed[by_node[n].x] & found for n in found}
    if not any(fed_by.values()) and not through:
        return None
    level: dict[fx.Node, int] = {}

    def level_of(n: fx.Node, path: frozenset[fx.Node] = frozenset()) -> int:
        if n not in level:
            if n in path:
                raise RecursionError
            level[n] = 1 + max((level_of(m, path | {n}) for m in fed_by[n]), default=-1)
        return level[n]

    try:
        for n in found:
            level_of(n)
    except RecursionError:
        return None
    for n, ins in fed_by.items():  # a column is fed by reductions only, a reduction by columns only
        if any(level[m] % 2 == level[n] % 2 for m in ins):
            return None
    order = sorted(found, key=lambda n: (level[n], index(n)))
    columns = [by_node[n] for n in order if level[n] % 2 == 0]
    reduces = [by_node[n] for n in order if level[n] % 2 == 1]
    if not (reduces or through) or any(m.bias is not None or m.expert is not None or uses.get(m.key, 1) > 1
                          for m in reduces) or any(uses.get(m.key, 1) > 1 for m in columns):
        return None
    return ChannelForm(columns, reduces)


def check_columns_inside(form: ChannelForm, region: PairRegion) -> None:
    """A column fed by a reduction reads a replicated value whose gradient the reduction's backward all-reduce
    sums: never a channel-cut value directly; a parameter it is also computed from enters through its own f
    (:func:`beside_reductions`)."""
    sources = {c.node for c in form.columns if not _fed_inside(c, region)}
    for c in form.columns:
        if c.node in sources:
            continue
        if c.x in region.specs:
            raise Unshardable(c.node, f"column {c.module} reads a channel-cut value")
        # a parameter on the way (Jamba's RMSNorm weights of Δ after x_proj) has a partial gradient on each
        # rank: it enters through its own f, the reductions' all-reduce completing the rest
        for e in beside_reductions(region, c.x, lambda n: reaches(n, _is_parameter, lambda m: m in region.stats)):
            if e not in region.entering:
                region.entering.append(e)


def beside_reductions(region: PairRegion, x: fx.Node, learned: Callable[[fx.Node], bool]) -> list[Entering]:
    """Where a replicated ``x`` computed from reducing projections' outputs meets sharded values (or a column):
    each rank's gradient for it is partial. Along the way back to the reductions that gradient stays linear
    and the reductions' backward all-reduce completes it, so nothing enters there; each operand on the way
    that does not come from a reduction but is ``learned`` (a norm's weight over Δ, B or C: Jamba's
    ``b_layernorm.weight * rms(B)``, ``(n,)``) needs its own f, (reader, operand). Empty where ``x`` reads
    no reduction."""
    out: list[Entering] = []
    seen, todo = set(), [x]
    while todo:
        n = todo.pop()
        if n in seen or n in region.reduced or n in region.specs:
            continue
        seen.add(n)
        for a in n.all_input_nodes:
            if after_reduction(region, a):
                todo.append(a)
            elif learned(a) and Entering(n, a) not in out:
                out.append(Entering(n, a))
    return out


def after_reduction(region: PairRegion, x: fx.Node) -> bool:
    """Whether ``x`` is computed (replicated) from one of the region's reducing projections."""
    return bool(region.reduced) and reaches(x, lambda n: n in region.reduced, lambda n: n in region.specs)


def _is_parameter(n: fx.Node) -> bool:
    """A module parameter's get_attr (a buffer needs no gradient), looked up in its own module."""
    gm = n.graph.owning_module if n.op == "get_attr" else None
    if gm is None:
        return False
    path, _, leaf = n.target.rpartition(".")
    try:
        return leaf in (gm.get_submodule(path) if path else gm)._parameters
    except AttributeError:
        return False


def summed_inputs(form: ChannelForm, region: PairRegion) -> set[fx.Node]:
    """The inputs of columns fed by reductions: their gradient is summed by the reductions' all-reduce, so they
    enter through no f of their own."""
    return {c.x for c in form.columns if _fed_inside(c, region)}


def _fed_inside(c: ParamMatmul, region: PairRegion) -> bool:
    return reaches(c.x, lambda n: n in region.reduced)
