"""``autotp.pipeline``: pipeline stages cut from the captured graph, run by ``torch.distributed.pipelining``.

The model is captured once at the micro-batch's shapes, sharded by its TP plan (:func:`parallelize_state`),
and its rewritten graph cut at block boundaries into ``pp × v`` stages balanced by FLOPs
(:mod:`autotp.plan.stages`, :func:`autotp.passes.split_stages`). Each rank keeps the stages the schedule
places on it (stage s on pipeline rank s mod pp; the V schedules fold the second half back) and never
allocates any other parameter (meta). torch's ``PipelineStage`` sends the hidden state across each cut (masks
and rotary tables are made again where they are read); a schedule by name (GPipe, 1F1B, Interleaved1F1B,
LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble) runs the micro-batches. ``eval_step`` runs the graph
captured in eval mode, cut into the same stages.

Megatron's rank grid (:mod:`autotp.distributed.rank_grid`): TP inside a node, then DP, then PP. With dp > 1 each
stage is wrapped in DDP over its data-parallel group (``PipelineStage`` defers its gradient all-reduce to
the last micro-batch). A parameter read by stages on several pipeline ranks (an LM head tied to the token
embedding: Megatron's embedding group) has its gradient summed over those ranks after each step, so its
copies stay identical. Gradients are the mean over micro-batches (each micro-batch's loss a mean over its
tokens), as one step on the whole batch gives. With fp16's ``GradScaler`` an overflow in any stage is made
every rank's, so every rank skips the step together.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor

from autotp.capture.modelfile import find_loss
from autotp.capture.structure import call_key, flatten, unflatten
from autotp.errors import PipelineError, ProcessGroupError
from autotp.distributed.data_parallel import FSDPConfig
from autotp.options import Options, PipelineOptions
from autotp.parallel.data import check_same_inputs
from autotp.parallel.fsdp import apply_stage_fsdp
from autotp.parallel.parallelize import _graph_for, _split_example, parallelize_state
from autotp.parallel.stage_writes import StageWrites, output_stages, stage_writes, written_loss
from autotp.plan.stages import StageRequest
from autotp.operators.stages import STAGE_PREFIX, StageModule, Whole, input_name, wire_stages
from autotp.state import Captured, tp_state


@dataclass(frozen=True)
class ScheduleKind:
    cls: type
    placement: str  # "single": one stage per rank; "loop": stage s on rank s mod pp; "v": V-shaped, 2 per rank


SCHEDULES: dict[str, ScheduleKind] = {
    "GPipe": ScheduleKind(schedules.ScheduleGPipe, "single"),
    "1F1B": ScheduleKind(schedules.Schedule1F1B, "single"),
    "Interleaved1F1B": ScheduleKind(schedules.ScheduleInterleaved1F1B, "loop"),
    "LoopedBFS": ScheduleKind(schedules.ScheduleLoopedBFS, "loop"),
    "InterleavedZeroBubble": ScheduleKind(schedules.ScheduleInterleavedZeroBubble, "loop"),
    "ZBVZeroBubble": ScheduleKind(schedules.ScheduleZBVZeroBubble, "v"),
}


def schedule_kind(name: str) -> tuple[str, ScheduleKind]:
    """The schedule of ``name`` (any case), or PipelineError listing the known ones."""
    found = {k.lower(): k for k in SCHEDULES}.get(name.lower())
    if found is None:
        raise PipelineError(f"unknown pipeline schedule {name!r}", hint=f"use one of {', '.join(SCHEDULES)}")
    return found, SCHEDULES[found]


def check_pipeline(pp: int, schedule: str, virtual_stages: int | None, microbatches: int,
                   batch: int | None = None) -> tuple[str, int]:
    """Validate the pipeline's sizes before any rank works (:meth:`PipelineOptions.validate`); returns the
    schedule's name and v."""
    asked = PipelineOptions(pp, schedule, microbatches, virtual_stages).validate(batch)
    return asked.schedule, asked.virtual_stages


def stage_ranks(pp: int, count: int, placement: str) -> list[int]:
    """The pipeline rank of each of ``count`` stages."""
    if placement == "v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(count)]
    return [s % pp for s in range(count)]


def _batch_size(flat: list[torch.Tensor]) -> int:
    first = next((t for t in flat if t.dim() > 0), None)
    if first is None:
        raise PipelineError("a pipeline step needs a batched tensor input to cut into micro-batches; "
                            "every input is a scalar")
    return first.shape[0]


def _microbatch(flat: list[torch.Tensor], m: int) -> list[torch.Tensor]:
    """The first of ``m`` micro-batches of ``flat`` (tensors whose dim 0 is the batch are cut)."""
    b = _batch_size(flat)
    return [t.narrow(0, 0, b // m) if t.dim() > 0 and t.shape[0] == b else t for t in flat]


def _loss_index(c: Captured) -> int:
    """Which flat output of the graph is the loss (as :func:`find_loss` reads the model's output)."""
    outs = next(n for n in c.module.graph.nodes if n.op == "output").args[0]
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    marks = []
    for node in outs:
        val = node.meta.get("val") if hasattr(node, "meta") else None
        marks.append(torch.empty((1,) * (val.dim() if isinstance(val, torch.Tensor) else 0), device="meta"))
    loss = find_loss(unflatten(marks, c.out))
    if loss is None:
        kept = written_loss(c.module, c.writes)  # llama2.c: the forward returns logits, keeps the loss on the model
        if kept is not None:
            return kept
        raise PipelineError("the model's output carries no loss (looked for out.loss, out['loss'], a 0-dim "
                            "tensor last in a tuple and a 0-dim tensor the forward keeps on the model): the last "
                            "pipeline stage must end in the loss",
                            hint="give example_inputs (and each step) the targets the forward computes the loss from")
    return next(i for i, t in enumerate(marks) if t is loss)


def _resolve_mesh(mesh: DeviceMesh | None, pp: int | None, tp: int | None) -> DeviceMesh:
    if mesh is None:
        from autotp.distributed.launch import current_mesh, init_distributed

        mesh = current_mesh()  # under `autotp run`: the rank grid's (pp, dp, tp) mesh
        if mesh is None:
            if pp is None:
                raise ProcessGroupError("autotp.pipeline needs the pipeline size: pass pp=... (and tp=...), a "
                                        "(pp, dp, tp) device mesh, or start the script with `autotp run --pp P`")
            mesh = init_distributed(tp or 1, pp=pp).mesh
    names = mesh.mesh_dim_names or ()
    if "pp" not in names or "tp" not in names:
        raise ProcessGroupError(f"the device mesh has dims {names}; a pipeline needs 'pp' and 'tp' (and 'dp')",
                                hint="build it as init_device_mesh(device, (pp, dp, tp), "
                                     "mesh_dim_names=('pp', 'dp', 'tp'))")
    if pp is not None and mesh.size(names.index("pp")) != pp:
        raise PipelineError(f"pp={pp}, but the device mesh has {mesh.size(names.index('pp'))} pipeline ranks")
    return mesh


class Pipeline:
    """A pipelined model's training step. ``step(*args, **kwargs)``: the model's own call (inputs and
    targets) on the whole batch, on every rank; returns the loss (the mean over micro-batches) on every rank.
    ``parameters()``: this rank's stages' parameters, for the optimizer."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, schedule: str, v: int, microbatches: int,
                 key, modules: list[StageModule], indices: list[int], count: int,
                 tied: list[tuple[nn.Parameter, dist.ProcessGroup]], micro: tuple[tuple, dict],
                 scaler: torch.amp.GradScaler | None = None, compiled: dict | None = None, fsdp: bool = False,
                 writes: StageWrites | None = None, cut: set[int] = frozenset()):
        self.model = model
        self._writes, self._cut = writes, set(cut)  # the state the forward writes, and the inputs cut per micro-batch
        self.compiled = compiled  # torch.compile's options for each stage's piece; None: eager
        self.fsdp = fsdp  # each stage an FSDP unit over dp (else DDP when dp > 1)
        self.scaler = scaler
        self.mesh = mesh
        self.schedule_name = schedule
        self.virtual_stages = v
        self.microbatches = microbatches
        self.stage_indices = tuple(indices)
        self.num_stages = count
        self.modules = modules
        self._key, self._tied, self._micro = key, tied, micro
        self._checked = False
        names = mesh.mesh_dim_names
        self.pp_group = mesh.get_group("pp")
        self.pp = mesh.size(names.index("pp"))
        self.dp = mesh.size(names.index("dp")) if "dp" in names else 1
        self._ranks = stage_ranks(self.pp, count, SCHEDULES[schedule].placement)
        self.last_rank = self._ranks[count - 1]
        self.stages, self.schedule = self._runner(modules, train=True)
        self._eval: tuple | None = None  # the eval-mode graph's stages and schedule, made on first use

    def _runner(self, modules: list[StageModule], train: bool) -> tuple[list[PipelineStage], object]:
        """``PipelineStage``s of ``modules`` (under DDP for training with dp > 1) and the schedule running them."""
        device = tp_state(self.model).device
        first = {input_name(i): t for i, t in enumerate(flatten(self._micro)[0])}
        metas = _probe(self.model, dict(zip(self.stage_indices, modules)), self._ranks, self.pp_group, first, train)
        _reshard(modules)  # kept gathered (reshard_after_forward=False) by the probe: the shards are the parameters
        wrapped = [self._data_parallel(m) if train else m for m in modules]
        stages = [PipelineStage(m, s, self.num_stages, device, input_args=metas[s][0], output_args=metas[s][1],
                                group=self.pp_group) for m, s in zip(wrapped, self.stage_indices)]

        def loss_fn(out: torch.Tensor, _index: torch.Tensor) -> torch.Tensor:
            loss = out.sum()  # the last stage returns the micro-batch's loss, shape (1,); not a view (detach_)
            return self.scaler.scale(loss) if self.scaler is not None and train else loss

        kind = SCHEDULES[self.schedule_name]
        if kind.placement == "single":
            return stages, kind.cls(stages[0], self.microbatches, loss_fn=loss_fn)
        return stages, kind.cls(stages, self.microbatches, loss_fn=loss_fn)

    def _data_parallel(self, module: StageModule) -> nn.Module:
        if self.dp == 1 or self.fsdp:
            return module
        device = tp_state(self.model).device
        return nn.parallel.DistributedDataParallel(
            module, process_group=self.mesh.get_group("dp"),
            device_ids=[device.index] if device.type == "cuda" else None)

    def parameters(self):
        """This rank's stages' parameters (each once)."""
        seen: set[int] = set()
        for m in self.modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def named_parameters(self):
        """This rank's stages' parameters under the model's names (each once)."""
        mine = {id(p) for p in self.parameters()}
        for name, p in self.model.named_parameters():
            if id(p) in mine:
                yield name, p

    def _inputs(self, args: tuple, kwargs: dict) -> dict[str, object]:
        flat = flatten((args, kwargs))[0]
        key = call_key(args, kwargs, self._key[2])  # step trains and eval_step evaluates, whatever the mode
        if key[:-1] == self._key[:-1] and key[-1] != self._key[-1]:
            raise PipelineError("this step runs under another autocast state than the pipeline was built under: "
                                "its stages were captured, and send tensors of the dtypes, as they run there",
                                hint="build autotp.pipeline(...) inside the same torch.autocast(...) context that "
                                     "each step runs in (or step outside autocast if it was built outside)")
        if key != self._key:
            raise PipelineError("this step's inputs differ in structure, dtype or shape from example_inputs: the "
                                "pipeline's stages send tensors of the shapes captured from them",
                                hint="step with batches shaped like example_inputs (the same batch size and "
                                     "sequence length)")
        st = tp_state(self.model)
        if (st.tp > 1 or st.cp > 1) and not self._checked:  # the ranks of a tp or cp group share the batch
            for group in (g for g, n in ((st.group, st.tp), (st.cp_group, st.cp)) if n > 1):
                check_same_inputs(args, kwargs, group)
            self._checked = True
        b = _batch_size(flat)
        if b % self.microbatches:
            raise PipelineError(f"{self.microbatches} micro-batches do not divide the batch of {b}")
        return {input_name(i): t if t.dim() > 0 and t.shape[0] == b else Whole(t) for i, t in enumerate(flat)}

    def _loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        device = tp_state(self.model).device
        loss = torch.stack([x.detach().float() for x in losses]).mean() if losses else \
            torch.zeros((), device=device)
        ranks = dist.get_process_group_ranks(self.pp_group)
        dist.broadcast(loss, src=ranks[self.last_rank], group=self.pp_group)
        return loss

    def step(self, *args, **kwargs) -> torch.Tensor:
        """One forward and backward of the whole batch through the schedule; gradients accumulate into
        ``parameters()`` (the micro-batches' mean). Returns the loss on every rank.

        With a ``GradScaler`` (``pipeline(..., scaler=...)``) the backward starts from the scaled loss, and an
        inf/nan in any stage's gradients is made every rank's: each rank's ``scaler.unscale_``/``step`` then
        skips the step together (Megatron all-reduces ``found_inf`` over the model-parallel group)."""
        inputs = self._inputs(args, kwargs)
        losses: list[torch.Tensor] = []
        # the schedule's loss_fn takes a target per micro-batch; the loss is the stage's own output
        index = torch.arange(self.microbatches, device=tp_state(self.model).device)
        scale = 1.0
        if self.scaler is not None:  # on every rank, loss or not: the scaler's state exists for its unscale_
            scale = self.scaler.scale(torch.ones((), device=index.device)).item()
        _clear_kept(self.modules)  # the metadata probe's forward, or a step that failed, kept some
        self.schedule.step(target=index, losses=losses, return_outputs=False, **inputs)
        self._sum_kv_copies()
        self._sum_chunks()
        for p, group in self._tied:  # Megatron's embedding group: the copies of a tied weight get one gradient
            if p.grad is not None:  # under FSDP each copy's dp piece: the same rows on every holder
                dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=group)
        if self.scaler is not None:
            self._agree_non_finite()
        loss = self._loss(losses) / scale
        self._write_back(self._writes, self.modules, args, kwargs, loss)
        return loss

    def _write_back(self, writes: StageWrites | None, modules: list[StageModule], args: tuple, kwargs: dict,
                    loss: torch.Tensor) -> None:
        """What the forward writes on the model, written on it for the whole batch by the rank whose stage
        computes it (:mod:`autotp.parallel.stage_writes`)."""
        if writes is None:
            return
        kept: dict[int, list[torch.Tensor]] = {}
        for m in modules:
            kept.update(m.kept)
        st = tp_state(self.model)
        writes.write(self.model, kept, self.stage_indices, flatten((args, kwargs))[0], loss, self.microbatches,
                     [g.module for g in st.graphs.values()], st.warned)
        _clear_kept(modules)

    def _sum_kv_copies(self) -> None:
        """The gradients of parameters held whole and cut in the graph (kv heads on several tp ranks, under
        FSDP) summed over tp in one all-reduce, once per step: each rank's is its slice's, scattered into the
        whole (under FSDP this rank's dp rows of it, the same rows on every tp rank)."""
        names = {c.name for c in tp_state(self.model).plan.graph_cuts if not c.in_graph}
        mine = {id(p) for p in self.parameters()}
        grads = [p.grad for n, p in self.model.named_parameters() if n in names and id(p) in mine and p.grad is not None]
        if not grads:
            return
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        flat = torch.cat([g.reshape(-1) for g in local])  # (Σ numel,): one bucket
        dist.all_reduce(flat, group=tp_state(self.model).group)
        for g, piece in zip(local, flat.split([g.numel() for g in local])):
            g.copy_(piece.view_as(g))

    def _sum_chunks(self) -> None:
        """With context parallelism each rank's gradients cover its own chunk's tokens (the loss is the group's
        mean, each rank's term its own tokens'): every gradient of this rank's stages summed over the cp group
        in one all-reduce of them all, flattened together, once per step (after DDP's average over dp: the
        two commute)."""
        st = tp_state(self.model)
        if st.cp == 1:
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        flat = torch.cat([g.reshape(-1) for g in local])  # (Σ numel,): one bucket
        dist.all_reduce(flat, group=st.cp_group)
        for g, piece in zip(local, flat.split([g.numel() for g in local])):
            g.copy_(piece.view_as(g))

    def _agree_non_finite(self) -> None:
        """An inf/nan in one rank's gradients, written into every rank's: the scaler skips on all of them."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        device = tp_state(self.model).device
        bad = torch.zeros((), device=device)
        if grads:
            bad = torch.stack([torch.isfinite(g).all().logical_not() for g in grads]).any().float()
        for group in (self.pp_group, tp_state(self.model).group):
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        if bad.item() and grads:
            grads[0].view(-1)[0] = float("inf")

    def _eval_runner(self) -> tuple:
        """The stages and schedule of the graph captured in eval mode (the same stages, cut the same way)."""
        if self._eval is None:
            st = tp_state(self.model)
            args, kwargs = self._micro
            was = self.model.training
            self.model.eval()
            try:
                c = _graph_for(self.model, st, args, kwargs, call_key(args, kwargs, False), flatten(self._micro)[0])
            finally:
                self.model.train(was)
            modules, writes = _stage_modules(self.model, c, self.stage_indices, self.num_stages, self.compiled,
                                             self._cut)
            for m, unit in zip(modules, st.units if self.fsdp else ()):  # the same FSDP unit per stage
                m.piece.unit = unit
                m.piece.bind(self.model)
            self._eval = (*self._runner(modules, train=False), modules, writes)
        return self._eval

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: the norm of every stage's gradients (a
        TP shard's the full gradient's; a weight tied across stages counted once), the same on every rank,
        and every rank's gradients scaled by the same factor. Returns the total norm."""
        params = list(self.parameters())
        skip = {id(p) for p, group in self._tied
                if dist.get_rank() != min(dist.get_process_group_ranks(group))}  # counted by its first holder
        grads = [p.grad for p in params if p.grad is not None and id(p) not in skip]
        device = tp_state(self.model).device
        local = torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.zeros((), device=device)
        if isinstance(local, DTensor):  # FSDP's gradients: the norm over this stage's tp and dp ranks
            local = local.full_tensor()
        local = local.detach().double()
        if math.isinf(norm_type):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.pp_group)
            total = local
        else:
            power = local ** norm_type
            dist.all_reduce(power, group=self.pp_group)
            total = power ** (1.0 / norm_type)
        total = total.float()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    @torch.no_grad()
    def eval_step(self, *args, **kwargs) -> torch.Tensor:
        """The loss of the whole batch, forward only (no gradients), on every rank, in eval mode (the model's
        graph captured under ``model.eval()``: dropout off), whatever mode the model is in."""
        if SCHEDULES[self.schedule_name].placement == "v":
            raise PipelineError(f"{self.schedule_name} cannot run forward only: torch's V schedules hand the "
                                "backward between a rank's two stages even in eval",
                                hint="evaluate with the training step's loss, or pipeline with Interleaved1F1B")
        inputs = self._inputs(args, kwargs)
        losses: list[torch.Tensor] = []
        index = torch.arange(self.microbatches, device=tp_state(self.model).device)
        stages, schedule, modules, writes = self._eval_runner()
        _clear_kept(modules)
        schedule.eval(target=index, losses=losses, **inputs)
        _reshard(self.modules)  # no backward frees what a forward kept gathered
        loss = self._loss(losses)
        self._write_back(writes, modules, args, kwargs, loss)
        return loss


def pipeline(model: nn.Module, *, example_inputs: object, microbatches: int, schedule: str = "1F1B",
             virtual_stages: int | None = None, split_points: list[str] | tuple[str, ...] | None = None,
             pp: int | None = None, tp: int | None = None, mesh: DeviceMesh | None = None,
             vocab_multiple: int = 1, device: torch.device | str | None = None,
             scaler: torch.amp.GradScaler | None = None, compile: bool | dict = False,
             sequence_parallel: bool = False, expert_parallel: bool = False,
             fsdp: bool | FSDPConfig = False, context_parallel: int | None = None) -> Pipeline:
    """Cut ``model`` into ``pp × virtual_stages`` pipeline stages, each sharded by autotp's TP plan, and return
    the :class:`Pipeline` that trains it.

    ``example_inputs``: a whole batch as each step will get it (the model's own call: inputs and targets,
    a tuple of args, a dict of kwargs, or ``(args, kwargs)``); the stages are captured at its micro-batch
    shapes. ``schedule``: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble or ZBVZeroBubble;
    ``virtual_stages`` default 1 (2 for the interleaved and V schedules). ``split_points``: the blocks that
    start stages 1, 2, ... (default: balanced by FLOPs). ``mesh``: a (pp, dp, tp) device mesh, default the
    rank grid's under ``autotp run``, else one made from ``pp`` and ``tp`` (dp the rest of the world).
    ``scaler``: fp16 training's ``torch.amp.GradScaler``: each step's backward starts from the scaled loss;
    the script's ``scaler.unscale_``, ``scaler.step`` and ``scaler.update`` stay as they are. ``compile``: each
    stage's piece runs under ``torch.compile`` (a dict: its options), as torchtitan compiles per stage.
    ``sequence_parallel``, ``expert_parallel``: as :func:`autotp.parallelize` (the hidden state crossing a cut
    is then s/t per tp rank). ``fsdp`` (True or an :class:`~autotp.distributed.data_parallel.FSDPConfig`):
    each stage is one FSDP2 unit over its data-parallel ranks instead of DDP. ``context_parallel``: every stage
    runs 1/cp of the sequence, as :func:`autotp.parallelize` runs it (the hidden state crossing a cut is the
    rank's chunk, b/m × s/cp × h); the ranks come from the mesh's ``cp`` dim (a (pp, dp, cp, tp) mesh), else
    the rank grid's under ``autotp run --cp``; default: the mesh's cp dim, else the launcher's. Each step sums
    the gradients of this rank's stages over the cp group once, after the schedule, in one all-reduce.

    The model keeps its class and names; its parameters become this rank's TP shards of its own stages
    (those of other ranks' stages go to the meta device), and calling it directly is refused.
    """
    mesh = _resolve_mesh(mesh, pp, tp)
    names = mesh.mesh_dim_names
    pp = mesh.size(names.index("pp"))
    args, kwargs = _split_example(example_inputs, model.forward)
    flat, in_spec = flatten((args, kwargs))
    asked = PipelineOptions(pp, schedule, microbatches, virtual_stages, tuple(split_points or ())).validate(
        _batch_size(flat))
    name, v = asked.schedule, asked.virtual_stages
    # what does not run together is refused before anything is captured or allocated (the one rule)
    cp = _context_size(mesh, context_parallel)
    Options(compile=compile, sequence_parallel=sequence_parallel, expert_parallel=expert_parallel,
            pipeline=StageRequest(asked.count), schedule=asked, stage_fsdp=bool(fsdp), context_parallel=cp).validate()
    kind = SCHEDULES[name]
    count = asked.count
    micro_args, micro_kwargs = unflatten(_microbatch(flat, microbatches), in_spec)
    request = StageRequest(count, tuple(split_points or ()))
    ranks = stage_ranks(pp, count, kind.placement)
    me = mesh.get_local_rank("pp")
    indices = [s for s in range(count) if ranks[s] == me]

    def mine(top: nn.Module) -> set[str]:  # what this rank's stages read: nothing else is allocated here
        return {n for s in indices for n in _reads(top, s)}

    # with cp the mesh gives both groups (its tp and cp dims): autotp.distributed.context.context_mesh
    groups = {"mesh": mesh} if cp > 1 and "cp" in names else {"tp_group": mesh.get_group("tp")}
    parallelize_state(model, example_inputs=(tuple(micro_args), dict(micro_kwargs)), **groups,
                      vocab_multiple=vocab_multiple, device=device, fsdp=False, pipeline=request, stage_params=mine,
                      sequence_parallel=sequence_parallel, expert_parallel=expert_parallel, stage_fsdp=bool(fsdp),
                      schedule=asked, context_parallel=cp)
    st = tp_state(model)
    key = call_key(args, kwargs, model.training)
    micro_key = call_key(tuple(micro_args), dict(micro_kwargs), model.training)
    captured = st.graphs[micro_key]
    if captured.cp_length is not None:  # the input the analysis found carrying the sequence: 2·cp chunks of it
        from autotp.plan.context_planner import check_chunks

        check_chunks(flatten((tuple(micro_args), dict(micro_kwargs)))[0][captured.cp_length[0]]
                     .shape[captured.cp_length[1]], cp)
    reads = [_reads(captured.module, s) for s in range(count)]
    if kind.placement == "v":
        _check_v_ties(dict(model.named_parameters(remove_duplicate=False)), reads, ranks, name)
    compiled = None if not compile else compile if isinstance(compile, dict) else {}
    b = _batch_size(flat)
    cut = {i for i, t in enumerate(flat) if t.dim() > 0 and t.shape[0] == b}  # what each step cuts into micro-batches
    modules, writes = _stage_modules(model, captured, indices, count, compiled, cut)
    config = FSDPConfig() if fsdp is True else fsdp or None
    if config is not None:  # each stage one FSDP unit; the stages then hold FSDP's parameters
        apply_stage_fsdp(model, st, modules, mesh, config)
    tied = _tied_groups(model, reads, ranks, me, mesh)
    return Pipeline(model, mesh, name, v, microbatches, key, modules, indices, count, tied,
                    (tuple(micro_args), dict(micro_kwargs)), scaler, compiled, config is not None, writes, cut)


def _context_size(mesh: DeviceMesh, asked: int | None) -> int:
    """The context-parallel size: ``asked``, else the mesh's cp dim, else ``autotp run --cp``'s (1: none)."""
    names = mesh.mesh_dim_names or ()
    if asked is None:
        if "cp" in names:
            return mesh.size(names.index("cp"))
        from autotp.distributed.rank_context import current_job

        job = current_job()  # under autotp's launchers: the job's --cp
        return 1 if job is None else job.grid.cp
    if "cp" in names and mesh.size(names.index("cp")) != asked:
        raise ProcessGroupError(f"context_parallel={asked}, and the mesh's cp dim has "
                                f"{mesh.size(names.index('cp'))} ranks")
    return asked


def _stage_modules(model: nn.Module, captured: Captured, indices: list[int] | tuple[int, ...],
                   count: int, compiled: dict | None = None,
                   cut: set[int] = frozenset()) -> tuple[list[StageModule], StageWrites | None]:
    """This rank's stages of a captured, split graph, each holding the parameters its piece reads and keeping
    the written state it computes; with ``compiled`` (torch.compile's options) each piece runs compiled.
    ``cut``: the flat inputs a step cuts into micro-batches. Also how the written state is written back."""
    loss = _loss_index(captured)
    wirings = wire_stages(captured.module, loss)
    owner = output_stages(captured.module, [w.results for w in wirings])
    writes = stage_writes(captured.module, captured.writes, loss, owner, set(cut))
    by_name = dict(model.named_parameters(remove_duplicate=False))
    outs = next(n for n in captured.module.graph.nodes if n.op == "output").args[0]
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    modules = [StageModule(captured.module, wirings[s], _unique([by_name[n] for n in _reads(captured.module, s)]),
                           s == count - 1, () if writes is None else tuple((i, outs[i].name) for i in writes.keep(s)))
               for s in indices]
    if compiled is not None:
        from autotp.operators.compile import compile_pieces

        for m in modules:
            compile_pieces(m.piece, **compiled)
    return modules, writes


class _Meta(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def _metas(values) -> list[_Meta]:
    values = values if isinstance(values, tuple) else (values,)
    return [_Meta(tuple(v.shape), v.dtype, v.requires_grad) for v in values]


def _example(m: _Meta, device: torch.device | str) -> torch.Tensor:
    t = torch.zeros(m.shape, dtype=m.dtype, device=device)
    return t.requires_grad_(m.requires_grad) if t.is_floating_point() else t


def _probe(model: nn.Module, mine: dict[int, StageModule], ranks: list[int], group: dist.ProcessGroup,
           inputs: dict[str, object], grad: bool = True) -> dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """The shapes, dtypes and requires_grad of what each of this rank's stages receives and returns: one
    forward of the first micro-batch through the stages in order, each rank sending the next the metadata of
    what it returns. ``PipelineStage`` then runs static (its own inference would run a backward too, which
    DDP's first-iteration bookkeeping counts). The random streams are restored afterwards."""
    st = tp_state(model)
    pp_ranks = dist.get_process_group_ranks(group)
    me = dist.get_group_rank(group, dist.get_rank())
    out: dict[int, tuple] = {}
    local: list[_Meta] = []
    region = st.rng.get_state() if st.rng is not None else None
    devices = [st.device] if st.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(grad):
        for s in sorted(mine):
            if s == 0:
                received: list[_Meta] = []
            elif ranks[s - 1] == me:
                received = local
            else:
                box: list = [None]
                dist.recv_object_list(box, src=pp_ranks[ranks[s - 1]], group=group, device=st.device)
                received = box[0]
            result = _metas(mine[s](*(_example(m, st.device) for m in received), **inputs))
            out[s] = (tuple(_example(m, "meta") for m in received), tuple(_example(m, "meta") for m in result))
            if s + 1 < len(ranks) and ranks[s + 1] != me:
                dist.send_object_list([result], dst=pp_ranks[ranks[s + 1]], group=group, device=st.device)
            local = result
    if region is not None:
        st.rng.set_state(region)
    return out


def _clear_kept(modules: list[StageModule]) -> None:
    for m in modules:
        m.kept.clear()


def _reshard(modules: list[StageModule]) -> None:
    """Every FSDP unit of ``modules`` back to its shards: a forward with no backward after it (the metadata
    probe, evaluation) leaves a unit kept gathered (``reshard_after_forward=False``) holding its unsharded
    parameters, which the optimizer must never be given and the next step must gather afresh."""
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()


def _reads(top: nn.Module, stage: int) -> list[str]:
    """The parameters stage ``stage``'s piece of the split graph ``top`` reads (names as the graph reads them)."""
    return [x for x in top.get_submodule(f"{STAGE_PREFIX}{stage}").inputs if isinstance(x, str)]


def _check_v_ties(by_name: dict[str, nn.Parameter], reads: list[list[str]], ranks: list[int], schedule: str) -> None:
    """A V schedule puts the first and the last stage on one rank: its split backward (inputs, then weights)
    computes a parameter read by two stages of one rank (an LM head tied to the embedding) wrong."""
    for a in range(len(reads)):
        for b in range(a + 1, len(reads)):
            if ranks[a] != ranks[b]:
                continue
            shared = {id(by_name[n]) for n in reads[a]} & {id(by_name[n]) for n in reads[b]}
            if shared:
                name = next(n for n in reads[a] if id(by_name[n]) in shared)
                raise PipelineError(f"{schedule} places stages {a} and {b} on pipeline rank {ranks[a]}, and both read "
                                    f"{name} (a tied weight): torch's zero-bubble weight pass gets a parameter "
                                    "shared by two stages of one rank wrong",
                                    hint="use InterleavedZeroBubble or Interleaved1F1B (the tied stages on "
                                         "different ranks), or untie the weight")


def _unique(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return list({id(p): p for p in params}.values())


def _tied_groups(model: nn.Module, reads: list[list[str]], ranks: list[int], me: int,
                 mesh: DeviceMesh) -> list[tuple[nn.Parameter, dist.ProcessGroup]]:
    """For each parameter this rank holds that stages on other pipeline ranks read too: the group of those
    ranks (same tp and dp coordinates), whose gradients are summed after each step."""
    names: dict[int, str] = {}
    by_id: dict[int, nn.Parameter] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
        by_id[id(p)] = p
    params = dict(model.named_parameters(remove_duplicate=False))
    where: dict[int, set[int]] = {}
    for s, names_read in enumerate(reads):
        for n in names_read:
            where.setdefault(id(params[n]), set()).add(ranks[s])
    pp_ranks = dist.get_process_group_ranks(mesh.get_group("pp"))
    out = []
    for pid in sorted((i for i, rs in where.items() if len(rs) > 1), key=lambda i: names[i]):
        members = sorted(where[pid])
        if me not in members:
            continue
        group = dist.new_group([pp_ranks[r] for r in members], use_local_synchronization=True)
        out.append((by_id[pid], group))
    return out


__all__ = ["Pipeline", "SCHEDULES", "check_pipeline", "pipeline", "stage_ranks"]
