"""The Plan: an immutable, JSON-serializable description of how one captured graph is sharded.

Keyed by parameter and module names for what a user reads (which weight is cut on which dim, which
collective goes where and how big it is), and by graph node names for what the passes execute (which
constants change, where the conjugate operators go). The CLI renders it; the passes execute it.

This module is the contract: it imports nothing of capture, analysis or the passes (analysis builds these
values, the passes read them), so loading a Plan loads only torch and the vocabulary of cuts.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from autotp.plan.context import ContextPlan
from autotp.shard_spec import (Segment, VocabRows, local_runs, shard_tensor, unshard_tensor, vocab_shard,
                               vocab_unshard)

PLAN_VERSION = 14
_READS = tuple(range(1, PLAN_VERSION + 1))  # 1: no gathered outputs or sharded inputs, 2: no statistics, 3: no
# sequence parallelism or grouped segments, 4: no collective dtypes, 5: no list of the weights left whole, 6: no
# expert parallelism, 7: no column forms or reduction arguments of statistics (read only for their shards), 8: no
# units, 9: no pipeline stages, 10: no parameters cut in the graph, 11: no context parallelism, 12: no random ops
# on sequence chunks, 13: a column form's orientation and a loss's rows under the key "layout"
# the module the one gradient all-reduce of parameters applied to sequence slices is reported under
SEQ_PARAMS = "(sequence-parallel parameters)"


@dataclass(frozen=True)
class Rewrite:
    """``node.args[arg]`` (or its element ``index`` when the arg is a list) changes from ``old`` to ``new``; a
    string ``arg`` names a keyword-only argument (``repeat_interleave``'s ``output_size``).

    ``factor_of``: the element is a size computed at run time, ``factor_of = x * old`` (``b * n_heads``); it
    becomes a fresh ``x * new`` for this node only (other readers of ``factor_of`` keep the full size).
    ``inferred``: the element is the size node ``inferred`` computed at run time some other way (``old`` is its
    value for the example inputs); this view gets ``-1`` (``new``) and infers it from the rank's elements.
    """

    node: str
    arg: int | str
    index: int | None
    old: int
    new: int
    factor_of: str | None = None
    inferred: str | None = None


@dataclass(frozen=True)
class WholeParam:
    """A parameter of a linear, embedding or matmul that every rank holds whole, and why."""

    name: str
    module: str
    reason: str


@dataclass(frozen=True)
class ParamShard:
    """How one parameter is cut. ``role``: "column" (output features), "row" (input features), "experts"
    (whole experts: a block of dim 0) or "vocab" (rows of an embedding / LM head, see
    :class:`~autotp.shard_spec.VocabRows`)."""

    role: str
    module: str
    dim: int
    segments: tuple[Segment, ...]
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    vocab: VocabRows | None = None

    def shard(self, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
        if self.vocab is not None:
            return vocab_shard(full, self.dim, self.vocab, rank)
        return shard_tensor(full, self.dim, self.segments, tp, rank)

    def unshard(self, shards: list[torch.Tensor], tp: int) -> torch.Tensor:
        if self.vocab is not None:
            return vocab_unshard(shards, self.dim, self.vocab)
        return unshard_tensor(shards, self.dim, self.segments, tp)

    def replicated_blocks(self, tp: int) -> bool:
        """Some blocks live on several ranks (kv heads fewer than tp): their gradients are summed."""
        return self.vocab is None and any(p.copies > 1 for p in local_runs(self.segments, tp))


@dataclass(frozen=True)
class Collective:
    """One collective of a forward/backward pass. ``elements`` is symbolic in batch and sequence."""

    kind: str  # "all_reduce" | "reduce_scatter" | "all_gather"
    op: str  # "sum" | "max" ("" for all_gather)
    direction: str  # "forward" | "backward"
    module: str
    node: str  # graph node the operator wraps
    shape: tuple[str, ...]
    dtype: str = ""  # what travels ("bfloat16" under bf16 autocast, "float32" for the loss's statistics); "": unknown


@dataclass(frozen=True)
class PairPlan:
    """A column→row pair: what the passes insert around it."""

    module: str
    columns: tuple[str, ...]  # column matmul node names
    column_weights: tuple[str, ...]
    enter: tuple[str, ...]  # input nodes that get the identity-forward / all-reduce-backward operator
    row: str  # row matmul node name
    row_weight: str
    row_bias: str | None  # parameter added once, after the all-reduce
    # (consumer, operand): a replicated value computed from parameters used with sharded ones (a per-head
    # norm's weight); it gets f too, so its partial gradients are summed
    also_enter: tuple[tuple[str, str], ...] = ()
    # (reader, x): a node that reads the entering value x on its way to a column (``x[..., :12]`` into a
    # gate): it reads x through x's f, so one all-reduce sums the gradient of x and of what is derived from it
    enter_via: tuple[tuple[str, str], ...] = ()
    # inputs this pair's columns read through the f of an earlier pair that enters them (experts of one MoE
    # layer reading the same tokens): one all-reduce of the input gradient for all of them
    enter_with: tuple[str, ...] = ()
    # the node after which g runs when it is not the row (the router-weighted sum of a MoE layer's experts,
    # whose partial sums one all-reduce completes); pairs naming the same node share it
    leave_at: str | None = None


@dataclass(frozen=True)
class ColumnForm:
    """A column matmul or LM head ``node`` in a plain form that a fused column group computes itself
    (:class:`~autotp.operators.collectives.ColumnGroup`): it reads ``x`` once, by ``weight`` (the parameter's
    node, its cast, or the parameter itself where the matmul reads its lone transpose) read in the
    ``orientation`` "out_in" ([out, in]) or "in_out" ([in, out]), plus ``bias`` (a node, or None)."""

    node: str
    x: str
    orientation: str
    weight: str
    bias: str | None = None


@dataclass(frozen=True)
class VocabLoss:
    """A cross-entropy over vocab-parallel logits, computed without gathering them."""

    node: str  # cross_entropy_loss or nll_loss node
    logits: str  # its sharded logits (for nll: the log_softmax input)
    log_softmax: str | None  # the log_softmax node bypassed by an nll_loss
    reduction: int  # 0 none, 1 mean, 2 sum (aten's enum)
    ignore_index: int
    label_smoothing: float
    rows: VocabRows  # the vocabulary's rows per rank


@dataclass(frozen=True)
class VocabPlan:
    """Vocab-parallel embeddings, LM heads, losses and the logits handed back to the user."""

    embeddings: tuple[tuple[str, VocabRows], ...] = ()  # embedding node -> its rows per rank
    heads: tuple[tuple[str, str], ...] = ()  # head matmul node -> its input (gets f)
    losses: tuple[VocabLoss, ...] = ()
    outputs: tuple[tuple[str, int, VocabRows], ...] = ()  # returned sharded node, vocab dim, rows per rank


@dataclass(frozen=True)
class GatheredOutput:
    """A sharded value the graph returns (e.g. a KV cache's keys): handed back full-shape, gathered when
    read (:class:`~autotp.operators.gathered.GatheredOnUse`)."""

    node: str
    dim: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class ShardedInput:
    """A graph input taken as this rank's shard (the KV cache a previous call returned): a
    :class:`~autotp.operators.gathered.GatheredOnUse` passes its local shard, a full tensor is sliced locally."""

    node: str
    dim: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class GraphCut:
    """A parameter that every rank holds whole and cuts to its slice in the graph: ``node`` (the parameter's
    node) is read through ``f`` then this rank's slice along ``dim``. Its blocks live on several ranks (kv heads
    fewer than tp), which FSDP's DTensors cannot express: held whole it is ``Replicate`` over tp, so norms and
    checkpoints count it once; each rank's gradient is the slice's, scattered into the whole, and ``f`` sums
    them (one all-reduce of the parameter's gradient, backward). ``in_graph`` False (pipeline stages): the
    sum is the pipeline step's, once after the last micro-batch, not once per micro-batch's backward."""

    name: str
    node: str
    dim: int
    segments: tuple[Segment, ...]
    in_graph: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> GraphCut:
        return cls(d["name"], d["node"], d["dim"], tuple(Segment.from_dict(s) for s in d["segments"]),
                   d.get("in_graph", True))


@dataclass(frozen=True)
class LocalSlice:
    """A replicated operand of ``consumer`` that spans a sharded dim is cut to this rank's slice (no
    communication): per-head constants such as ALiBi slopes, masks with a head dim."""

    consumer: str
    operand: str
    dim: int
    segments: tuple[Segment, ...]
    outer: bool = False  # the dim is [k, segments] flattened (heads folded under the batch)


@dataclass(frozen=True)
class Stat:
    """A statistic over a sharded dim, completed by one all-reduce of the ranks' partial values (b·s
    elements): ``kind`` "mean" or "sum" (a reduction node, all-reduced after it), "var", "std" or "norm" (a
    reduction computed from local sums), "rms_norm" or "layer_norm" (a norm over the whole projection width,
    computed on the local slice). ``scale`` multiplies the sum over ranks. A reduction's arguments, whichever
    overload spells them: ``dims`` (None: every dim), ``keepdim`` and ``param`` (a norm's order p, a var's or
    std's correction)."""

    node: str
    kind: str
    scale: float
    dims: tuple[int, ...] | None = None
    keepdim: bool = False
    param: float | None = None


@dataclass(frozen=True)
class SeqLeave:
    """A reduce-scatter along the sequence (all-gather backward) in place of ``source``'s all-reduce: after
    ``node``, the row matmul or vocab-parallel embedding itself, or the view that gives a flat row output
    its sequence dim back (GPT-2's ``[b·s, h] -> [b, s, h]``)."""

    module: str
    source: str
    node: str
    dim: int


@dataclass(frozen=True)
class SeqEnter:
    """An all-gather along the sequence (reduce-scatter backward) of ``node`` in place of the ``f`` on ``x``,
    the input of a pair's column matmuls or of an LM head: ``x`` is ``node`` itself or, with ``flatten``, its
    ``[.., h] -> [N, h]`` view. ``regather``: fused with the matmuls, only the local slice is kept for
    backward and gathered again there (one more all-gather backward)."""

    module: str
    x: str
    node: str
    dim: int
    matmuls: tuple[str, ...] = ()  # the column / LM-head matmul nodes reading x
    flatten: bool = False
    regather: bool = False


@dataclass(frozen=True)
class SeqGather:
    """``value`` (sequence-sharded) is all-gathered for ``consumers``, which need the whole sequence; from there
    on they compute replicated (plain tensor parallelism). Backward: this rank's slice, no communication."""

    value: str
    dim: int
    consumers: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class SeqSlice:
    """A replicated ``value`` meets sequence-sharded ones at ``consumer``: cut to this rank's slice along
    ``dim``; its gradient is all-gathered backward when ``grad``."""

    consumer: str
    value: str
    dim: int
    grad: bool


@dataclass(frozen=True)
class SequencePlan:
    """Sequence parallelism (Megatron-SP, Korthikanti et al. 2022) over the code between the pairs.

    ``length``: the graph input and dim that carry the sequence length (a call whose length tp does not
    divide runs a plan without sequence parallelism). ``grads``: (consumer, parameter node) uses of
    parameters on sequence slices, whose gradients are summed by one all-reduce; ``enter_grads``: the same
    for values computed from parameters, each through its own ``f``. ``sizes``: (node, arg index, entry, dim)
    sequence sizes of views and expands inside the regions, which become the local size (read from dim
    ``dim`` of the node's input; -1 for expand's "keep"). ``notes``: where and why plain tensor parallelism
    stays."""

    length: tuple[str, int] | None = None
    leaves: tuple[SeqLeave, ...] = ()
    enters: tuple[SeqEnter, ...] = ()
    gathers: tuple[SeqGather, ...] = ()
    slices: tuple[SeqSlice, ...] = ()
    grads: tuple[tuple[str, str], ...] = ()
    enter_grads: tuple[tuple[str, str], ...] = ()
    sizes: tuple[tuple[str, int, int, int], ...] = ()
    notes: tuple[str, ...] = ()
    # "": ``grads`` summed by one all-reduce; "unit" (FSDP) / "stage" (pipeline): one per unit or stage, inside
    # it (FSDP reduce-scatters a unit's gradients when its backward ends; a stage holds only its own parameters)
    grads_by: str = ""

    def leave(self, source: str) -> SeqLeave | None:
        return next((x for x in self.leaves if x.source == source), None)

    def enter(self, x: str, matmul: str) -> SeqEnter | None:
        return next((e for e in self.enters if e.x == x and matmul in e.matmuls), None)

    @classmethod
    def from_dict(cls, d: dict) -> SequencePlan:
        return cls(
            length=None if d.get("length") is None else tuple(d["length"]),
            leaves=tuple(SeqLeave(**x) for x in d.get("leaves", ())),
            enters=tuple(SeqEnter(**{**x, "matmuls": tuple(x["matmuls"])}) for x in d.get("enters", ())),
            gathers=tuple(SeqGather(**{**x, "consumers": tuple(x["consumers"])}) for x in d.get("gathers", ())),
            slices=tuple(SeqSlice(**x) for x in d.get("slices", ())),
            grads=tuple(tuple(x) for x in d.get("grads", ())),
            enter_grads=tuple(tuple(x) for x in d.get("enter_grads", ())),
            sizes=tuple(tuple(x) for x in d.get("sizes", ())),
            notes=tuple(d.get("notes", ())),
            grads_by=d.get("grads_by", ""),
        )


@dataclass(frozen=True)
class ExpertSlot:
    """One expert of a per-expert loop: ``nodes`` (its FFN, ending at ``out``) run on no ``rows`` where the
    expert lives on another rank, and ``out`` is zeros there."""

    expert: int
    nodes: tuple[str, ...]
    rows: tuple[str, ...]
    out: str


@dataclass(frozen=True)
class ExpertLayer:
    """Expert parallelism in one mixture-of-experts layer: each rank holds ``count / tp`` whole experts (a block
    of dim 0 of every parameter in ``params``). ``selects``: reads ``W[e]`` (node, e); ``indexes``: reads
    ``W[ids]``; ``grouped``: grouped GEMMs over tokens sorted by expert (see :mod:`autotp.analysis.experts`)."""

    module: str
    count: int
    params: tuple[str, ...]
    selects: tuple[tuple[str, int], ...] = ()
    indexes: tuple[str, ...] = ()
    grouped: tuple[str, ...] = ()
    slots: tuple[ExpertSlot, ...] = ()
    top_k: int | None = None  # experts per token (the routing's top-k), for the report
    width: int = 0  # the experts' output features (h)

    @classmethod
    def from_dict(cls, d: dict) -> ExpertLayer:
        return cls(d["module"], d["count"], tuple(d["params"]), tuple(tuple(x) for x in d["selects"]),
                   tuple(d["indexes"]), tuple(d["grouped"]),
                   tuple(ExpertSlot(x["expert"], tuple(x["nodes"]), tuple(x["rows"]), x["out"]) for x in d["slots"]),
                   d.get("top_k"), d.get("width", 0))


@dataclass(frozen=True)
class Unit:
    """One unit data parallelism (FSDP) gathers at a time (``autotp.analysis.units``): a repeated block, or
    the modules read only before the blocks (``kind`` "first": the embeddings) or only after them ("last":
    the final norm and LM head). ``params``: the parameters it owns; ``modules``: an edge unit's modules."""

    module: str
    params: tuple[str, ...]
    kind: str = "block"
    modules: tuple[str, ...] = ()

    @property
    def members(self) -> tuple[str, ...]:
        """The modules FSDP shards as this unit."""
        return self.modules or (self.module,)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage (``autotp.plan.stages``): the blocks it runs, in order, every parameter it reads (a
    tied embedding in the first and the last stage), and its forward FLOPs and parameter bytes per rank at
    the captured shapes. The first stage also runs the code before the blocks, the last the code after."""

    blocks: tuple[str, ...]
    params: tuple[str, ...] = ()
    flops: int = 0
    param_bytes: int = 0


@dataclass(frozen=True)
class Plan:
    tp: int
    params: tuple[tuple[str, ParamShard], ...] = ()
    pairs: tuple[PairPlan, ...] = ()
    rewrites: tuple[Rewrite, ...] = ()
    collectives: tuple[Collective, ...] = ()
    random_nodes: tuple[str, ...] = ()  # random ops inside sharded regions: per-rank RNG stream
    replicated: tuple[tuple[str, str], ...] = ()  # (module, reason) left unsharded
    vocab: VocabPlan = field(default_factory=VocabPlan)
    gathered: tuple[GatheredOutput, ...] = ()
    sharded_inputs: tuple[ShardedInput, ...] = ()
    local_slices: tuple[LocalSlice, ...] = ()
    stats: tuple[Stat, ...] = ()
    buffers: tuple[tuple[str, ParamShard], ...] = ()  # module buffers sharded like the values written into them
    sequence: SequencePlan | None = None  # sequence parallelism, when asked for
    # every parameter of two or more dims that no rank holds a slice of, and why (the completeness check)
    whole: tuple[WholeParam, ...] = ()
    experts: tuple[ExpertLayer, ...] = ()  # expert parallelism, when asked for
    # (module, reason): MoE layers that keep expert tensor parallelism although expert parallelism was asked for
    experts_kept: tuple[tuple[str, str], ...] = ()
    # the column matmuls and LM heads a column group can fuse (a column that is absent keeps its own matmul)
    column_forms: tuple[ColumnForm, ...] = ()
    units: tuple[Unit, ...] = ()  # the repeated blocks, in the order the graph runs them
    stages: tuple[Stage, ...] = ()  # pipeline stages, in order (empty without pipelining)
    graph_cuts: tuple[GraphCut, ...] = ()  # parameters held whole and cut in the graph (FSDP with kv copies)
    context: ContextPlan | None = None  # context parallelism: the forward run on a chunk of the sequence
    version: int = field(default=PLAN_VERSION)

    def param(self, name: str) -> ParamShard | None:
        return dict(self.params).get(name)

    def column_form(self, node: str, x: str) -> ColumnForm | None:
        """The plain form of column matmul ``node`` reading ``x``; None where a group cannot fuse it."""
        return next((f for f in self.column_forms if f.node == node and f.x == x), None)

    def seq_grad_groups(self, target_of: Callable[[str], str]) -> list[tuple[tuple[str, str], ...]]:
        """The sequence plan's ``grads`` as they are summed, each group by one all-reduce: all of them, or one
        group per unit / stage owning the parameters (``grads_by``). ``target_of``: a parameter node's
        parameter name."""
        seq = self.sequence
        if seq is None:
            return []
        owner: dict[str, object] = {}
        if seq.grads_by == "unit":
            owner = {p: u.module for u in self.units for p in u.params}
        elif seq.grads_by == "stage":
            owner = {p: i for i, s in enumerate(self.stages) for p in s.params}
        groups: dict[object, list[tuple[str, str]]] = {}
        for c, p in seq.grads:
            groups.setdefault(owner.get(target_of(p)), []).append((c, p))
        return [tuple(g) for g in groups.values()]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["params"] = {name: asdict(p) for name, p in self.params}
        d["buffers"] = {name: asdict(p) for name, p in self.buffers}
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        if d.get("version") not in _READS:
            raise ValueError(f"plan version {d.get('version')} is not supported (expected {PLAN_VERSION})")

        def seg(xs):
            return tuple(Segment.from_dict(s) for s in xs)

        def rows(x):
            return None if x is None else VocabRows(**x)

        def renamed(x: dict, new: str) -> dict:
            # plans before version 14 spelled ``new`` (a form's "orientation", a loss's "rows") "layout"
            return {(new if k == "layout" else k): v for k, v in x.items()} if d["version"] < 14 else x

        def loss(x: dict) -> VocabLoss:
            x = renamed(x, "rows")
            return VocabLoss(**{**x, "rows": rows(x["rows"])})

        def shards(entries: dict) -> tuple[tuple[str, ParamShard], ...]:
            return tuple(
                (name, ParamShard(p["role"], p["module"], p["dim"], seg(p["segments"]), tuple(p["full_shape"]),
                                  tuple(p["local_shape"]), rows(p.get("vocab"))))
                for name, p in entries.items()
            )

        params = shards(d["params"])
        v = d.get("vocab", {})
        vocab = VocabPlan(
            embeddings=tuple((n, rows(r)) for n, r in v.get("embeddings", ())),
            heads=tuple(tuple(h) for h in v.get("heads", ())),
            losses=tuple(map(loss, v.get("losses", ()))),
            outputs=tuple((n, dim, rows(r)) for n, dim, r in v.get("outputs", ())),
        )
        pairs = tuple(PairPlan(**{k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list)
                                  else v for k, v in p.items()}) for p in d["pairs"])
        rewrites = tuple(Rewrite(**r) for r in d["rewrites"])
        collectives = tuple(Collective(**{k: tuple(v) if isinstance(v, list) else v for k, v in c.items()})
                            for c in d["collectives"])
        gathered = tuple(GatheredOutput(g["node"], g["dim"], seg(g["segments"])) for g in d.get("gathered", ()))
        inputs = tuple(ShardedInput(g["node"], g["dim"], seg(g["segments"])) for g in d.get("sharded_inputs", ()))
        slices = tuple(LocalSlice(x["consumer"], x["operand"], x["dim"], seg(x["segments"]), x.get("outer", False))
                       for x in d.get("local_slices", ()))
        stats = tuple(Stat(**{**x, "dims": None if x.get("dims") is None else tuple(x["dims"])})
                      for x in d.get("stats", ()))
        sequence = None if d.get("sequence") is None else SequencePlan.from_dict(d["sequence"])
        return cls(d["tp"], params, pairs, rewrites, collectives, tuple(d["random_nodes"]),
                   tuple(tuple(r) for r in d["replicated"]), vocab, gathered, inputs, slices, stats,
                   shards(d.get("buffers", {})), sequence, tuple(WholeParam(**w) for w in d.get("whole", ())),
                   tuple(ExpertLayer.from_dict(x) for x in d.get("experts", ())),
                   tuple(tuple(x) for x in d.get("experts_kept", ())),
                   tuple(ColumnForm(**renamed(x, "orientation")) for x in d.get("column_forms", ())),
                   tuple(Unit(u["module"], tuple(u["params"]), u.get("kind", "block"), tuple(u.get("modules", ())))
                         for u in d.get("units", ())),
                   tuple(Stage(tuple(x["blocks"]), tuple(x.get("params", ())), x.get("flops", 0),
                               x.get("param_bytes", 0)) for x in d.get("stages", ())),
                   tuple(GraphCut.from_dict(x) for x in d.get("graph_cuts", ())),
                   None if d.get("context") is None else ContextPlan.from_dict(d["context"]), PLAN_VERSION)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))
