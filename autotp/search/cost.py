"""The predicted step time and memory of one layout: an analytic model over :class:`ModelCosts` and a
:class:`~autotp.search.hardware.Hardware` profile.

A layout is tp × cp × dp × pp ranks (Megatron's order, tp innermost), ``v`` stages per pipeline rank,
micro-batches of ``micro_batch`` samples, ``microbatches`` of them per step on each data-parallel replica
(global batch = dp · micro_batch · microbatches; a context-parallel group of cp ranks shares each sample, each
rank 1/cp of its tokens), with or without FSDP over dp (over dp·cp with context parallelism), sequence
parallelism and full activation recomputation.

Per micro-batch on the busiest pipeline rank (the terms of :class:`Estimate`):
- compute: the rank's matmul FLOPs (forward 1×, backward 2×, recomputation another forward of the
  blocks: the embeddings, head and loss are not checkpointed) at the
  profile's sustained matmul rate, plus the memory-bound work: the activations a layer keeps (Korthikanti
  et al. 2022's bytes per layer, :func:`~autotp.reports.pipeline.layer_activation_bytes`) are written
  and read once per pass (:data:`TRAFFIC`: the forward's ops write what they keep and the next op reads it,
  the backward reads it and writes its gradient), at the memory bandwidth; and the profile's fixed cost per
  op (a launch, a dispatch) for each op of the graph, per pass;
- tp comm: the plan's collectives for the rank's layers (the forward's again when recomputing), not
  overlapped (each is waited on before its consumer runs);
- cp comm: ring attention (torch's, load-balanced: each rank 1/cp of every layer's attention FLOPs) gathers
  every rank's K and V per layer before its forward (2·b·s·h_kv elements over the group, the full tensor),
  gathers them again in the backward and hands each rank's dK and dV back (as many bytes again), none of it
  overlapped; the gradients are summed over the cp group once per backward (one all-reduce of them all);
- pp: the bubble (p − 1)/(v·m) of the ideal time (Narayanan et al. 2021, §2.2), and two point-to-point
  sends of b·s·h activations per micro-batch and stage boundary (v per rank; s/t of them per tp rank with
  sequence parallelism, or with Megatron-LM's scatter/gather, which then all-gathers them inside the node);
- dp comm: the data-parallel collectives the compute does not hide, and the copies into and out of their
  buffers (each byte read and written once at :attr:`Hardware.copy_rate`: the rate `autotp profile`
  measured for copies into a flat buffer and out of it, else, assumed, the memory bandwidth). DDP: the
  gradient all-reduce once per step (``no_sync`` between micro-batches), overlapped with the last
  micro-batch's backward but for its last 25 MB bucket. FSDP: all-gathers before forward and backward and a
  reduce-scatter after it, per micro-batch, each overlapped with that pass's compute (prefetch) but for one
  block's worth; or, pipelined (each stage one unit kept gathered, as torch's schedules run FSDP) or with
  ``keep`` (FSDP2's ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)`` between a
  step's micro-batches), one all-gather before the first micro-batch and one reduce-scatter after the last.
  With FSDP's mixed precision (``fsdp_dtype``, torchtitan's ``param_dtype=bf16, reduce_dtype=fp32``) the
  gathers carry 16-bit weights and the reduce-scatters the model's dtype. Where the collectives run on the
  compute's own cores (gloo on a CPU: ``Hardware.overlap`` false) nothing is hidden;
- optimizer: the profile's measured AdamW time per parameter the rank holds, or reading and writing 16
  bytes of state per parameter at memory bandwidth (a fused step).

Ranks that take turns on one device (``Hardware.share`` > 1: more CPU ranks than cores, pipeline stages
dealt round the cores) hand their idle time to each other: the bubble shrinks by (share − 1)/(p − 1).

Context parallelism divides a rank's FLOPs, activations, tp collectives and logits by cp; its parameters are
whole on every cp rank, and one layer's gathered K and V are held while it runs.

Memory per rank: 16 bytes per parameter it holds (weights, gradients, Adam; ÷ dp·cp with FSDP, plus two
blocks gathered; pipelined, the stage's weights gathered and its gradients unsharded through the step), the activations of the micro-batches in flight (Korthikanti et al.'s formula, or one
layer input per layer with recomputation, plus one layer's worth being recomputed) and the last stage's
logits in fp32 (and under autocast the 16-bit copies of the weights autocast caches, which FSDP's mixed
precision does not make: its gathered weights are already 16-bit), against 90% of
the device's memory. Nothing here is measured; :mod:`autotp.search.auto` enumerates layouts and ranks them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from autotp.search.model_costs import BLOCKS, FIRST, LAST, ModelCosts
from autotp.search.hardware import Hardware
from autotp.reports.pipeline import in_flight, layer_activation_bytes

RESERVED = 0.1  # of the device's memory: the CUDA context, communication buffers, the allocator's fragmentation
STATE_BYTES = 16  # weights + gradients + Adam moments (+ fp32 master weights for 16-bit weights) per parameter
# bytes moved per byte of kept activations per pass: written once and read once (assumed; the elementwise ops
# of a layer, norms, softmax, dropout, GeLU, residual adds, are memory-bound and each reads its input and writes
# its output)
TRAFFIC = 2
DDP_BUCKET = 25 * 2**20  # torch DDP's default bucket: the last one cannot overlap the backward


@dataclass(frozen=True)
class Candidate:
    """One layout the search prices: its sizes (tp × cp × dp × pp), micro-batching and the options it runs with."""

    tp: int
    dp: int
    pp: int
    micro_batch: int
    microbatches: int
    v: int = 1
    fsdp: bool = False
    sp: bool = False
    recompute: bool = False
    cp: int = 1  # context-parallel ranks sharing each sample's sequence
    # FSDP's mixed precision (FSDP2's MixedPrecisionPolicy): the dtype its all-gathers carry and the compute
    # reads ("bf16": torchtitan's param_dtype), the gradients reduced in the model's own dtype (reduce_dtype
    # fp32); None: parameters gathered in the model's dtype, autocast casting its own copies
    fsdp_dtype: str | None = None
    # FSDP without a pipeline, several micro-batches: the weights kept gathered and the gradients unsharded
    # through the step (one all-gather and one reduce-scatter per step, FSDP2's set_reshard_after_backward(False)
    # and set_requires_gradient_sync(False) between micro-batches), instead of both per micro-batch
    keep: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def batch(self) -> int:
        return self.dp * self.micro_batch * self.microbatches

    @property
    def schedule(self) -> str | None:
        return None if self.pp == 1 else "1F1B" if self.v == 1 else "Interleaved1F1B"

    def label(self) -> str:
        fsdp = ("·fsdp" + (f"({self.fsdp_dtype})" if self.fsdp_dtype else "")) if self.fsdp else ""
        parts = [f"tp{self.tp}", *([f"cp{self.cp}"] if self.cp > 1 else []), f"dp{self.dp}" + fsdp, f"pp{self.pp}"]
        if self.v > 1:
            parts.append(f"v{self.v}")
        parts.append(f"mb{self.micro_batch}×{self.microbatches}")
        if self.sp:
            parts.append("sp")
        if self.recompute:
            parts.append("rc")
        if self.keep:
            parts.append("keep")
        return " ".join(parts)


@dataclass(frozen=True)
class Training:
    """How the step runs: element sizes of activations and of what travels, the sequence length."""

    act_bytes: int = 2  # bf16 autocast
    seq: int | None = None  # default: the captured sequence length
    act_dtype: str = "bf16"  # its name: what FSDP's mixed precision gathers in
    ddp_overlap: bool = True  # DDP's all-reduce runs beside the backward (torch's DDP); False: after it
    # a pipeline's replicated hidden state (no sequence parallelism) sent as Megatron-LM sends it (Narayanan et
    # al. 2021, §4.1, on in their Table 1): each tp rank sends 1/t of it across, and the receiving tp group
    # all-gathers it over the node's links; False: each tp rank sends its whole copy (autotp's pipeline)
    scatter_gather: bool = False


@dataclass(frozen=True)
class Memory:
    state: float  # parameters, gradients, optimizer state (bytes)
    activations: float
    other: float  # FSDP's gathered blocks, the last stage's fp32 logits
    capacity: float
    parts: tuple[tuple[str, float], ...] = ()  # what ``other`` is made of, named (bytes)

    @property
    def total(self) -> float:
        return self.state + self.activations + self.other

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def over(self) -> float:
        return max(0.0, self.total - self.capacity)


@dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    compute: float  # seconds per step: the busiest rank's compute, bubble excluded
    tp_comm: float
    pp_bubble: float
    pp_comm: float
    dp_comm: float  # exposed, not overlapped
    optimizer: float
    memory: Memory
    tokens: int  # per step, all replicas
    model_flops: float  # per step, all ranks: 3 × the forward's matmul FLOPs (no recomputation)
    cp_comm: float = 0.0  # ring attention's K/V gathers and the gradients' sum over the cp group

    @property
    def step(self) -> float:
        return (self.compute + self.tp_comm + self.cp_comm + self.pp_bubble + self.pp_comm + self.dp_comm
                + self.optimizer)

    @property
    def tokens_per_device(self) -> float:
        return self.tokens / self.step / self.candidate.world

    @property
    def flops_per_device(self) -> float:
        return self.model_flops / self.step / self.candidate.world

    TERMS = ("compute", "tp comm", "cp comm", "pp bubble", "pp comm", "dp comm", "optimizer")

    def terms(self) -> dict[str, float]:
        """The step's terms, in :attr:`TERMS` order: they add up to :attr:`step`."""
        values = (self.compute, self.tp_comm, self.cp_comm, self.pp_bubble, self.pp_comm, self.dp_comm,
                  self.optimizer)
        return dict(zip(self.TERMS, values))

    def to_dict(self) -> dict:
        # "layout": the key the JSON of `autotp plan --auto` has always carried
        return {"layout": asdict(self.candidate), "label": self.candidate.label(), "step_s": self.step, **{
            k.replace(" ", "_") + "_s": v for k, v in self.terms().items()},
            "memory": {**asdict(self.memory), "total": self.memory.total, "fits": self.memory.fits},
            "tokens_per_s_per_device": self.tokens_per_device, "flops_per_device": self.flops_per_device}


def _per_node(ranks: int, stride: int, gpus_per_node: int) -> int:
    """Members of a group of ``ranks`` ranks ``stride`` apart that share a node (TP innermost: Megatron's order)."""
    return max(1, min(ranks, gpus_per_node // stride)) if stride < gpus_per_node else 1


def _comm_time(hw: Hardware, costs: ModelCosts, lay: Candidate, part: str, samples: float, share: float,
               act_bytes: int, recompute: bool) -> float:
    """The part's tp collectives for ``samples`` samples and ``share`` of its layers."""
    if lay.tp == 1:
        return 0.0
    per_node = _per_node(lay.tp, 1, hw.gpus_per_node)
    total = 0.0
    for c in costs.tp(lay.tp).comm.get(part, ()):
        count = c.count * share
        if count <= 0:
            continue
        each = c.elements / c.count * samples * act_bytes
        again = 2 if recompute and c.direction == "forward" else 1
        total += again * hw.collective(c.kind, each, lay.tp, per_node, count=1) * count
    return total


def estimate(costs: ModelCosts, hw: Hardware, lay: Candidate, training: Training = Training()) -> Estimate:
    """Price ``lay`` for ``costs`` on ``hw``."""
    t, c, d, p, v, b, m = lay.tp, lay.cp, lay.dp, lay.pp, lay.v, lay.micro_batch, lay.microbatches
    tf = costs.tp(t)
    act = training.act_bytes
    s = training.seq or costs.seq
    scale = s / costs.seq  # FLOPs and collectives are taken at the captured length; attention grows faster
    L = costs.layers
    ls = L / p  # layers on one pipeline rank (v chunks of L/(p·v))
    passes = 4 if lay.recompute else 3  # forward, backward (2×), recomputed forward
    tokens = b * scale / c  # samples' worth of tokens one rank computes per micro-batch

    rate = hw.matmul_rate(b * s / c, costs.hidden)  # a micro-batch's tokens on one rank: its matmuls' rows

    def flops_time(fwd_flops: float) -> float:
        split = tf.flops_split
        per_rank = fwd_flops * (split / t + (1 - split))
        return passes * per_rank / rate

    # -- compute per micro-batch: the blocks on this rank, plus the first or last part's extra ------------
    # with sequence parallelism norms, dropouts and residuals are split over t too; with cp every term is
    # the rank's 1/cp of the tokens, and the attention runs fused (ring attention is SDPA's)
    layer_bytes = layer_activation_bytes(b, s, costs.hidden, costs.heads, t, act, costs.dropout,
                                         costs.fused_attention or c > 1, lay.sp and t > 1) / c
    launch = passes * hw.overhead  # per op of the forward: the backward dispatches about twice as many
    ring_ops = 2 * c if c > 1 else 0  # per layer: an attention call and a merge of its output per ring step
    # each byte a layer keeps is written by the op that makes it and read by the one that uses it, in every pass
    # (the backward reads it and writes its gradient): twice per pass at the memory bandwidth
    blocks_time = ls * (flops_time(costs.block_flops * tokens) + passes * TRAFFIC * layer_bytes / hw.memory_bandwidth
                        + launch * (costs.ops[BLOCKS] / L + ring_ops))
    # the ends (embeddings; final norm, head and loss) run forward and backward once: what recomputes is the
    # checkpointed blocks (the paper's equation 3 counts the head's 2·s·h·V three times, not four)
    ends = 3 / passes
    first = ends * (flops_time(costs.flops[FIRST] * tokens) + launch * costs.ops[FIRST])
    last = ends * (flops_time(costs.flops[LAST] * tokens) + launch * costs.ops[LAST])
    share = 1 / p
    comm_blocks = _comm_time(hw, costs, lay, BLOCKS, tokens, share, act, lay.recompute)
    comm_first = _comm_time(hw, costs, lay, FIRST, tokens, 1, act, False)
    comm_last = _comm_time(hw, costs, lay, LAST, tokens, 1, act, False)
    if p == 1:
        compute_mb, comm_mb = blocks_time + first + last, comm_blocks + comm_first + comm_last
    else:  # the busier end stage sets the pace
        ends = [(blocks_time + first, comm_blocks + comm_first), (blocks_time + last, comm_blocks + comm_last)]
        compute_mb, comm_mb = max(ends, key=lambda x: sum(x))

    # -- context parallel: K and V gathered per layer, forward (again when recomputing) and backward, and dK
    # and dV handed back; the group's ranks are tp apart
    local = _local_params(costs, lay)
    grad_bytes = local * costs.param_bytes  # gradients travel in the model's dtype (FSDP's reduce_dtype: fp32)
    gather_elem = _gather_bytes(costs, lay, act)  # FSDP's all-gathers: in the mixed-precision dtype
    gather_bytes = local * gather_elem
    copy = 2 / hw.copy_rate  # bytes copied in and out of communication buffers: read and written
    cp_mb = cp_step = 0.0
    if c > 1:
        cp_node = _per_node(c, t, hw.gpus_per_node)
        kv = kv_bytes(costs, b, s, t, act)
        gathers = 3 if lay.recompute else 2
        cp_mb = ls * (gathers * hw.collective("all_gather", kv, c, cp_node)
                      + hw.collective("reduce_scatter", kv, c, cp_node))
        # the gradients summed over the group after each backward, copied into the flat buffer and back (with
        # FSDP its reduce-scatter over the dp and cp ranks sums them instead)
        if not lay.fsdp:
            cp_step = hw.collective("all_reduce", grad_bytes, c, cp_node) + 2 * grad_bytes * copy

    # -- pipeline: bubble and point-to-point sends ------------------------------------------------------------
    bubble = (p - 1) / (v * m) if p > 1 else 0.0
    p2p = 0.0
    if p > 1:
        per_node = 2 if t * c * d < hw.gpus_per_node else 1
        hidden = b * s * costs.hidden * act / c  # the hidden state crossing a cut, (b, s/cp, h)
        # with sequence parallelism each tp rank holds (and sends) its s/t positions; with Megatron's
        # scatter/gather 1/t of the replicated state, all-gathered inside the receiving tp group
        split = t if lay.sp or training.scatter_gather else 1
        p2p = 2 * v * hw.collective("send", hidden / split, 2, per_node)
        if training.scatter_gather and not lay.sp:
            p2p += 2 * v * hw.collective("all_gather", hidden, t, _per_node(t, 1, hw.gpus_per_node))

    # -- data parallel: DDP over d; FSDP over the d·c ranks holding the same parameters -------------------------
    f = d * c if lay.fsdp else d
    dp_node = _per_node(f, t, hw.gpus_per_node) if lay.fsdp else _per_node(d, t * c, hw.gpus_per_node)
    backward_mb = compute_mb * (2 + int(lay.recompute)) / passes
    forward_mb = compute_mb / passes
    dp_exposed = 0.0
    # where collectives share the compute's cores nothing hides them; nor DDP's all-reduce where the training
    # loop reduces the gradients after the backward (Megatron-LM 2021)
    hide = 1.0 if hw.overlap else 0.0
    ddp_hide = hide if training.ddp_overlap else 0.0
    if d > 1 and not lay.fsdp:  # one all-reduce per 25 MB bucket; gradients copied into buckets and back
        buckets = max(1, math.ceil(grad_bytes / DDP_BUCKET))
        total = hw.collective("all_reduce", grad_bytes / buckets, d, dp_node, count=buckets)
        tail = total / buckets
        dp_exposed = max(tail, total - ddp_hide * backward_mb) + 2 * grad_bytes * copy
    elif f > 1 and (p > 1 or lay.keep):  # each stage one unit (torchtitan's choice), or the whole model kept
        # gathered between micro-batches: one all-gather before the first micro-batch, one reduce-scatter after
        # the last; pipelined, neither hidden (the stage has nothing else to run), else the first forward and
        # the last backward hide them but for one block's worth
        gather = hw.collective("all_gather", local * gather_elem, f, dp_node)
        scatter = hw.collective("reduce_scatter", local * costs.param_bytes, f, dp_node)
        copies = (gather_bytes + grad_bytes) * copy  # into and out of the flat buffers once each
        if p > 1:
            dp_exposed = gather + scatter + copies
        else:
            units = math.ceil(ls) + 1
            dp_exposed = (max(gather / units, gather - hide * forward_mb)
                          + max(scatter / units, scatter - hide * backward_mb) + copies)
    elif f > 1:  # FSDP: per unit (each block, the two ends) gathers before forward and backward, reduce-scatter
        # after, each through a flat buffer the parameters and gradients are copied out of and into, per micro-batch
        units = math.ceil(ls) + 1
        gather = hw.collective("all_gather", gather_bytes / units, f, dp_node, count=units)
        scatter = hw.collective("reduce_scatter", grad_bytes / units, f, dp_node, count=units)
        one_block = gather / units
        dp_exposed = m * (max(one_block, gather - hide * forward_mb)
                          + max(one_block, gather + scatter - hide * backward_mb)
                          + (2 * gather_bytes + grad_bytes) * copy)

    # -- optimizer: read and write the state once ------------------------------------------------------------
    held = local / (d * c if lay.fsdp else 1)
    optimizer = held * (hw.optimizer or 2 * STATE_BYTES / hw.memory_bandwidth)

    compute = m * compute_mb
    tp_comm = m * comm_mb
    cp_comm = m * (cp_mb + cp_step)
    # ranks taking turns on a device (stages dealt round the cores) hand their idle time to each other
    absorbed = min(1.0, (hw.share - 1) / (p - 1)) if p > 1 else 0.0
    pp_bubble = bubble * (1 - absorbed) * (compute + tp_comm + cp_comm + m * p2p)
    memory = _memory(costs, hw, lay, layer_bytes, s, act)
    tokens_step = lay.batch * s
    model_flops = 3 * (costs.flops[FIRST] + costs.flops[BLOCKS] + costs.flops[LAST]) * scale * lay.batch
    return Estimate(lay, compute, tp_comm, pp_bubble, m * p2p, dp_exposed, optimizer, memory, tokens_step,
                    model_flops, cp_comm)


def kv_bytes(costs: ModelCosts, b: int, s: int, t: int, act: int) -> float:
    """One layer's K and V over the whole sequence on one tp rank: what ring attention gathers (its kv heads
    split over t, or whole where they are fewer than t)."""
    width = costs.kv_width or 2 * costs.hidden
    heads = costs.kv_heads or costs.heads or t
    return b * s * width * act / (t if heads % t == 0 else 1)


def _gather_bytes(costs: ModelCosts, lay: Candidate, act: int) -> int:
    """Bytes per parameter element FSDP's all-gathers carry: the mixed-precision dtype's (the activations'),
    else the model's own."""
    return act if lay.fsdp and lay.fsdp_dtype else costs.param_bytes


def _local_params(costs: ModelCosts, lay: Candidate) -> float:
    """Parameters one rank holds before FSDP: its stage's blocks, and the embeddings / head on the end stages
    (the larger end for the busiest rank)."""
    params = costs.tp(lay.tp).params
    blocks = params[BLOCKS] / lay.pp
    if lay.pp == 1:
        return blocks + params[FIRST] + params[LAST]
    return blocks + max(params[FIRST], params[LAST])


def _memory(costs: ModelCosts, hw: Hardware, lay: Candidate, layer_bytes: float, s: int, act: int) -> Memory:
    t, d, p, v, b, m = lay.tp, lay.dp, lay.pp, lay.v, lay.micro_batch, lay.microbatches
    local = _local_params(costs, lay)
    state = STATE_BYTES * local / (d * lay.cp if lay.fsdp else 1)
    ls = costs.layers / p
    if p == 1:
        flight = 1  # micro-batches run one after another (gradient accumulation)
    else:  # the first pipeline rank holds the most; in_flight counts (stage, micro-batch) pairs of L/(p·v) layers
        sched = lay.schedule or "1F1B"
        flight = in_flight(sched, p, v, m, 0) / v
    if lay.recompute:  # each layer's input, plus one layer being recomputed
        layer_input = b * s * costs.hidden * act / (t if lay.sp else 1) / lay.cp
        activations = flight * ls * layer_input + layer_bytes
    else:
        activations = flight * ls * layer_bytes
    parts: list[tuple[str, float]] = []
    if lay.cp > 1:  # one layer's K and V gathered from the group while it runs
        parts.append(("K/V gathered", kv_bytes(costs, b, s, t, act)))
    gather = _gather_bytes(costs, lay, act)
    sharded = lay.fsdp and d * lay.cp > 1
    if act < costs.param_bytes and not (lay.fsdp and lay.fsdp_dtype):  # autocast's 16-bit copies of the
        # weights, cached for the step (of the gathered weights under FSDP too); with FSDP's mixed precision the
        # gathered 16-bit weights are what the compute reads, and nothing is cast
        parts.append(("autocast weight copies", act * local))
    if costs.vocab:  # the last stage's logits: its vocab slice, the loss in fp32
        parts.append(("logits", b * s * costs.vocab / t / lay.cp * (act + 4)))
    if sharded and (p > 1 or lay.keep):  # the stage (or model) gathered through the step, its gradients
        # unsharded until the one reduce-scatter after the last micro-batch
        parts.append(("gathered weights and unsharded gradients", local * (gather + costs.param_bytes)))
    elif sharded:  # two blocks gathered at once (one computing, one prefetched)
        parts.append(("gathered blocks", 2 * costs.tp(t).params[BLOCKS] / costs.layers * gather))
    other = sum(v for _, v in parts)
    return Memory(state, activations, other, (1 - RESERVED) * hw.memory_bytes, tuple(parts))
