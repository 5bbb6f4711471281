"""The context-parallel part of a plan (:attr:`Plan.context <autotp.plan.plan.Plan.context>`): what
:func:`autotp.passes.context_parallel.context_parallel` rewrites, by node name. Made by
:func:`autotp.plan.context_planner.context_plan` from the analysis' facts."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RingCall:
    """An attention run as ring attention, with its causal flag and scale: an SDPA call (``node``, its q, k
    and v), or one written out (``node`` its ·v matmul, ``inputs`` the q, k and v it reads)."""

    node: str
    is_causal: bool
    scale: float | None
    inputs: tuple[str, ...] = ()
    folded: bool = False  # written with the heads folded into the batch: the output goes back to (b·h, s, d)


@dataclass(frozen=True)
class KeyedCall:
    """An attention written out with scores a ring cannot compute (a bias of distances, a window,
    soft-capping): ``keys`` (the scores' kᵀ and the ·v matmul's v: node, sequence dim) gathered whole over
    the group in sequence order; ``rows``, values made from positions that the scores read (node, query dim
    or None), computed at the whole length by copies of ``whole`` and cut to this rank's query rows."""

    scores: str
    out: str
    keys: tuple[tuple[str, int], ...]
    rows: tuple[tuple[str, int | None], ...]
    whole: tuple[str, ...]
    region: tuple[str, ...]  # the ops on the scores between the two matmuls: they read the rows
    # per key: the ops from the gathered value to the attention (the kv heads repeated after the gather),
    # and those whose size at the sequence dim becomes -1 (the whole length)
    spans: tuple[tuple[str, ...], ...] = ((), ())
    widen: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_dict(cls, d: dict) -> KeyedCall:
        return cls(d["scores"], d["out"], tuple((n, dim) for n, dim in d["keys"]),
                   tuple((n, dim) for n, dim in d["rows"]), tuple(d["whole"]), tuple(d["region"]),
                   tuple(tuple(span) for span in d.get("spans", ((), ()))),
                   tuple((n, dim) for n, dim in d.get("widen", ())))


@dataclass(frozen=True)
class TokenLoss:
    """A cross-entropy's mean, completed over the group's counted tokens."""

    node: str
    ignore_index: int
    label_smoothing: float


@dataclass(frozen=True)
class ContextPlan:
    cp: int
    inputs: tuple[tuple[str, int], ...]  # placeholders carrying the sequence: (name, sequence dim)
    positions: tuple[str, ...]  # aranges over the sequence: the chunk's global positions instead
    attention: tuple[RingCall, ...]
    losses: tuple[TokenLoss, ...]
    outputs: tuple[tuple[int, int], ...]  # outputs carrying the sequence: (output index, sequence dim), gathered
    # parameter reads (get_attr nodes) whose gradients cover this rank's tokens only: summed over the group
    grads: tuple[str, ...] = ()
    length: int = 0  # the sequence length it was planned at (every call's must divide by 2·cp)
    dropped: tuple[str, ...] = ()  # nodes only the replaced attentions read (written-out scores, masks)
    # values cut to this rank's chunk where ops on chunks read them: (node, sequence dim), the inputs or
    # what ops on the whole inputs made of them (``whole``: a label shift), which keep reading them whole
    chunks: tuple[tuple[str, int], ...] = ()
    whole: tuple[str, ...] = ()
    sizes: tuple[str, ...] = ()  # the sequence length read off the whole inputs: s/cp to ops on chunks
    tables: tuple[tuple[str, int], ...] = ()  # ``table[:s]`` along dim: the rows of the chunk's positions
    random: tuple[str, ...] = ()  # random ops on a chunk: each rank draws its own masks (a stream per chunk)
    keyed: tuple[KeyedCall, ...] = ()  # written-out attentions run with their keys and values gathered
    tied: tuple[tuple[str, str], ...] = ()  # a tensor's other reads (tied weights): (read, the one in ``grads``)

    @classmethod
    def from_dict(cls, d: dict) -> ContextPlan:
        return cls(d["cp"], tuple((n, dim) for n, dim in d["inputs"]), tuple(d["positions"]),
                   tuple(RingCall(**{**a, "inputs": tuple(a.get("inputs", ()))}) for a in d["attention"]), tuple(TokenLoss(**x) for x in d["losses"]),
                   tuple((i, dim) for i, dim in d["outputs"]), tuple(d.get("grads", ())), d.get("length", 0),
                   tuple(d.get("dropped", ())), tuple((n, dim) for n, dim in d.get("chunks", ())),
                   tuple(d.get("whole", ())), tuple(d.get("sizes", ())),
                   tuple((n, dim) for n, dim in d.get("tables", ())), tuple(d.get("random", ())),
                   tuple(KeyedCall.from_dict(k) for k in d.get("keyed", ())),
                   tuple((n, first) for n, first in d.get("tied", ())))
