"""Matmuls whose output only chooses: it reaches the graph's outputs through integer or boolean values alone.

DeepSeek-V3.2's sparse-attention indexer scores every key for every query with its own small projections
(``wq_b``: the q latent -> (heads·d), ``wk``: h -> d, ``weights_proj``: h -> heads), sums the per-head scores
into ``(b, s, s)`` and keeps ``topk(...).indices``; attention then masks the keys not chosen. What the main
attention computes depends on those projections only through the chosen indices: no float value computed
from them reaches the loss or the outputs, so they get no gradient and only decide an index set.

Two exact cuts exist. Cut by its heads, each rank's partial ``(b, s, s)`` scores would need an all-reduce
before ``topk``: b·s² elements per layer (against b·s·h for attention's own all-reduce), and a sum reordered
across ranks can choose another key at a near tie, where the single-device model would not. Kept whole, every
rank computes the same scores as one device from the same replicated inputs (the latent is whole already, as
head-parallel latent attention keeps it), with no communication: that is the cut planned, by design.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autotp.analysis.matmuls import ParamMatmul

__all__ = ["chooses_only", "indexer_reason", "maker_of"]


def _discrete(val: object) -> bool:
    """An integer or boolean tensor: an index set or a mask, through which no gradient flows."""
    return isinstance(val, torch.Tensor) and not (val.dtype.is_floating_point or val.dtype.is_complex)


def chooses_only(node: fx.Node) -> list[fx.Node] | None:
    """The nodes at which every value computed from ``node`` turns discrete (``topk``'s indices, a comparison's
    mask), when no float value computed from it reaches the graph's output; None when one does (or none turns
    discrete: a value that reaches nothing is no choice, and a choice the graph returns as it is, ``argmax``'s
    indices of a head's logits, chooses among nothing of the model's). Walks the readers of ``node`` forward, stopping at
    discrete values; a tuple result (``topk``: values, indices) is followed through its ``getitem``s."""
    ends: list[fx.Node] = []
    seen: set[fx.Node] = set()
    todo = list(node.users)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "output":
            return None
        val = n.meta.get("val")
        if _discrete(val):
            ends.append(n)
            continue
        if isinstance(val, (torch.SymInt, int)) or val is None and not n.users:
            continue  # a size read carries no value onward; a check (``_assert_tensor_metadata``) gives none
        if not (isinstance(val, torch.Tensor) or isinstance(val, (tuple, list)) and
                any(isinstance(v, torch.Tensor) for v in val)):
            return None  # a value not known here (a region's call, a Python scalar): no claim
        todo.extend(n.users)
    if not ends or _returned(ends):
        return None  # the choice is itself an output (logits.argmax(-1) returned): nothing chosen among inside
    return ends


def _returned(ends: list[fx.Node]) -> bool:
    """Does a discrete value of ``ends`` reach the graph's output through discrete values alone?"""
    seen: set[fx.Node] = set()
    todo = list(ends)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u.op == "output":
                return True
            if _discrete(u.meta.get("val")):
                todo.append(u)
    return False


def maker_of(n: fx.Node) -> str:
    """The op that made the discrete value ``n`` (``topk`` for ``getitem(topk(...), 1)``)."""
    src = n.args[0] if n.target is operator.getitem and isinstance(n.args[0], fx.Node) else n
    return getattr(src.target, "__name__", str(src.target)).split(".")[0].lstrip("_")


def indexer_reason(m: ParamMatmul) -> str | None:
    """Why ``m`` stays whole when its output only chooses (:func:`chooses_only`), else None."""
    ends = chooses_only(m.node)
    if ends is None:
        return None
    ops = ", ".join(sorted({maker_of(n) for n in ends}))
    return (f"indexer kept whole: its {m.in_features}→{m.out_features} linear reaches the loss and the outputs "
            f"only through the integer or boolean values of {ops} (no gradient flows back to it); every rank "
            f"computes the whole choice as one device does, with no communication (cut by heads, its summed "
            f"scores would need an all-reduce before the choice, and a reordered sum can choose otherwise at a "
            f"near tie)")
