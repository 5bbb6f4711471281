"""The numbers behind ``autotp plan``: what a :class:`~autotp.plan.plan.Plan` costs for one concrete batch.

Pure functions over a Plan, the model's named parameters (shapes and dtypes only, meta tensors are fine)
and a batch size ``b`` and sequence length ``s``. Nothing here prints; the CLI renders the result.

Collective shapes in a Plan are strings of symbolic sizes, read for the batch by :mod:`autotp.reports.symbols`;
a symbol that is neither the batch nor the sequence leaves the element count of the collectives that use
it unknown (``None``) and is listed in ``notes``.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

from autotp.plan.plan import SEQ_PARAMS, Plan
from autotp.reports.symbols import captured, display, elements, evaluate, parse, symbol_roles

# Megatron's accounting (README, "What a step costs"): weights + gradients + Adam moments in mixed precision (or fp32 Adam) ≈ 16 bytes/param.
TRAIN_BYTES_PER_PARAM = 16


def _ratio(a: int | None, b: int | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _ratio_of(a: str, b: str) -> property:
    """A record's ``a / b`` as a property (None where either is unknown, or ``b`` is 0)."""
    return property(lambda self: _ratio(getattr(self, a), getattr(self, b)))


@dataclass(frozen=True)
class ParamRow:
    name: str  # the plan's name for a sharded parameter, else its first name in the model
    module: str
    role: str  # "column" | "row" | "vocab" | "replicated"
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str
    full_bytes: int
    local_bytes: int
    aliases: tuple[str, ...]  # every name the model reaches this tensor by (tied weights have several)
    reason: str = ""  # why a replicated parameter stays whole


@dataclass(frozen=True)
class CollectiveRow:
    direction: str
    kind: str
    op: str
    module: str  # the plan's module (a pair, an embedding, an LM head)
    at: str  # the parameter-owning module it sits next to, for per-layer tables
    node: str
    shape: str  # symbolic, with the capture's symbols renamed b and s: "b×s×64"
    elements: int | None  # for the concrete b and s; None when a size could not be resolved
    bytes: int | None


@dataclass(frozen=True)
class FormulaTerm:
    """One term of Megatron's per-step communication (README, "What a step costs"), for this plan's structure."""

    direction: str
    op: str
    what: str
    count: int
    each: str  # "b·s·h" or "b·s"
    elements: int | None  # per collective
    kind: str = "all_reduce"  # "reduce_scatter" / "all_gather" with sequence parallelism


@dataclass(frozen=True)
class CommLine:
    """Measured (the plan's collectives) against the formula, for one (direction, kind, op)."""

    direction: str
    kind: str
    op: str
    count: int
    formula_count: int
    elements: int | None
    formula_elements: int | None
    bytes: int | None = None  # in the dtypes that travel

    count_ratio = _ratio_of("count", "formula_count")
    elements_ratio = _ratio_of("elements", "formula_elements")


@dataclass(frozen=True)
class Memory:
    params: int  # every distinct parameter, counted once
    sharded: int  # P_sharded: full size of the sharded parameters
    replicated: int  # P_replicated
    local: int  # parameters one tp rank holds (sharded slices, vocab padding included, + replicated)
    bytes_full: int  # in the model's own dtypes
    bytes_per_rank: int
    train_bytes_full: int  # 16 bytes/param
    train_bytes_per_rank: int  # 16 · local
    formula_bytes: int  # 16·P_sharded/t + 16·P_replicated
    ideal_bytes: int  # 16·P/t: everything sharded, nothing padded

    formula_ratio = _ratio_of("train_bytes_per_rank", "formula_bytes")
    ideal_ratio = _ratio_of("train_bytes_per_rank", "ideal_bytes")


@dataclass(frozen=True)
class Report:
    tp: int
    batch: int
    seq: int
    hidden: int | None
    layers: float  # L = pairs / 2 (attention + MLP per layer)
    symbols: dict[str, str]  # capture symbol -> "b" | "s"
    act_bytes: int  # bytes per activation element (the dominant parameter dtype)
    params: tuple[ParamRow, ...]
    collectives: tuple[CollectiveRow, ...]
    formula: tuple[FormulaTerm, ...]
    comm: tuple[CommLine, ...]
    memory: Memory
    notes: tuple[str, ...] = ()

    def total(self) -> CommLine:
        """All directions and kinds together."""
        def add(xs):
            return None if any(x is None for x in xs) else sum(xs)
        return CommLine("total", "all", "all", sum(c.count for c in self.comm),
                        sum(c.formula_count for c in self.comm), add([c.elements for c in self.comm]),
                        add([c.formula_elements for c in self.comm]), add([c.bytes for c in self.comm]))

    def to_dict(self) -> dict:
        d = asdict(self)
        lines = [*self.comm, self.total()]
        d["comm"] = [{**asdict(c), "count_ratio": c.count_ratio, "elements_ratio": c.elements_ratio} for c in lines]
        d["memory"] = {**asdict(self.memory), "formula_ratio": self.memory.formula_ratio,
                       "ideal_ratio": self.memory.ideal_ratio}
        return d


# -- parameters ---------------------------------------------------------------------------------------
def _replicated_reason(name: str, plan: Plan, row_biases: set[str], ndim: int = 2) -> str:
    if plan.tp == 1:
        return "tp 1: nothing is sharded"
    if name in row_biases and plan.sequence is not None and plan.sequence.leaves:
        return "row-parallel bias: added once, after the reduce-scatter (its gradient summed over the group)"
    if name in row_biases:
        return "row-parallel bias: added once, after the all-reduce"
    for w in plan.whole:
        if w.name == name:
            return w.reason
    for module, reason in plan.replicated:
        if name.startswith(module + ".") or module == "<root>":
            return f"{module} left replicated: {reason}"
    if ndim < 2:
        return "a vector outside the sharded regions (a norm's weight or bias): applied whole, as Megatron does"
    return "outside every column→row pair and vocab-parallel layer"


def param_rows(plan: Plan, named_params: Iterable[tuple[str, torch.Tensor]]) -> tuple[ParamRow, ...]:
    """One row per distinct tensor (by identity), in the model's order.

    ``named_params`` should list every alias (``named_parameters(remove_duplicate=False)``) so a tied
    weight is found under whichever name the plan uses, and counted once.
    """
    groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, p in named_params:
        groups.setdefault(id(p), []).append((name, p))
    planned = dict(plan.params)
    row_biases = {p.row_bias for p in plan.pairs if p.row_bias}
    rows = []
    for group in groups.values():
        names = tuple(n for n, _ in group)
        t = group[0][1]
        size = t.element_size()
        name = next((n for n in names if n in planned), names[0])
        shard = planned.get(name)
        full = tuple(t.shape)
        if shard is None:
            rows.append(ParamRow(name, _module(name), "replicated", full, full, _dtype(t), t.numel() * size,
                                 t.numel() * size, names, _replicated_reason(name, plan, row_biases, t.dim())))
        else:
            local = tuple(shard.local_shape)
            rows.append(ParamRow(name, shard.module, shard.role, full, local, _dtype(t), t.numel() * size,
                                 math.prod(local) * size, names))
    return tuple(rows)


def _module(name: str) -> str:
    return name.rpartition(".")[0] or "<root>"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def memory(rows: tuple[ParamRow, ...], tp: int) -> Memory:
    numel = {r.name: math.prod(r.full_shape) for r in rows}
    sharded = sum(numel[r.name] for r in rows if r.role != "replicated")
    replicated = sum(numel[r.name] for r in rows if r.role == "replicated")
    local = sum(math.prod(r.local_shape) for r in rows)
    k = TRAIN_BYTES_PER_PARAM
    return Memory(
        params=sharded + replicated, sharded=sharded, replicated=replicated, local=local,
        bytes_full=sum(r.full_bytes for r in rows), bytes_per_rank=sum(r.local_bytes for r in rows),
        train_bytes_full=k * (sharded + replicated), train_bytes_per_rank=k * local,
        formula_bytes=round(k * sharded / tp + k * replicated), ideal_bytes=round(k * (sharded + replicated) / tp),
    )


# -- communication ------------------------------------------------------------------------------------
def _attach(plan: Plan) -> dict[tuple[str, str], str]:
    """(direction, node) -> the parameter-owning module a pair's collective sits next to."""
    out = {}
    seq = plan.sequence
    for p in plan.pairs:
        row = plan.param(p.row_weight)
        out[("forward", p.row)] = row.module if row else p.module
        col = plan.param(p.column_weights[0]) if p.column_weights else None
        for node in p.enter:
            out[("backward", node)] = col.module if col else p.module
        leave = seq.leave(p.row) if seq is not None else None
        for e in [e for e in seq.enters if e.module == p.module and e.x in p.enter] if seq is not None else ():
            out[("forward", e.node)] = out[("backward", e.node)] = col.module if col else p.module
        if leave is not None:  # sequence parallelism: reduce-scatter forward, all-gather backward
            out[("forward", leave.node)] = out[("backward", leave.node)] = row.module if row else p.module
    return out


def formula_terms(plan: Plan, b: int, s: int, h: int | None) -> tuple[FormulaTerm, ...]:
    """Megatron's per-step communication (README, "What a step costs") for this plan's structure: 2L = one forward and one backward all-reduce per pair (per MoE layer for its experts), one
    more each way when the embedding / LM head are vocab-parallel, 3 reductions of b·s per vocab loss."""
    if plan.tp == 1:
        return ()
    bsh = None if h is None else b * s * h
    if plan.sequence is not None and plan.sequence.leaves:
        return _sequence_terms(plan, b, s, bsh)
    # the experts of a MoE layer are pairs that share one all-reduce each way (their summed output, their input)
    outputs = len({p.leave_at or p.row for p in plan.pairs})
    inputs = sum(1 for p in plan.pairs if p.enter)
    terms = [FormulaTerm("forward", "sum", "2L attention/MLP outputs", outputs, "b·s·h", bsh),
             FormulaTerm("backward", "sum", "2L attention/MLP inputs", inputs, "b·s·h", bsh)]
    if plan.vocab.embeddings:
        terms.append(FormulaTerm("forward", "sum", "vocab-parallel embedding", len(plan.vocab.embeddings),
                                 "b·s·h", bsh))
    if plan.vocab.heads:
        terms.append(FormulaTerm("backward", "sum", "LM-head input", len(plan.vocab.heads), "b·s·h", bsh))
    if plan.vocab.losses:
        n = len(plan.vocab.losses)
        terms += [FormulaTerm("forward", "max", "cross-entropy row max", n, "b·s", b * s),
                  FormulaTerm("forward", "sum", "cross-entropy target logit + sum exp", 2 * n, "b·s", b * s)]
    return tuple(t for t in terms if t.count)


def _sequence_terms(plan: Plan, b: int, s: int, bsh: int | None) -> tuple[FormulaTerm, ...]:
    """With sequence parallelism (Korthikanti et al. 2022): each all-reduce of b·s·h becomes a reduce-scatter
    and an all-gather of the same tensor, in both passes; a column group that keeps only s/t of its input
    gathers it again backward; the parameters applied to s/t positions have their gradients summed once."""
    two_l = len(plan.pairs)
    emb, heads = len(plan.vocab.embeddings), len(plan.vocab.heads)
    regather = sum(e.regather for e in plan.sequence.enters)
    terms = [FormulaTerm("forward", "sum", "2L attention/MLP outputs + embedding", two_l + emb, "b·s·h", bsh,
                         "reduce_scatter"),
             FormulaTerm("forward", "", "2L attention/MLP inputs + LM head", two_l + heads, "b·s·h", bsh, "all_gather"),
             FormulaTerm("backward", "sum", "2L attention/MLP input gradients + LM head", two_l + heads, "b·s·h", bsh,
                         "reduce_scatter"),
             FormulaTerm("backward", "", "2L attention/MLP output gradients + embedding", two_l + emb, "b·s·h", bsh,
                         "all_gather"),
             FormulaTerm("backward", "", "inputs gathered again for the weight gradients", regather, "b·s·h", bsh,
                         "all_gather")]
    # a replicated value with a gradient (a learned position table, (s, h): no batch dim) added to s/t
    # positions is cut to this rank's rows; its gradient is all-gathered back whole. Megatron adds positions
    # before its scatter, so it all-reduces the embedding forward (twice a reduce-scatter's bytes) instead.
    sliced = sum(1 for sl in plan.sequence.slices if sl.grad)
    terms.append(FormulaTerm("backward", "", "gradients of replicated tables added to s/t positions", sliced,
                             "s·h", None if bsh is None else bsh // b, "all_gather"))
    if plan.sequence.grads:  # one sum, or with FSDP one per unit
        sums = sum(1 for c in plan.collectives if c.module == SEQ_PARAMS and c.kind == "all_reduce") or 1
        what = "gradients of parameters applied to s/t positions" + \
            (f" (per {plan.sequence.grads_by})" if sums > 1 else "")
        terms += [FormulaTerm("backward", "sum", what, 1, "P_seq", None) for _ in range(sums)]
    if plan.vocab.losses:
        n = len(plan.vocab.losses)
        terms += [FormulaTerm("forward", "max", "cross-entropy row max", n, "b·s", b * s),
                  FormulaTerm("forward", "sum", "cross-entropy target logit + sum exp", 2 * n, "b·s", b * s)]
    return tuple(t for t in terms if t.count)


def comm_lines(rows: tuple[CollectiveRow, ...], terms: tuple[FormulaTerm, ...]) -> tuple[CommLine, ...]:
    keys = list(dict.fromkeys([*((r.direction, r.kind, r.op) for r in rows),
                               *((t.direction, t.kind, t.op) for t in terms)]))
    lines = []
    for key in keys:
        mine = [r for r in rows if (r.direction, r.kind, r.op) == key]
        theirs = [t for t in terms if (t.direction, t.kind, t.op) == key]
        el = None if any(r.elements is None for r in mine) else sum(r.elements for r in mine)
        fel = None if any(t.elements is None for t in theirs) else sum(t.count * t.elements for t in theirs)
        size = None if any(r.bytes is None for r in mine) else sum(r.bytes for r in mine)
        lines.append(CommLine(*key, len(mine), sum(t.count for t in theirs), el, fel, size))
    return tuple(lines)


def build_report(plan: Plan, named_params: Iterable[tuple[str, torch.Tensor]], batch: int, seq: int,
                 cp: int = 1) -> Report:
    """Everything ``autotp plan`` prints, for a training step on a ``batch`` × ``seq`` batch.

    ``cp`` > 1: the batch's sequences are split over that many context-parallel ranks, so each rank's tensor-
    parallel collectives (and the formula's terms) carry its ``seq / cp`` positions; ``Report.seq`` stays the
    whole length."""
    notes = []
    roles = symbol_roles(plan)
    # a dim export fixed to a number is what the graph computes, whatever batch was asked for
    b, s = batch, seq
    for dim, what in ((0, "batch"), (1, "sequence")):
        fixed = captured(plan, dim)
        if fixed is not None and fixed != (b, s)[dim]:
            notes.append(f"the {what} dim was fixed at {fixed} during capture (export specialises size 1); "
                         f"numbers use {fixed}, not {(b, s)[dim]}")
            b, s = (fixed, s) if dim == 0 else (b, fixed)
    s_local = s // cp  # the positions one rank's collectives carry
    values = {sym: (b if role == "b" else s_local) for sym, role in roles.items()}
    rows = param_rows(plan, named_params)
    act_bytes = _act_bytes(rows)
    attach = _attach(plan)
    collectives = []
    unknown: set[str] = set()
    for c in plan.collectives:
        n = elements(c.shape, values)
        if n is None:
            unknown |= {str(x) for t in c.shape if (e := parse(t)) is not None for x in e.free_symbols} - set(roles)
        collectives.append(CollectiveRow(c.direction, c.kind, c.op, c.module, attach.get((c.direction, c.node), c.module),
                                         c.node, display(c.shape, roles), n,
                                         None if n is None else n * itemsize(c.dtype, act_bytes)))
    if unknown:
        notes.append(f"sizes {', '.join(sorted(unknown))} are neither batch nor sequence: "
                     "collectives using them have no element count")
    h = _hidden(plan, values)
    terms = _sized(formula_terms(plan, b, s_local, h), collectives)
    return Report(plan.tp, b, s, h, len(plan.pairs) / 2, roles, act_bytes, rows, tuple(collectives), terms,
                  comm_lines(tuple(collectives), terms), memory(rows, plan.tp), tuple(notes))


def _sized(terms: tuple[FormulaTerm, ...], rows: list[CollectiveRow]) -> tuple[FormulaTerm, ...]:
    """The size of each sequence-parallel parameters' gradient sum is the plan's own (norm widths and biases)."""
    grads = iter([r.elements for r in rows if r.kind == "all_reduce" and r.module == SEQ_PARAMS])
    return tuple(FormulaTerm(t.direction, t.op, t.what, t.count, t.each, next(grads, None), t.kind)
                 if t.each == "P_seq" else t for t in terms)


def _hidden(plan: Plan, values: dict[str, int]) -> int | None:
    """h: the last dim of a row-parallel output (the pair's forward all-reduce), else of the embedding's."""
    forward = {p.row for p in plan.pairs} | {n for n, _ in plan.vocab.embeddings}
    if plan.sequence is not None:  # a reduce-scatter may follow a view of the row
        forward |= {x.node for x in plan.sequence.leaves}
    for c in plan.collectives:
        if c.direction == "forward" and c.node in forward and c.shape:
            return evaluate(c.shape[-1], values)
    return None


def itemsize(dtype: str, default: int) -> int:
    """Bytes per element of a collective's dtype as the plan records it; ``default`` for plans without one."""
    dt = getattr(torch, dtype, None) if dtype else None
    return torch.empty((), dtype=dt, device="meta").element_size() if isinstance(dt, torch.dtype) else default


def _act_bytes(rows: tuple[ParamRow, ...]) -> int:
    """Activations are taken to have the dtype holding most floating-point parameters (fp32 by default)."""
    by_dtype: Counter[str] = Counter()
    for r in rows:
        by_dtype[r.dtype] += math.prod(r.full_shape)
    for name, _ in by_dtype.most_common():
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype) and dt.is_floating_point:
            return torch.empty((), dtype=dt, device="meta").element_size()
    return 4


# -- FSDP over the data-parallel ranks ------------------------------------------------------------------
ROOT_UNIT = "<root>"  # FSDP's outermost unit: the model itself, holding every parameter no unit owns
RESHARDED = ("first", "block")  # the kinds of unit FSDP frees after forward and gathers again for backward


@dataclass(frozen=True)
class FSDPUnitRow:
    """One FSDP unit: a unit of the plan (``kind`` "first": the embeddings, "block": a repeated block, "last":
    the final norm and LM head) or the root ("root": what no unit owns, e.g. a tied embedding / LM head)."""

    module: str  # the unit's (first) module name, or ROOT_UNIT
    kind: str  # "first" | "block" | "last" | "root"
    tensors: int  # distinct tensors, a tied one once
    params: int  # elements of the full (unsharded) tensors
    local: int  # elements one TP rank holds: what FSDP all-gathers over dp
    gathered_bytes: int  # this TP rank's shards whole, in the gather dtype (FSDP's param_dtype, else the
    # parameters' own): one all-gather's output
    # what one rank keeps between gathers: dim 0 of each TP shard cut in d, FSDP's padding included
    sharded_bytes: int
    modules: tuple[str, ...] = ()  # the modules FSDP shards as this unit (none for the root: the model)
    reduced_bytes: int = 0  # its gradients whole in the reduce dtype (FSDP's reduce_dtype, else the parameters')

    @property
    def resharded(self) -> bool:
        """Freed after its forward and gathered again for its backward (the last unit and the root are kept)."""
        return self.kind in RESHARDED


@dataclass(frozen=True)
class FSDPTraffic:
    """One kind of FSDP collective in one training step, per rank, over the d data-parallel ranks."""

    direction: str  # "forward" | "backward"
    kind: str  # "all_gather" | "reduce_scatter"
    what: str
    count: int
    bytes: int  # the gathered (or reduced) size of all of them, in the gather (or reduce) dtype
    sent: int  # what a ring sends per rank: (d−1)/d × bytes


@dataclass(frozen=True)
class FSDPReport:
    """What FSDP (``autotp.parallelize(model, fsdp=True)``, resharding after forward, prefetching one unit)
    adds to tensor parallelism at tp ``t`` and dp ``d``, per rank and per training step."""

    tp: int
    dp: int
    units: tuple[FSDPUnitRow, ...]  # in the order they run: first, blocks, last, then the root
    local: int  # elements per TP rank (Memory.local): P/t with replicated parameters counted whole
    state_bytes: int  # 16·(P/t)/d: weights, gradients and Adam state, sharded over dp (× cp)
    kept_bytes: int  # the root and the last unit, gathered in forward and kept until their backward
    # the resharded units gathered at once: the one running and its neighbour, prefetched (the largest such pair)
    prefetch_bytes: int
    ddp_bytes: int  # 16·P/t: the same rank under plain data parallelism (DDP), every rank holding it all
    traffic: tuple[FSDPTraffic, ...]
    # FSDP's mixed precision (torch dtype names): what its all-gathers carry and its reduce-scatters sum in;
    # None: the parameters' own dtypes
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    cp: int = 1  # context-parallel ranks: FSDP shards over dp × cp of them together

    @property
    def ranks(self) -> int:
        """The ranks FSDP shards over: dp · cp."""
        return self.dp * self.cp

    @property
    def blocks(self) -> tuple[FSDPUnitRow, ...]:
        return tuple(u for u in self.units if u.kind == "block")

    @property
    def resharded(self) -> tuple[FSDPUnitRow, ...]:
        """The units gathered twice a step (first and blocks), in the order they run."""
        return tuple(u for u in self.units if u.resharded)

    @property
    def kept(self) -> tuple[FSDPUnitRow, ...]:
        """The units gathered once a step and kept from their forward into their backward (last, root)."""
        return tuple(u for u in self.units if not u.resharded)

    @property
    def peak_bytes(self) -> int:
        """Per rank, activations and the gradients awaiting their reduce-scatter not included."""
        return self.state_bytes + self.kept_bytes + self.prefetch_bytes

    @property
    def saving(self) -> float | None:
        """How many times less than DDP a rank holds."""
        return _ratio(self.ddp_bytes, self.peak_bytes)

    def to_dict(self) -> dict:
        return {**asdict(self), "peak_bytes": self.peak_bytes, "saving": self.saving}


def _cast_bytes(r: ParamRow, dtype: str | None) -> int:
    """``r``'s TP shard whole in ``dtype``, as FSDP2's mixed precision casts a floating-point parameter (its
    own dtype when ``dtype`` is None or the parameter is not floating point)."""
    own = getattr(torch, r.dtype, None)
    if dtype is None or not (isinstance(own, torch.dtype) and own.is_floating_point):
        return r.local_bytes
    return math.prod(r.local_shape) * itemsize(dtype, 4)


def fsdp_units(plan: Plan, rows: tuple[ParamRow, ...], dp: int, param_dtype: str | None = None,
               reduce_dtype: str | None = None) -> tuple[FSDPUnitRow, ...]:
    """The plan's units in the order they run (first, blocks, last), then the root with every tensor no unit
    owns (only when there is one); a tensor under several names (tied) belongs to the first unit that names it
    under any of them, and is counted once. Gathered in ``param_dtype``, reduced in ``reduce_dtype``."""
    owner: dict[str, int] = {}
    for i, unit in enumerate(plan.units):
        for name in unit.params:
            owner.setdefault(name, i)
    root = len(plan.units)
    members: list[list[ParamRow]] = [[] for _ in range(root + 1)]
    for r in rows:
        members[next((owner[a] for a in r.aliases if a in owner), root)].append(r)
    heads = [(u.module, u.kind, u.members) for u in plan.units] + [(ROOT_UNIT, "root", ())]
    return tuple(FSDPUnitRow(module, kind, len(rs), sum(math.prod(r.full_shape) for r in rs),
                             sum(math.prod(r.local_shape) for r in rs),
                             sum(_cast_bytes(r, param_dtype) for r in rs), sum(_fsdp_shard_bytes(r, dp) for r in rs),
                             modules,
                             sum(_cast_bytes(r, reduce_dtype) for r in rs))
                 for (module, kind, modules), rs in zip(heads, members) if rs or kind != "root")


def _in_flight(units: list[FSDPUnitRow]) -> int:
    """The most gathered bytes of resharded units held at once: a unit and its neighbour in run order (the next
    one is prefetched in forward, the previous one in backward); one unit alone when there is only one."""
    sizes = [u.gathered_bytes for u in units]
    return max((a + b for a, b in zip(sizes, sizes[1:])), default=max(sizes, default=0))


def unit_kinds(units: Iterable[FSDPUnitRow]) -> str:
    """``units`` in words, by kind in run order: "first + 2 blocks + last + root"."""
    counts = Counter(u.kind for u in units)
    words = {"first": "first", "last": "last", "root": "root"}
    return " + ".join(words[k] if k in words else f"{counts[k]} block{'s' if counts[k] > 1 else ''}"
                      for k in ("first", "block", "last", "root") if counts[k])


def _fsdp_shard_bytes(r: ParamRow, dp: int) -> int:
    """FSDP2 cuts dim 0 of the (TP-local) tensor in d chunks of ceil(n/d) rows and pads the last ones."""
    shape = r.local_shape or (1,)
    n = math.prod(shape)
    if n == 0:
        return 0
    return -(-shape[0] // dp) * (n // shape[0]) * (r.local_bytes // n)


def fsdp_report(plan: Plan, named_params: Iterable[tuple[str, torch.Tensor]], dp: int,
                param_dtype: str | None = None, reduce_dtype: str | None = None) -> FSDPReport:
    """FSDP's units, memory and traffic per rank for ``plan`` (at its tp) over ``dp`` data-parallel ranks;
    ``named_params`` as for :func:`param_rows`: every alias, shapes and dtypes only."""
    return fsdp_from_rows(plan, param_rows(plan, named_params), dp, param_dtype, reduce_dtype)


def fsdp_from_rows(plan: Plan, rows: tuple[ParamRow, ...], dp: int, param_dtype: str | None = None,
                   reduce_dtype: str | None = None, cp: int = 1) -> FSDPReport:
    """:func:`fsdp_report` from the rows a :class:`Report` already holds (``report.params``).

    Follows ``autotp.parallel.fsdp.apply_fsdp`` with its defaults (resharding after forward): every unit and
    the root are gathered once in forward; the first unit and the blocks are freed after their forward and
    gathered again for their backward, while the last unit (its backward starts as its forward ends) and the
    root are kept gathered from their forward into their backward; every unit's gradients and the root's are
    reduce-scattered once. With FSDP's mixed precision (``param_dtype``, ``reduce_dtype``: torch dtype names, as
    ``FSDPConfig`` passes them to FSDP2's MixedPrecisionPolicy) the gathers, and the units held gathered, are in
    ``param_dtype`` and the reduce-scatters in ``reduce_dtype``; else in the parameters' own dtypes. With
    context parallelism (``cp`` > 1) FSDP shards over the dp × cp ranks together (torchtitan's dp_shard·cp),
    as ``autotp.distributed.data_parallel`` builds its mesh: every figure is over dp · cp ranks.
    """
    if dp < 1 or cp < 1:
        raise ValueError(f"dp and cp must be >= 1, got dp {dp}, cp {cp}")
    outer, dp = dp, dp * cp  # below: the ranks FSDP shards over
    units = fsdp_units(plan, rows, dp, param_dtype, reduce_dtype)
    local = sum(math.prod(r.local_shape) for r in rows)
    resharded = [u for u in units if u.resharded]
    kept = [u for u in units if not u.resharded]
    k = TRAIN_BYTES_PER_PARAM

    def line(direction: str, kind: str, what: str, of: list[FSDPUnitRow]) -> FSDPTraffic:
        size = sum(u.reduced_bytes if kind == "reduce_scatter" else u.gathered_bytes for u in of)
        return FSDPTraffic(direction, kind, what, len(of), size, round(size * (dp - 1) / dp))

    again = f"{unit_kinds(resharded)}: gathered again (resharded after forward)"
    if kept:
        again += f"; {unit_kinds(kept)} kept since forward"
    traffic = (line("forward", "all_gather", f"every unit's parameters ({unit_kinds(units)})", list(units)),
               line("backward", "all_gather", again, resharded),
               line("backward", "reduce_scatter", f"every unit's gradients ({unit_kinds(units)})", list(units)))
    return FSDPReport(plan.tp, outer, units, local, round(k * local / dp), sum(u.gathered_bytes for u in kept),
                      _in_flight(resharded), k * local,
                      tuple(t for t in traffic if t.count), param_dtype, reduce_dtype, cp)
