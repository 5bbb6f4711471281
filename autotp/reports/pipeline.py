"""The numbers behind ``autotp plan --pp P``: what a plan's pipeline stages cost for one concrete batch.

Pure functions over the captured graph, a :class:`~autotp.plan.plan.Plan` with its ``stages`` and the
:class:`~autotp.reports.sharding.Report` of the same batch; nothing here prints. Per stage: its blocks, its
parameters per tp rank, its forward FLOPs and the activations it keeps for backward per micro-batch
(Korthikanti et al. 2022, README "What a step costs"); per pipeline rank: the micro-batches its
schedule keeps in flight; per cut between two stages: the values that cross it (the point-to-point traffic);
and the schedule's bubble (Narayanan et al. 2021, §2.2).

Shapes are the captured graph's, with its symbolic sizes read for the micro-batch: the batch symbol at
b / m, the sequence at s, any other at the size it was captured with.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import NamedTuple

import sympy
import torch
import torch.fx as fx

from autotp.analysis.flops import node_flops, shape_of
from autotp.errors import PipelineError
from autotp.plan.pieces import recomputable, piece_keys
from autotp.plan.plan import Plan
from autotp.reports.sharding import TRAIN_BYTES_PER_PARAM, Report
from autotp.plan.stages import stage_of_key

aten = torch.ops.aten

# torch.distributed.pipelining's schedules (autotp.parallel.pipeline.SCHEDULES) that run one stage per rank
ONE_PER_RANK = ("GPipe", "1F1B")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")  # fill the bubble with weight-gradient work


class PipelineSpec(NamedTuple):
    """What ``autotp plan --pp`` was asked for, checked (``autotp.parallel.pipeline.check_pipeline``)."""

    pp: int
    virtual_stages: int  # v: stages per pipeline rank
    microbatches: int  # m
    schedule: str  # one of autotp.parallel.pipeline.SCHEDULES
    ranks: tuple[int, ...]  # the pipeline rank of each of the pp·v stages (stage_ranks)
    split_points: tuple[str, ...] = ()  # the blocks that start stages 1, 2, ... (empty: balanced)


def check_microbatches(microbatches: int, batch: int) -> None:
    """A step cuts its batch into ``microbatches`` equal micro-batches."""
    if batch % microbatches:
        raise PipelineError(f"{microbatches} micro-batches do not divide the batch of {batch}",
                            hint=f"use a number of micro-batches that divides {batch}")


@dataclass(frozen=True)
class StageRow:
    index: int
    rank: int  # pipeline rank
    blocks: tuple[str, ...]
    first: bool  # also runs the code before the blocks (embeddings, masks, rotary tables)
    last: bool  # also runs the code after them (final norm, LM head, loss)
    params: int  # elements one tp rank of this stage holds (a tensor read by two stages is in both)
    param_bytes: int  # the same, in the parameters' dtypes
    flops: int  # forward FLOPs of one micro-batch, all tp ranks of the stage together (each does ≈ 1/t)
    activation_bytes: int  # what its blocks keep for backward for one micro-batch, per tp rank


@dataclass(frozen=True)
class RankRow:
    """One pipeline rank at its peak: its stages' activations of the micro-batches its schedule holds."""

    rank: int
    stages: tuple[int, ...]
    in_flight: int  # (stage, micro-batch) pairs whose activations are kept at once
    activation_bytes: int  # per tp rank
    params: int = 0  # elements one tp rank holds for all its stages (a tensor two of them read, once)
    param_bytes: int = 0
    state_bytes: int = 0  # training state of those: 16 B per parameter (/ dp under FSDP)

    @property
    def memory_bytes(self) -> int:
        """What the rank holds at its peak: training state and activations (per tp rank)."""
        return self.state_bytes + self.activation_bytes


@dataclass(frozen=True)
class CrossingValue:
    """A value computed before a cut and read after it: sent forward, its gradient sent back when ``grad``."""

    name: str  # the graph node's name
    shape: tuple[int, ...]  # for one micro-batch
    dtype: str
    bytes: int
    grad: bool  # floating point and computed from parameters: its gradient crosses back in backward
    module: str = ""  # the innermost module computing it ("model.rotary_emb"); "" at the root
    code: str = ""  # the source line export recorded for it ("cos = emb.cos() * self.attention_scaling")


@dataclass(frozen=True)
class Cut:
    """The boundary after stage ``after``: from pipeline rank ``src`` to ``dst`` (the same rank: a V schedule's
    turn, where nothing is sent)."""

    after: int
    src: int
    dst: int
    values: tuple[CrossingValue, ...]

    @property
    def sent(self) -> bool:
        return self.src != self.dst

    @property
    def forward_bytes(self) -> int:
        return sum(x.bytes for x in self.values) if self.sent else 0

    @property
    def backward_bytes(self) -> int:
        return sum(x.bytes for x in self.values if x.grad) if self.sent else 0


@dataclass(frozen=True)
class Activations:
    """The per-layer formula's inputs (Korthikanti et al. 2022, §4): ``elem`` bytes per activation, 1-byte
    dropout masks when the blocks drop out, and the s×s attention scores unless attention is fused (SDPA)."""

    hidden: int | None  # h
    heads: int | None  # a (only for the scores term)
    elem: int
    dropout: bool
    fused: bool
    layer_bytes: int  # one block, one micro-batch, per tp rank
    sequence_parallel: bool = False  # every term split over t


@dataclass(frozen=True)
class Bubble:
    formula: str  # "(p − 1)/m" or "(p − 1)/(v·m)"
    fraction: float  # of the ideal (bubble-free) step time
    upper_bound: bool  # zero-bubble schedules fill most of it with weight-gradient work


@dataclass(frozen=True)
class PipelineReport:
    pp: int
    virtual_stages: int
    microbatches: int
    schedule: str
    micro_batch: int  # b / m
    seq: int
    tp: int
    stages: tuple[StageRow, ...]
    ranks: tuple[RankRow, ...]
    cuts: tuple[Cut, ...]
    activations: Activations
    bubble: Bubble
    shared: tuple[str, ...] = ()  # parameters read by more than one stage (a tied embedding / LM head)

    @property
    def forward_bytes(self) -> int:
        """Sent forward per micro-batch over every cut between two ranks (each tp rank sends its own copy)."""
        return sum(c.forward_bytes for c in self.cuts)

    @property
    def backward_bytes(self) -> int:
        return sum(c.backward_bytes for c in self.cuts)

    @property
    def step_bytes(self) -> int:
        """Both directions, every micro-batch of a training step."""
        return self.microbatches * (self.forward_bytes + self.backward_bytes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cuts"] = [{**asdict(c), "sent": c.sent, "forward_bytes": c.forward_bytes,
                      "backward_bytes": c.backward_bytes} for c in self.cuts]
        d.update(forward_bytes=self.forward_bytes, backward_bytes=self.backward_bytes, step_bytes=self.step_bytes)
        return d


# -- the schedule ----------------------------------------------------------------------------------------
def in_flight(schedule: str, pp: int, v: int, m: int, rank: int) -> int:
    """How many (stage, micro-batch) pairs pipeline rank ``rank`` holds activations of at its peak: the
    forwards its schedule runs before the backward that frees the first of them.

    GPipe: every micro-batch forward, then every backward: m. 1F1B: p − r − 1 warm-up forwards, then one
    forward per backward: min(m, p − r). Interleaved (Narayanan et al. 2021, §2.2, as torch's
    ScheduleInterleaved1F1B computes it): (v − 1)·(micro-batches per round) + 2·(p − 1 − r) warm-up forwards,
    one more before the first backward, at most v·m; with m a multiple of p (p per round) and at least 2·p,
    rank 0 holds v·p + p − 1 stage-micro-batches of L/(v·p) layers each, L·(1 + (p − 1)/(v·p)) layers' worth,
    Korthikanti et al.'s §4.2.3 figure.
    InterleavedZeroBubble: the same with p − 1 − r warm-up steps (torch's factor 1). LoopedBFS: each stage
    runs every micro-batch before the next stage, so all v·m. ZBVZeroBubble: 2·p on every rank (torch's
    warm-up: 2p − r − 1 of the first stage and r + 1 of the second; Qi et al. 2024's L layers' worth).
    """
    if schedule == "GPipe":
        return m
    if schedule == "1F1B":
        return min(m, pp - rank)
    if schedule == "LoopedBFS":
        return v * m
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        per_round = m // max(1, m // pp)
        factor = 2 if schedule == "Interleaved1F1B" else 1
        return min(v * m, (v - 1) * per_round + factor * (pp - 1 - rank) + 1)
    if schedule == "ZBVZeroBubble":
        return min(v * m, 2 * pp)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def bubble(schedule: str, pp: int, v: int, m: int) -> Bubble:
    """The idle time of a step as a fraction of its ideal time: (p − 1)/m with one stage per rank, (p − 1)/(v·m)
    with v per rank (Narayanan et al. 2021, §2.2)."""
    if schedule in ONE_PER_RANK:
        return Bubble("(p − 1)/m", (pp - 1) / m, False)
    return Bubble("(p − 1)/(v·m)", (pp - 1) / (v * m), schedule in ZERO_BUBBLE)


# -- activations -----------------------------------------------------------------------------------------
def layer_activation_bytes(b: int, s: int, h: int, a: int | None, t: int, elem: int = 2, dropout: bool = True,
                           fused: bool = False, sequence_parallel: bool = False) -> int:
    """Bytes one transformer layer keeps for backward, per tp rank (Korthikanti et al. 2022, §4): with 16-bit
    activations and dropout s·b·h·(10 + 24/t + 5·a·s/(h·t)), the terms recomputed for ``elem`` bytes per
    element and for the dropout actually used.

    Whole on every rank: the two LayerNorms' inputs and the attention's and MLP's inputs (4·elem per s·b·h),
    the two dropout masks after them (1 byte each). Split over t: q, k, v, the output projection's input,
    the 4h GeLU input and output (12·elem). The s×s scores, per head (a·s²·b, split over t): the softmax output,
    and with dropout its mask and output (elem + 1 + elem); fused attention keeps none of them. With
    ``sequence_parallel`` the whole-on-every-rank terms are split over t too (§4.2.2: s·b·h·34/t).
    """
    sbh = s * b * h
    whole = 4 * elem + 2 * int(dropout)
    split = 12 * elem
    scores = 0 if fused or a is None else (elem + int(dropout) * (1 + elem)) * a * s * s * b
    if sequence_parallel:
        return (sbh * (whole + split) + scores) // t
    return sbh * whole + (sbh * split + scores) // t


def block_facts(gm: fx.GraphModule, in_blocks: set[fx.Node]) -> tuple[int | None, bool, bool]:
    """(heads, dropout, fused) of the blocks' nodes: heads from the attention's (b, heads, s, ·) operands."""
    heads, dropout, fused = None, False, False
    for node in gm.graph.nodes:
        if node not in in_blocks or node.op != "call_function":
            continue
        if node.target is aten.scaled_dot_product_attention.default:
            fused = True
            q = shape_of(node.args[0])
            heads = heads or (q[1] if q and len(q) == 4 else None)
        elif node.target in (aten.softmax.int, aten._softmax.default):
            out = shape_of(node)
            heads = heads or (out[1] if out and len(out) == 4 else None)
        elif node.target in (aten.dropout.default, aten.native_dropout.default):
            p, train = node.args[1], node.args[2] if len(node.args) > 2 else True
            dropout = dropout or (train is not False and isinstance(p, (int, float)) and p > 0)
    return heads, dropout, fused


# -- what crosses a cut ----------------------------------------------------------------------------------
def _needs_grad(gm: fx.GraphModule) -> set[fx.Node]:
    """The floating-point values autograd tracks: computed from a parameter that requires grad (the capture
    records no requires_grad on its fake values). A bool mask or tables made from buffers and positions
    (rotary cos/sin) are not."""
    params = {n for n, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        floating = isinstance(val, torch.Tensor) and val.is_floating_point()
        if node.op == "get_attr":
            tracked = node.target in params
        elif node.op == "placeholder":
            tracked = floating and val.requires_grad
        else:
            tracked = floating and node.target is not aten.detach.default and any(
                a in out for a in node.all_input_nodes)
        if tracked:
            out.add(node)
    return out


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def crossing(gm: fx.GraphModule, stage: Mapping[fx.Node, int], count: int,
             sizes: Mapping[str, int] | None = None) -> tuple[tuple[CrossingValue, ...], ...]:
    """For each cut s (after stage s, of ``count`` stages): the tensors computed by nodes in stages ≤ s and read
    by nodes in stages > s, in graph order. Graph inputs reach every stage locally and parameters and buffers
    (get_attr) are read where they are used, so neither is sent, nor what is made from them alone (made
    again where it is read); sizes (SymInts) are not sent either, since
    the pipeline captures with static shapes. ``stage``: each computing node's stage."""
    grad = _needs_grad(gm)
    again = recomputable(gm)  # masks and rotary tables: each stage that reads them makes its own
    cuts: list[list[CrossingValue]] = [[] for _ in range(count - 1)]
    for node in gm.graph.nodes:
        if node not in stage or node in again or not isinstance(val := node.meta.get("val"), torch.Tensor):
            continue
        readers = [stage[u] for u in node.users if u in stage]
        if not readers or max(readers) <= stage[node]:
            continue
        shape = shape_of(node, sizes) or ()
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        module = stack[-1][0] if stack and isinstance(stack[-1], tuple) else ""
        lines = (node.meta.get("stack_trace") or "").strip().splitlines()
        value = CrossingValue(node.name, shape, str(val.dtype).removeprefix("torch."),
                              math.prod(shape) * _dtype_bytes(val.dtype), node in grad, module,
                              lines[-1].strip() if lines else "")
        for s in range(stage[node], max(readers)):
            cuts[s].append(value)
    return tuple(tuple(c) for c in cuts)


def micro_sizes(gm: fx.GraphModule, roles: Mapping[str, str], micro_batch: int, seq: int) -> dict[str, int]:
    """Symbol name -> size for one micro-batch: the batch symbols at ``micro_batch``, the sequence ones at
    ``seq``. ``roles`` (the report's, from the plan's collectives) is completed from the graph's integer
    inputs of two dims, (b, s) token ids, for a plan without collectives (tp 1)."""
    roles = dict(roles)
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(val, torch.Tensor) and val.dim() == 2 and not val.is_floating_point():
            for d, role in zip(val.shape, ("b", "s")):
                if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol):
                    roles.setdefault(str(d.node.expr), role)
    return {sym: micro_batch if role == "b" else seq for sym, role in roles.items()}


# -- the report ------------------------------------------------------------------------------------------
def _keys_and_stages(gm: fx.GraphModule, plan: Plan) -> tuple[dict[fx.Node, int], dict[fx.Node, int]]:
    """Each computing node's piece key (odd: inside a block) and its stage: key k runs in the stage of block
    min(k // 2, blocks − 1), as ``autotp.passes.split_stages`` cuts the graph."""
    blocks, block_stage = stage_of_key(plan.stages)
    keys = piece_keys(gm, blocks)
    return keys, {n: block_stage[min(k // 2, len(blocks) - 1)] for n, k in keys.items()}


def node_stages(gm: fx.GraphModule, plan: Plan) -> dict[fx.Node, int]:
    """Each computing node's pipeline stage under ``plan.stages``."""
    return _keys_and_stages(gm, plan)[1]


def pipeline_report(gm: fx.GraphModule, plan: Plan, report: Report, spec: PipelineSpec,
                    elem: int | None = None, state_shards: int = 1) -> PipelineReport:
    """Stages, ranks, cuts and bubble of ``plan.stages`` under ``spec``, for ``report``'s batch and sequence.
    ``elem``: bytes per activation element (default the report's: the parameters' dtype; 2 under autocast);
    ``state_shards``: what the training state is split over (dp under FSDP)."""
    stages, pp, v, m = plan.stages, spec.pp, spec.virtual_stages, spec.microbatches
    count = len(stages)
    b = report.batch // m
    sizes = micro_sizes(gm, report.symbols, b, report.seq)
    keys, of = _keys_and_stages(gm, plan)
    in_blocks = {n for n, k in keys.items() if k % 2}
    flops = [0] * count
    for node, s in of.items():
        flops[s] += node_flops(node, sizes)
    split = plan.sequence is not None and bool(plan.sequence.leaves)
    # with sequence parallelism the hidden state between blocks lies in the code between the pairs, split along
    # the sequence: each tp rank sends its s/t positions
    cuts = crossing(gm, of, count, micro_sizes(gm, report.symbols, b, report.seq // plan.tp) if split else sizes)

    heads, dropout, fused = block_facts(gm, in_blocks)
    hidden = report.hidden
    if hidden is None:  # tp 1 has no collectives to read h from: the hidden state crossing the first cut
        hidden = next((x.shape[-1] for x in cuts[0] if len(x.shape) == 3 and x.grad), None) if cuts else None
    elem = report.act_bytes if elem is None else elem
    layer = layer_activation_bytes(b, report.seq, hidden, heads, plan.tp, elem, dropout, fused, split) if hidden else 0

    by_alias = {a: row for row in report.params for a in row.aliases}

    def held(names) -> tuple[int, int]:
        """Elements and bytes per tp rank of the tensors ``names`` reach, each once (by identity)."""
        rs = {id(by_alias[n]): by_alias[n] for n in names if n in by_alias}.values()
        return sum(math.prod(r.local_shape) for r in rs), sum(r.local_bytes for r in rs)

    rows = [StageRow(i, spec.ranks[i], st.blocks, i == 0, i == count - 1, *held(st.params), flops[i],
                     layer * len(st.blocks)) for i, st in enumerate(stages)]
    ranks = []
    for r in range(pp):
        mine = tuple(s for s in range(count) if spec.ranks[s] == r)
        n = in_flight(spec.schedule, pp, v, m, r)
        # a rank's stages hold their micro-batches in turn: the in-flight pairs at its stages' mean size
        per_stage = sum(rows[s].activation_bytes for s in mine) / max(1, len(mine))
        params, param_bytes = held([x for s in mine for x in stages[s].params])
        ranks.append(RankRow(r, mine, n, round(n * per_stage), params, param_bytes,
                             TRAIN_BYTES_PER_PARAM * params // state_shards))
    holders: dict[int, list[str]] = {}  # a tensor by identity -> its names in the stages that read it
    for st in stages:
        for n in st.params:
            if n in by_alias:
                holders.setdefault(id(by_alias[n]), []).append(n)
    shared = tuple(dict.fromkeys(by_alias[ns[0]].name for ns in holders.values() if len(ns) > 1))
    return PipelineReport(pp, v, m, spec.schedule, b, report.seq, plan.tp, tuple(rows), tuple(ranks),
                          tuple(Cut(s, spec.ranks[s], spec.ranks[s + 1], cuts[s]) for s in range(count - 1)),
                          Activations(hidden, heads, elem, dropout, fused, layer, split),
                          bubble(spec.schedule, pp, v, m), shared)
