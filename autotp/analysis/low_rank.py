"""Low-rank branches added to a projection (LoRA's adapters, Zamba2's per-layer adapters of its shared block):
``y = W x + B(A(x))``, ``A: h -> r`` then ``B: r -> n``, ``W: h -> n``, found from the dataflow alone.

Megatron cuts such a branch with the projection it is added to: ``B`` column-parallel with ``W``'s split (each
rank the same features of ``B``'s output as of ``W``'s, so the sum is this rank's features of ``y``; fused
gate | up segment by segment, as :func:`~autotp.analysis.column_layout.column_segments` reads them from the
graph), ``A`` whole on every rank (its ``(b, s, r)`` output is small), and ``A``'s output entering ``B`` through f
(identity forward, all-reduce backward), so that ``A``'s gradient and ``x``'s are complete. Paired on its own
instead (``A`` column, ``B`` row), the branch's all-reduced output would be a replicated operand of ``W``'s
sharded output, and ``W`` would have no exact cut.

The pairing (:func:`~autotp.analysis.pairs.analyze`) tries ``B`` as a row only after every other row: the row
``W``'s output feeds (``down_proj``) then takes ``B`` as a column beside ``W``, and ``A``, read by that column
alone, is read whole (as DeepSeek's q_a_proj is by q_b_proj). Where that pair cannot be cut, ``B`` is still tried
as the row of ``A`` after it."""
from __future__ import annotations

import torch
import torch.fx as fx

from autotp.analysis.matmuls import ParamMatmul

aten = torch.ops.aten

_ADDS = (aten.add.Tensor, aten.add_.Tensor)


def low_rank_branches(matmuls: list[ParamMatmul], feed: dict[fx.Node, frozenset[fx.Node]]) -> set[fx.Node]:
    """The second matmuls ``B`` of the low-rank branches of ``matmuls`` (``feed``: each node's feeding matmuls,
    :func:`~autotp.analysis.pairs.feeders`). A branch is an ``add`` of two values, one fed by ``B`` alone, the
    other by ``W`` alone (through scales, casts, views), where ``B`` reads the output of one matmul ``A`` that
    no other matmul reads, ``A`` and ``W`` read the same activations (the same feeding matmuls: dropout on the
    adapter's input is no other activation), and ``B`` and ``W`` give as many features. Experts and embeddings
    are never one."""
    every = {m.node for m in matmuls}
    by_node = {m.node: m for m in matmuls if m.expert is None and m.kind != "embedding"}

    def fed(x: fx.Node) -> frozenset[fx.Node]:  # the matmuls whose outputs x is computed from; x itself if one
        return frozenset({x}) if x in every else feed.get(x, frozenset())

    readers: dict[fx.Node, int] = {}  # matmul -> how many matmuls read its output with no matmul in between
    for m in by_node.values():
        for a in fed(m.x):
            readers[a] = readers.get(a, 0) + 1
    out = set()
    for add in (n for m in by_node.values() for n in _adds_after(m.node)):
        operands = [a for a in add.args[:2] if isinstance(a, fx.Node)]
        if len(operands) != 2:
            continue
        sides = [fed(a) for a in operands]
        if any(len(s) != 1 for s in sides):
            continue
        (one,), (other,) = sides
        for b_node, w_node in ((one, other), (other, one)):
            b, w = by_node.get(b_node), by_node.get(w_node)
            if b is None or w is None or b is w or b.out_features != w.out_features:
                continue
            first = fed(b.x)
            if len(first) != 1 or (a := by_node.get(next(iter(first)))) is None or a is w:
                continue
            if readers.get(a.node) == 1 and fed(a.x) == fed(w.x):
                out.add(b.node)
    return out


def _adds_after(node: fx.Node, depth: int = 4) -> list[fx.Node]:
    """The adds within ``depth`` single-input steps (a scale, a cast, a view) of ``node``'s output."""
    out, todo = [], [(node, 0)]
    while todo:
        n, d = todo.pop()
        for u in n.users:
            if u.target in _ADDS:
                out.append(u)
            elif d < depth and len(u.all_input_nodes) == 1:
                todo.append((u, d + 1))
    return out
