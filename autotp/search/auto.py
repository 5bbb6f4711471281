"""Choose the layout: enumerate what the sizes allow, drop what does not fit, rank the rest by predicted step.

The knobs (Narayanan et al. 2021; the README's layout search): tp ``t`` dividing the GPUs per node, the world and the attention heads; pp ``p``
dividing the blocks, ``t·p`` dividing the world; cp ``c`` dividing what is left, with the sequence in 2·c
equal chunks, where the model's attention runs as a ring (:attr:`ModelCosts.cp_refused`); dp =
world/(t·c·p), dividing the global batch; the
micro-batch size (a divisor of each replica's share, at most ``max_micro_batch``, or the one ``micro_batch``
given) and so the micro-batches
per step ``m`` (at least ``p`` with a pipeline); ``v`` stages per pipeline rank (the interleaved schedule:
L divisible by p·v, m by p); FSDP over dp, sequence parallelism over tp, full activation recomputation.
Candidates are ranked by predicted tokens per second per device (for a fixed global batch: by step time).
Each candidate is priced by :func:`autotp.search.cost.estimate`; one that needs more memory than the device
has is rejected with the amount it is over by. Only layouts autotp runs are priced (:func:`supported`: the
rule :func:`autotp.combinations.refused` that parallelize applies). ``runnable`` keeps to what ``autotp shard`` runs today
(a pipeline with plain tensor and data parallelism; no recomputation knob).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from autotp.search.cost import Candidate, Estimate, Memory, Training, estimate
from autotp.search.model_costs import ModelCosts
from autotp.search.hardware import Hardware
from autotp.combinations import refused

GiB = 2**30


@dataclass(frozen=True)
class Space:
    world: int
    gpus_per_node: int
    batch: int  # sequences per step: all replicas together, or each replica's with per_replica
    max_micro_batch: int = 16
    micro_batch: int | None = None  # the micro-batch size, fixed (Megatron-LM's --micro-batch-size); None: searched
    fsdp: tuple[bool, ...] = (False, True)
    sp: tuple[bool, ...] = (False, True)
    recompute: tuple[bool, ...] = (False, True)
    fsdp_mixed: tuple[bool, ...] = (False, True)  # FSDP gathering 16-bit weights (where activations are 16-bit)
    keep: tuple[bool, ...] = (False, True)  # FSDP kept gathered through a step's micro-batches (no pipeline)
    virtual: tuple[int, ...] = (1, 2, 4)
    context: bool = True  # context parallelism considered (where the model and the sequence allow it)
    runnable: bool = False
    per_replica: bool = False  # the batch is each data-parallel replica's (autotp shard: the example batch)

    def __post_init__(self) -> None:
        for name in ("world", "gpus_per_node", "batch", "max_micro_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.micro_batch is not None and not (isinstance(self.micro_batch, int) and self.micro_batch >= 1):
            raise ValueError(f"micro_batch must be a positive int or None, got {self.micro_batch!r}")


@dataclass(frozen=True)
class Rejected:
    candidate: Candidate
    reason: str
    over: float = 0.0  # bytes over the device's memory
    estimate: Estimate | None = None  # its price: the step it would take, the memory terms that reject it

    def to_dict(self) -> dict:
        return {"label": self.candidate.label(), "reason": self.reason, "over_bytes": self.over,
                **({"estimate": self.estimate.to_dict()} if self.estimate is not None else {})}


@dataclass(frozen=True)
class Search:
    ranked: tuple[Estimate, ...]  # fastest first
    rejected: tuple[Rejected, ...]
    considered: int
    notes: tuple[str, ...] = field(default=())

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None

    def fastest_rejected(self) -> Rejected | None:
        """The layout memory rules out that would have been the fastest (by tokens per second per device)."""
        priced = [r for r in self.rejected if r.estimate is not None]
        return max(priced, key=lambda r: r.estimate.tokens_per_device) if priced else None


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def tp_sizes(world: int, gpus_per_node: int, heads: int | None) -> list[int]:
    """The tensor-parallel sizes worth planning: dividing the GPUs of a node (a group never straddles two),
    the world and the heads."""
    return [t for t in divisors(world) if gpus_per_node % t == 0 and (heads is None or heads % t == 0)]


def cp_sizes(costs: ModelCosts, space: Space, rest: int, seq: int) -> list[int]:
    """The context-parallel sizes worth planning in ``rest`` ranks: 1, and where the model's attention runs as a
    ring, each divisor whose 2·cp chunks divide the sequence."""
    if not space.context or costs.cp_refused is not None:
        return [1]
    return [c for c in divisors(rest) if c == 1 or seq % (2 * c) == 0]


def candidates(costs: ModelCosts, space: Space, seq: int | None = None, mixed: str | None = None) -> Iterator[Candidate]:
    """Every layout the sizes allow (``seq``: the sequence trained on, default the captured one; ``mixed``: the
    16-bit dtype FSDP may gather in, where the activations are narrower than the parameters)."""
    L = costs.layers
    for t in tp_sizes(space.world, space.gpus_per_node, costs.heads):
        if t not in costs.tps:
            continue
        for p in divisors(L):
            if space.world % (t * p):
                continue
            for c in cp_sizes(costs, space, space.world // (t * p), seq or costs.seq):
                d = space.world // (t * p * c)
                if not space.per_replica and space.batch % d:
                    continue
                share = space.batch if space.per_replica else space.batch // d
                yield from _within(costs, space, t, c, d, p, share, mixed)


def _within(costs: ModelCosts, space: Space, t: int, c: int, d: int, p: int, share: int,
            mixed: str | None) -> Iterator[Candidate]:
    """The layouts of one (tp, cp, dp, pp) mesh: micro-batches, stages per rank, FSDP, sp, recomputation."""
    L = costs.layers
    for b in divisors(share):
        m = share // b
        if b > space.max_micro_batch or space.micro_batch not in (None, b) or p > 1 and m < p:
            continue
        for v in space.virtual if p > 1 else (1,):
            if v > 1 and (L % (p * v) or m % p):
                continue
            for fsdp in space.fsdp:  # over the dp × cp ranks: supported() refuses it at dp · cp = 1
                dtypes = [mixed if x else None for x in space.fsdp_mixed] if fsdp and mixed else [None]
                keeps = space.keep if fsdp and p == 1 and m > 1 else (False,)
                for dtype in dict.fromkeys(dtypes):
                    for keep in keeps:
                        for sp in space.sp if t > 1 else (False,):
                            for rc in space.recompute:
                                lay = Candidate(t, d, p, b, m, v, fsdp, sp, rc, c, dtype, keep)
                                # priced only where autotp runs it (autotp.combinations.refused)
                                if not supported(lay) or space.runnable and not runnable(lay):
                                    continue
                                yield lay


def supported(lay: Candidate) -> bool:
    """Whether autotp shards this layout today (:func:`autotp.combinations.refused`, the rule parallelize applies).
    Recomputation and gradient accumulation are the training script's (activation checkpointing in the
    model, several backwards per step). A model's checkpointed layers recompute in every layout this admits
    (the whole graph, each FSDP unit's piece, each pipeline stage's, with sequence and context parallelism),
    so ``rc`` is priced for each: its memory as measured (benchmarks/results/activation_recompute.md)."""
    return refused(pipeline=lay.pp * lay.v, schedule=lay.schedule, fsdp=lay.fsdp, sequence_parallel=lay.sp,
                   context_parallel=lay.cp, dp=lay.dp) is None


def runnable(lay: Candidate) -> bool:
    """What ``autotp shard`` runs by itself: a supported layout, one micro-batch per step without a pipeline,
    and no recomputation (its training loop has neither knob)."""
    return supported(lay) and not lay.recompute and not lay.keep and (lay.pp > 1 or lay.microbatches == 1)


def search(costs: ModelCosts, hw: Hardware, space: Space, training: Training = Training()) -> Search:
    ranked, rejected, n = [], [], 0
    mixed = training.act_dtype if training.act_bytes < costs.param_bytes else None
    for lay in candidates(costs, space, training.seq, mixed):
        n += 1
        est = estimate(costs, hw, lay, training)
        if est.memory.fits:
            ranked.append(est)
        else:
            rejected.append(Rejected(lay, memory_reason(est.memory), est.memory.over, est))
    # tokens per second per device: the step time when the global batch is fixed, and fair when it is not
    ranked.sort(key=lambda e: (-e.tokens_per_device, e.candidate.microbatches, e.memory.total))
    notes = []
    if not ranked and n:
        closest = min(rejected, key=lambda r: r.over)
        notes.append(f"no layout fits: the closest, {closest.candidate.label()}, {closest.reason}")
    if not n:
        notes.append(f"no layout: world {space.world}, {space.gpus_per_node} per node, global batch {space.batch}, "
                     f"{costs.layers} blocks, heads {costs.heads}: no tp ≤ {space.gpus_per_node} dividing world "
                     "and heads, pp dividing the blocks and dp the batch")
    if space.context and costs.cp_refused is not None and space.world > 1:
        notes.append(f"context parallelism not considered: {costs.cp_refused}")
    return Search(tuple(ranked), tuple(rejected), n, tuple(notes))


def memory_reason(mem: Memory) -> str:
    """``needs 157.6 GiB of 72.0 GiB (over by 85.6): state 20.1, activations 9.0, autocast weight copies 128.5``:
    the terms, largest first."""
    terms = [("state", mem.state), ("activations", mem.activations), *mem.parts]
    if not mem.parts and mem.other:
        terms.append(("other", mem.other))
    said = ", ".join(f"{k} {v / GiB:.1f}" for k, v in sorted(terms, key=lambda x: -x[1]) if v >= 0.01 * mem.total)
    return (f"needs {mem.total / GiB:.1f} GiB of {mem.capacity / GiB:.1f} GiB (over by {mem.over / GiB:.1f})"
            + (f": {said} GiB" if said else ""))


def _mesh(lay: Candidate) -> tuple[int, int, int]:
    return lay.tp, lay.cp, lay.pp


def mesh_name(lay: Candidate) -> str:
    """``tp 2 × pp 2``, with ``× cp c`` where there is context parallelism."""
    return f"tp {lay.tp}" + (f" × cp {lay.cp}" if lay.cp > 1 else "") + f" × pp {lay.pp}"


def best_per_mesh(result: Search) -> list[Estimate]:
    """The fastest layout of each (tp, cp, pp), fastest first."""
    seen, out = set(), []
    for e in result.ranked:
        key = _mesh(e.candidate)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def explain(result: Search) -> list[str]:
    """Why the winner wins: against the best layout of another (tp, cp, pp), the terms that differ most; what
    memory ruled out."""
    lines = []
    best = result.best
    if best is None:
        return list(result.notes)
    meshes = best_per_mesh(result)
    lay = best.candidate
    if len(meshes) > 1:
        other = meshes[1]
        diffs = sorted(((other.terms()[k] - v, k) for k, v in best.terms().items()), key=lambda x: -abs(x[0]))
        said = [f"{k} {abs(dv):.3g} s {'less' if dv > 0 else 'more'}" for dv, k in diffs[:3] if abs(dv) > 1e-9]
        if best.candidate.batch == other.candidate.batch:  # one global batch: the step times compare
            lines.append(f"{mesh_name(lay)} beats the best {mesh_name(other.candidate)} layout "
                         f"({other.candidate.label()}): {_secs(best.step)} per step against {_secs(other.step)} "
                         f"({best.tokens_per_device / other.tokens_per_device - 1:.1%} more tokens/s per device): "
                         f"{', '.join(said)}")
        else:  # per-replica batches (autotp shard --auto): the steps train different batches
            lines.append(f"{mesh_name(lay)} beats the best {mesh_name(other.candidate)} layout "
                         f"({other.candidate.label()}) by {best.tokens_per_device / other.tokens_per_device - 1:.1%} "
                         f"tokens/s per device (its step trains {best.candidate.batch} sequences, the other's "
                         f"{other.candidate.batch}: the terms are not compared)")
    same = [e for e in result.ranked[1:] if _mesh(e.candidate) == _mesh(lay)]
    if same:
        lines.append(f"within {mesh_name(lay)}, the next option ({same[0].candidate.label()}) is "
                     f"{best.tokens_per_device / same[0].tokens_per_device - 1:.1%} slower")
    if result.rejected:
        by_mesh = Counter(_mesh(r.candidate) for r in result.rejected)
        lines.append(f"memory ruled out {len(result.rejected)} of {result.considered} layouts "
                     f"({len(by_mesh)} meshes had some)")
        fastest = result.fastest_rejected()
        if fastest is not None:
            e = fastest.estimate
            gain = e.tokens_per_device / best.tokens_per_device - 1
            than = f"{gain:.1%} faster than the best" if gain > 5e-4 else \
                "no faster than the best" if gain > -5e-4 else f"{-gain:.1%} slower than the best"
            lines.append(f"the fastest layout ruled out, {fastest.candidate.label()} ({_secs(e.step)} per step, "
                         f"{than}), {fastest.reason}")
    return lines + list(result.notes)


def _secs(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"
