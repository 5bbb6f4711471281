"""``autotp.parallelize``: shard the user's model in place and run rewritten graphs on the local shards.

Like ``fully_shard``, :func:`parallelize` changes the model object itself and returns it: its class becomes
a subclass of its own class (so ``isinstance``, attributes, methods and the submodule tree stay) whose
``forward`` runs the rewritten graph of the call; parameters become this rank's shards under their original
names (ties kept: one Parameter per original Parameter). Each distinct call signature (input structure,
dtypes, train/eval) is captured once from the model's own forward, planned and rewritten
(:mod:`autotp.parallel.rewrite`) and cached; every cached graph reads the same Parameters. This is where the
rank enters: weights are sliced for it (:mod:`autotp.parallel.shard`) and collectives are bound to its group.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from autotp.capture.preserve import preserved
from autotp.capture.source_lines import source_lines_released
from autotp.capture.tracer import stand_ins
from autotp.capture.values import checks_hold
from autotp.capture.structure import call_key, flatten, unflatten
from autotp.parallel.data import check_same_inputs
from autotp.io.empty import check_materialized
from autotp.capture.modelfile import default_example as _default_example
from autotp.errors import ProcessGroupError, ShardingError
from autotp.operators.gathered import GatheredOnUse, local_outputs
from autotp.distributed.data_parallel import FSDPConfig
from autotp.distributed.replicas import AUTOTP_DDP, FSDP, NONE, OFF, PIPELINE, Replicas
from autotp.parallel.writeback import state_matches, write_back
from autotp.parallel.apply import apply
from autotp.parallel.fsdp import fsdp_hooks_off
from autotp.parallel.planning import How, PlanCache, capture_and_plan, job_of
from autotp.parallel.reuse import plan_cache_for
from autotp.parallel.rewrite import warn_plan
from autotp.parallel.shard import hold
from autotp.plan.plan import Plan, ShardedInput
from autotp.plan.stages import StageRequest
from autotp.operators.rng import CONTEXT_SEED_OFFSET, SEED_OFFSET, RegionRNG
from autotp.shard_spec import shard_tensor
from autotp.options import Options, PipelineOptions
from autotp.plan.context_planner import ContextRefused, check_chunks
from autotp.distributed.context import context_mesh
from autotp.distributed.job import RankJob
from autotp.distributed.rank_grid import MESH_TP
from autotp.distributed.rank_context import RankContext, current_context, current_job
from autotp.state import Captured, RankIdentity, TPState, attach_state, find_tp_state, tp_state


def _split_example(example_inputs, forward: Callable) -> tuple[tuple, dict]:
    if example_inputs is None:
        return _default_example(forward)
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, tuple) and len(example_inputs) == 2 and isinstance(example_inputs[1], Mapping) \
            and isinstance(example_inputs[0], (tuple, list)):
        return tuple(example_inputs[0]), dict(example_inputs[1])
    return tuple(example_inputs), {}


def _tensor_parallel(mesh: DeviceMesh | None, tp_group: dist.ProcessGroup | None,
                     ctx: RankContext | None) -> tuple[dist.ProcessGroup, int, int]:
    """(the tensor-parallel group, its size tp, this rank's index in it), each read once: the ``mesh``'s tp dim,
    else the group the caller gave, else the job's (autotp's launchers: the tp dim of its one mesh, tp the job's
    int), else the whole default process group."""
    if mesh is not None:
        names = mesh.mesh_dim_names or ()
        if MESH_TP not in names:
            raise ProcessGroupError(f"the device mesh has dims {names or 'without names'}, and parallelize takes "
                                    "the tensor-parallel group from its 'tp' dim",
                                    hint="build it with init_device_mesh(device, (dp, tp), "
                                         "mesh_dim_names=('dp', 'tp'))")
        return mesh.get_group(MESH_TP), mesh.size(names.index(MESH_TP)), mesh.get_local_rank(MESH_TP)
    if tp_group is not None:
        return tp_group, dist.get_world_size(tp_group), dist.get_rank(tp_group)
    if ctx is not None:
        return ctx.tp_group(), ctx.grid.tp, ctx.coords[MESH_TP]
    if not (dist.is_available() and dist.is_initialized()):
        raise ProcessGroupError(
            "autotp.parallelize needs a process group, and none is initialised",
            hint="start the script with `autotp run train.py --tp 2` (it starts the ranks and their process "
                 "groups), or call torch.distributed.init_process_group('gloo' on CPU, 'nccl' on GPU) first under "
                 "`torchrun --nproc-per-node 2 train.py`; a group of size 1 is valid and runs unsharded",
        )
    return dist.group.WORLD, dist.get_world_size(), dist.get_rank()


def _fsdp_config(fsdp: bool | FSDPConfig | None, job: RankJob | None) -> FSDPConfig | None:
    if fsdp is None:  # under `autotp run --fsdp`: the launcher's choice
        return None if job is None or job.fsdp is None else FSDPConfig(replicas=job.fsdp)
    return FSDPConfig() if fsdp is True else fsdp or None


def _resolve_mesh(mesh: DeviceMesh | None, config: FSDPConfig | None, tp_group: dist.ProcessGroup | None,
                  ctx: RankContext | None) -> DeviceMesh | None:
    if mesh is not None and tp_group is not None:
        raise ProcessGroupError("pass either mesh or tp_group, not both: the mesh's 'tp' dim is the group")
    if mesh is not None or config is None:
        return mesh
    found = None if ctx is None else ctx.mesh  # under autotp's launchers: the job's (pp, dp, [cp,] tp) mesh
    if found is None:
        raise ProcessGroupError(
            "fsdp=True needs a device mesh of the data-parallel and tensor-parallel ranks, and none was given",
            hint="pass mesh=torch.distributed.device_mesh.init_device_mesh(device, (dp, tp), "
                 "mesh_dim_names=('dp', 'tp')), or start the script with `autotp run SCRIPT --tp T --dp D`")
    return found


class TPModule(nn.Module):
    """Mixin placed in front of the user's class by :func:`parallelize`; only ``forward`` is replaced."""

    def forward(self, *args, **kwargs):
        c, flat, engine = _dispatch(self, args, kwargs, torch.compiler.is_compiling())
        # under the user's torch.compile: the graph it compiles
        return _outputs(c, (c.call or c.module)(*flat), engine, self)


@torch.compiler.disable
def _outputs(c: Captured, flat: tuple, engine: DistributedDataParallel | None = None,
             model: nn.Module | None = None) -> object:
    """The forward's output rebuilt around the graph's flat results, gathered-on-use ones wrapped here; with
    data parallelism it reaches the DDP engine (whose reducer then expects this call's backward)."""
    if c.wrap:
        flat = list(flat)
        for i, module in c.wrap:
            flat[i] = module(flat[i])
    if c.writes and model is not None:  # what the forward writes on the model, written as one device does
        st = tp_state(model)
        write_back(model, c.writes, flat, [g.module for g in st.graphs.values()], st.warned)
    return Replicas.after(engine, unflatten(flat, c.out))


@torch.compiler.disable
def _dispatch(model: nn.Module, args: tuple, kwargs: dict,
              compiling: bool = False) -> tuple[Captured, list[torch.Tensor], DistributedDataParallel | None]:
    """The graph for this call, its flat inputs (local shards where the graph takes them) and the DDP engine
    averaging its gradients over the data-parallel ranks (None: no data parallelism, or the script's own DDP).

    Never traced by dynamo: under the user's ``torch.compile(model)`` this runs eagerly (the key, the input
    check, a capture on a new signature), and dynamo compiles what follows, the rewritten graph itself:
    ``compiling`` (the forward is being traced) gives an eager graph its compiler's form first."""
    st = tp_state(model)
    if st.options.pipeline is not None:
        raise ShardingError(f"{type(model).__name__} is cut into pipeline stages: this rank holds only its own "
                            "stages' parameters, so the whole forward cannot run here",
                            hint="train with pipe.step(...) and evaluate with pipe.eval_step(...) of the "
                                 "autotp.pipeline(...) that cut it")
    if st.unloaded:
        check_materialized(st.unloaded)
    key = call_key(args, kwargs, model.training)
    if (st.tp > 1 or st.cp > 1) and (st.options.check_inputs or key not in st.checked):
        for group in (g for g, n in ((st.group, st.tp), (st.cp_group, st.cp)) if n > 1):
            check_same_inputs(args, kwargs, group)  # before any rank computes with them
        st.checked.add(key)
    flat = flatten((args, kwargs))[0]
    # a signature found not to run on chunks is not captured again to find that out (a sampling loop calls it
    # once per token)
    why = None if torch.is_grad_enabled() else st.unchunked.get(key)
    if why is None:
        try:
            c = _graph_for(model, st, args, kwargs, key, flat)
        except ContextRefused as refused:  # cannot run on chunks (a sampling loop's last-position logits)
            if torch.is_grad_enabled():
                raise
            why = st.unchunked[key] = str(refused).splitlines()[-1].strip()
    if why is not None:
        c = _whole_context(model, st, args, kwargs, key, flat, why)
    if c.cp_length is not None and (length := flat[c.cp_length[0]].shape[c.cp_length[1]]) % (2 * st.cp):
        if torch.is_grad_enabled():  # a training call: refused, naming the numbers
            check_chunks(length, st.cp)
        c = _whole_context(model, st, args, kwargs, key, flat, f"sequence length {length} is not divisible by "
                                                               f"2·cp = {2 * st.cp}")
    if c.seq_length is not None and (length := flat[c.seq_length[0]].shape[c.seq_length[1]]) % \
            (split := sequence_divisor(st.tp, st.cp if c.cp_length is not None else 1)):
        c = _whole_sequence(model, st, args, kwargs, key, flat, length, split)
    for i, s in c.local_inputs:
        flat[i] = _local_input(flat[i], s, st)
    if compiling and not c.local:
        c = _for_compiler(st, c)
    engine = st.replicas.before(model, model.parameters) if st.replicas is not None else None
    return c, flat, engine


def _for_compiler(st: TPState, c: Captured) -> Captured:
    """An eager graph as a compiler traces it: a copy returning its gathered-on-use outputs as local tensors,
    wrapped after the traced call (:func:`~autotp.operators.gathered.local_outputs`). Made on the first traced
    call, not at capture: an eager model would otherwise keep a second copy of every graph it never uses."""
    call, wrap = local_outputs(c.module)
    local = dataclasses.replace(c, call=call if wrap else None, wrap=tuple(wrap.items()), local=True)
    for key, known in list(st.graphs.items()):
        if known is c:
            st.graphs[key] = local
    return local


_MANY_STATES = 8  # graphs of one call signature past which a state the forward keeps changing is said


def _graph_for(model: nn.Module, st: TPState, args: tuple, kwargs: dict, key: Hashable, flat: list[torch.Tensor],
               sequence_parallel: bool | None = None, context: bool = True) -> Captured:
    """The graph of this call signature whose guards take ``flat``; captured when none does yet.

    The key leaves sizes other than 0 and 1 dynamic, but export may tell sizes of one signature apart and
    guard each graph to its own: with a causal mask buffer sliced to the sequence, the graph captured at
    T < block_size rejects T == block_size, which a sampling loop reaches as its context grows. Such a call
    gets a graph of its own, cached beside the first as ``(key, "guards", n)``.
    """
    variant, n = key, 0
    while (c := st.graphs.get(variant)) is not None:
        if (c.accepts is None or c.accepts(flat)) and state_matches(model, c.state) \
                and checks_hold(model, c.checks, st.shards):
            return c
        n += 1
        variant = (key, "guards", n)
    if n == _MANY_STATES and st.written and ("writes", "many") not in st.warned:
        st.warned.add(("writes", "many"))
        pieces = ", ".join(".".join(p for p in at[:2] if p) for at in list(st.written)[:4])
        warnings.warn(f"autotp: one call signature captured {n + 1} times: the state the forward writes ({pieces}) "
                      "keeps changing (a counter?), and each new value is captured once", stacklevel=4)
    with source_lines_released():  # the files its stack traces read are not kept
        return _build(model, st, args, kwargs, variant, sequence_parallel=sequence_parallel, context=context)


def sequence_divisor(tp: int, cp: int) -> int:
    """What a call's sequence length must be a multiple of for sequence parallelism to split it: each tp rank
    takes 1/tp of what its rank runs, the whole sequence, or with context parallelism (``cp`` > 1, the call run
    on chunks) its cp chunk of s/cp: (b, s/(cp·tp), h) per rank, so tp·cp."""
    return tp * cp


def _whole_sequence(model: nn.Module, st: TPState, args: tuple, kwargs: dict, key: Hashable,
                    flat: list[torch.Tensor], length: int, split: int) -> Captured:
    """A call whose sequence length tp (tp·cp, run on cp chunks) does not divide runs a plan without sequence
    parallelism (same numbers, plain tensor parallelism's collectives), captured once for the signature."""
    whole = (key, "whole sequence")
    if whole not in st.graphs:
        by = f"tp·cp = {split} (tp {st.tp} × cp {split // st.tp})" if split != st.tp else f"tp={st.tp}"
        warnings.warn(f"autotp: sequence length {length} is not divisible by {by}: calls like this one run "
                      "without sequence parallelism (plain tensor parallelism, the same numbers)", stacklevel=3)
    return _graph_for(model, st, args, kwargs, whole, flat, sequence_parallel=False)


def _whole_context(model: nn.Module, st: TPState, args: tuple, kwargs: dict, key: Hashable,
                   flat: list[torch.Tensor], why: str) -> Captured:
    """A call without gradients that cannot run on chunks (a sampling loop: its growing context's lengths,
    the last position's logits) runs the whole sequence on every cp rank: the same numbers, no ring;
    captured once for the signature. With gradients such a call is refused, naming what stops it."""
    whole = (key, "whole context")
    if whole not in st.graphs:
        _say_whole(st, why, 4)
    return _graph_for(model, st, args, kwargs, whole, flat, context=False)


def _say_whole(st: TPState, why: str, stacklevel: int) -> None:
    """Say once per reason that calls without gradients run the whole sequence on every cp rank."""
    if ("whole context", why) not in st.warned:
        st.warned.add(("whole context", why))
        warnings.warn(f"autotp: context parallelism: {why}: calls like this one without gradients run the whole "
                      "sequence on every cp rank (the same numbers, no ring)", stacklevel=stacklevel)


def _local_input(x: torch.Tensor, s: ShardedInput, st: TPState) -> torch.Tensor:
    """This rank's shard of an input the graph takes locally: a value this model returned gathered-on-use
    passes its shard (no communication); a full tensor is sliced."""
    if isinstance(x, GatheredOnUse):
        local = x.to_local()
        if local.shape[s.dim] == sum(g.local() for g in s.segments):
            return local
        x = x.full_tensor()
    return shard_tensor(x, s.dim, s.segments, st.tp, st.rank)


def _user_forward(model: nn.Module, st: TPState) -> Callable:
    return st.forward if st.forward is not None else st.base.forward.__get__(model)


def _build(model: nn.Module, st: TPState, args: tuple, kwargs: dict, key: Hashable,
           sequence_parallel: bool | None = None, context: bool = True,
           cache: PlanCache | None = None) -> Captured | None:
    """Capture and plan this call signature for this rank's job, then rewrite, cut, shard, bind and compile it
    (the steps of :data:`autotp.parallel.apply.APPLY_ORDER`, in that order); None where ``cache`` held the
    plan: the model is sharded by it and nothing is captured."""
    swap = None
    # built on meta (autotp.empty_weights): no weights allocated yet
    empty = {n: p for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta}
    fresh = [n for n in empty if n not in st.dropped]  # not the other stages' parameters a pipeline dropped
    if st.full or empty:
        # the model holds shards (or no weights) now: export sees full-size stand-ins for them; on the CPU
        # unless some buffer has no values (a model built wholly on meta)
        on_cpu = st.device.type == "cpu" and not any(b.is_meta for b in model.buffers())
        where = st.device if on_cpu else torch.device("meta")
        swap = stand_ins({**empty, **st.full}, where)  # full-size: a dropped shard's too
        if where.type == "meta":
            swap.update(stand_ins({n: t for n, t in model.named_parameters(remove_duplicate=False)
                                   if n not in swap}, where))
            swap.update(stand_ins(dict(model.named_buffers(remove_duplicate=False)), where))
    # once FSDP shards the model, its hooks would gather parameters inside the export: it sees stand-ins
    hooks_off = fsdp_hooks_off(model) if st.units is not None else contextlib.nullcontext()
    # a later signature of a pipeline runs the first one's stages
    job = job_of(st.tp, st.options, sequence_parallel=sequence_parallel, context=context,
                 stages_of=st.plan.stages if st.graphs and st.options.pipeline is not None else ())
    how = How(_user_forward(model, st), swap, st.device,
              static=st.options.pipeline is not None and not st.options.sequence_parallel and st.cp == 1,
              writes=True)
    # a later signature plans the exported blocks alone where it can: its cuts are checked against the first's
    blocks, segments = bool(st.shards), st.tp == 1 and not st.graphs
    with hooks_off:
        planned = capture_and_plan(model, args, kwargs, job, cache, how=how, blocks=blocks, segments=segments)
    if planned.cached:
        _shard_from(model, st, planned.plan, str(planned.path))
        return None
    return apply(model, st, planned, key, fresh)  # the steps after planning, in their one order


def _shard_from(model: nn.Module, st: TPState, plan: Plan, path: str) -> None:
    """Shard (or allocate) the parameters and buffers as a cached plan says, capturing nothing: the first
    call captures its signature and is checked against this plan (:mod:`autotp.parallel.reuse`)."""
    warn_plan(st, plan)
    st.cached, st.cached_from = plan, path
    hold(model, st, plan, [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta])


def _swap_class(model: nn.Module) -> None:
    base = type(model)
    cls = type(base.__name__, (TPModule, base), {"__module__": base.__module__, "__qualname__": base.__qualname__})
    if hasattr(base, "save_pretrained"):
        from autotp.io.checkpoint import save_pretrained_full

        cls.save_pretrained = save_pretrained_full
    model.__class__ = cls


def _device(model: nn.Module, group: dist.ProcessGroup, device: torch.device | str | None) -> torch.device:
    """Where the model's tensors live; for a model built on meta, where its shards are allocated: ``device``,
    else this rank's GPU when the group runs on nccl, else the CPU."""
    first = next(iter([*model.parameters(), *model.buffers()]), None)
    if first is not None and not first.is_meta:
        return first.device
    if device is not None:
        return torch.device(device)
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def parallelize(model: nn.Module, *, tp_group: dist.ProcessGroup | None = None, example_inputs: object = None,
                vocab_multiple: int = 1, compile: bool | dict = False, check_inputs: bool = False,
                sequence_parallel: bool = False, expert_parallel: bool = False,
                device: torch.device | str | None = None, fsdp: bool | FSDPConfig | None = None,
                mesh: DeviceMesh | None = None, context_parallel: int | None = None,
                data_parallel: bool | dict = True) -> nn.Module:
    """Shard ``model`` Megatron-style over ``tp_group``, in place, and return it.

    The model keeps its class (a subclass of it is swapped in), attributes and methods; its parameters
    become this rank's shards under their original names, and its ``forward`` runs the rewritten graph.
    ``tp_group``: default the rank grid's tensor-parallel group under ``autotp run``, else the whole default
    process group. ``example_inputs``: positional args as a tuple, keyword args as a dict, or
    ``(args, kwargs)``; only shapes and dtypes matter (capture computes nothing). Default: a (2, 8) batch
    of token ids. Other call structures are captured and rewritten on first use and share the parameters.

    Vocab-parallel logits come back as the full tensor, gathered over the group only when something reads
    them, so a step that only uses the loss moves no b·s·V data. ``vocab_multiple`` rounds each rank's
    vocab rows up (e.g. 64 for tensor-core-friendly GEMMs on GPUs); the default pads only to ``ceil(V / tp)``.
    ``compile=True`` runs each rewritten graph under ``torch.compile`` (see :mod:`autotp.operators.compile`);
    a dict instead of True is passed to ``torch.compile`` as its options (``{"backend": "aot_eager"}``).
    ``sequence_parallel=True`` splits the code between the column→row pairs (norms, dropout, residual
    adds) along the sequence (Megatron-SP): reduce-scatter and all-gather in place of the all-reduces, the
    activations there 1/tp the size; a call whose sequence length tp does not divide runs without it.
    ``expert_parallel=True`` places E/tp whole experts of each mixture-of-experts layer on every rank, instead
    of 1/tp of every expert: a rank computes only the tokens routed to its own experts, with the layer's one
    all-reduce unchanged (the tokens are on every rank of the group, so none are dispatched).
    ``check_inputs=True`` verifies on every call (not only the first of each signature) that all ranks of
    the group got the same inputs.

    At tp > 1 without FSDP or pipeline stages the plan is first looked up in autotp's plan cache: a
    restarted job shards its parameters from the plan its first run stored and captures nothing until the
    model's first call, which is checked against that plan (:mod:`autotp.parallel.reuse`;
    ``AUTOTP_PLAN_CACHE=0`` turns it off).

    ``fsdp=True`` (or an :class:`~autotp.distributed.data_parallel.FSDPConfig`) also shards every
    parameter's TP shard over the data-parallel ranks with FSDP2 (``fully_shard``), one unit per repeated
    block found in the graph, one for the embeddings and one for the final norm with the LM head, the root
    keeping the rest (a tied embedding): each unit's parameters are gathered just before it runs and its
    gradients reduce-scattered when its backward ends. The parameters
    become DTensors over the mesh (``clip_grad_norm_`` gives the full model's norm); build the optimizer
    after this call. Default: what ``autotp run --fsdp [--hsdp GROUPS]`` asked for, else no FSDP. ``mesh``: a
    device mesh with ``dp`` and ``tp`` dims (tp innermost), default the rank grid's under ``autotp run``; its
    ``tp`` dim is the tensor-parallel group.

    Without FSDP, where the ranks hold data-parallel replicas (``autotp run --dp D`` with no ``tp_group``
    given, or a ``mesh`` with a ``dp`` dim of more than one rank), the gradients are averaged over the
    data-parallel group by torch's DDP (``data_parallel=True``, the default): bucketed, each bucket all-reduced
    as soon as the backward has made it, a rank's gradient bytes over dp once per step and nothing over tp for
    them (see :mod:`autotp.distributed.replicas`). It is driven from the model's own forward (the model stays
    the user's object, no wrapper) and made at the first call with gradients, broadcasting dp rank 0's
    parameters. A script that wraps the model in its own ``DistributedDataParallel`` over the dp group keeps
    working: that DDP is found at its first call and left to average, once; one over ranks that hold different
    tensor-parallel shards (the whole job) is refused there. ``data_parallel``: a dict of
    ``DistributedDataParallel``'s keyword arguments (``{"find_unused_parameters": True}`` for parameters the
    loss does not reach, ``bucket_cap_mb``), or False when the script averages the gradients itself.

    ``context_parallel=cp`` runs every op on 1/cp of the sequence (context parallelism): each of cp ranks takes
    chunks r and 2·cp−1−r of the sequence (causal attention's work balanced), attention exchanges keys and
    values around the group (torch's ring attention), positions are the chunk's global ones, a cross-entropy's
    mean is taken over every counted token of the group, and outputs that carry the sequence come back whole;
    parameter gradients are summed over the group in the backward (one all-reduce; with ``fsdp``, FSDP shards
    over the dp and cp dims together and its reduce-scatter sums them, averaging over dp only). Dropout on a
    chunk draws from the chunk's own stream. A forward that mixes
    positions other than in attention (a cumulative sum, a causal convolution) is refused naming the op.
    The groups: ``mesh``'s ``cp`` dim when it has one, else the rank grid's under ``autotp run --cp`` (also the
    default cp there), else the world cut into groups of cp consecutive ranks (the other ranks
    data-parallel). Every sequence length must be a multiple of 2·cp.

    A model built on the meta device (inside :func:`autotp.empty_weights`, see :mod:`autotp.io.empty`) is
    planned on meta; only this rank's shards and the replicated parameters are allocated, uninitialised,
    on ``device`` (default: this rank's GPU under nccl, else the CPU), for :func:`autotp.load_weights`.
    """
    return parallelize_state(model, tp_group=tp_group, example_inputs=example_inputs, vocab_multiple=vocab_multiple,
                             compile=compile, check_inputs=check_inputs, sequence_parallel=sequence_parallel,
                             expert_parallel=expert_parallel, device=device, fsdp=fsdp, mesh=mesh,
                             context_parallel=context_parallel, data_parallel=data_parallel)


def parallelize_state(model: nn.Module, *, tp_group: dist.ProcessGroup | None = None, example_inputs: object = None,
                      vocab_multiple: int = 1, compile: bool | dict = False, check_inputs: bool = False,
                      sequence_parallel: bool = False, expert_parallel: bool = False,
                      device: torch.device | str | None = None, fsdp: bool | FSDPConfig | None = None,
                      mesh: DeviceMesh | None = None, pipeline: StageRequest | None = None,
                      stage_params: Callable[[fx.GraphModule], set[str]] | None = None,
                      stage_fsdp: bool = False, schedule: PipelineOptions | None = None,
                      context_parallel: int | None = None, data_parallel: bool | dict = True,
                      plan_cache: Path | str | None = None) -> nn.Module:
    """:func:`parallelize`, and for :func:`autotp.parallel.pipeline.pipeline` every graph cut into the
    stages ``pipeline`` asks for (captured with static shapes); ``stage_params`` names the parameters this
    rank's stages of the first split graph read: no other parameter is allocated or sliced here;
    ``stage_fsdp``: the pipeline makes its stages FSDP units afterwards; ``schedule``: how they run;
    ``plan_cache``: a job's own plan cache folder (``autotp shard``'s, where its check stored the plan), used
    whatever ``AUTOTP_PLAN_CACHE`` says."""
    if (known := find_tp_state(model)) is not None:
        raise ShardingError(f"{type(model).__name__} is already parallelized (tp={known.tp})")
    # under autotp's launchers the job's sizes, read once (its kept rank context's, else the one handed to this
    # process); None under torchrun or a script's own groups
    job = current_job()
    config = _fsdp_config(fsdp, job)
    if context_parallel is None:  # under `--cp`: the launcher's choice
        context_parallel = 1 if job is None else job.grid.cp
    options = Options(vocab_multiple, compile, check_inputs, sequence_parallel, expert_parallel, config, pipeline,
                      schedule, whole_kv_copies=config is not None or stage_fsdp, stage_fsdp=stage_fsdp,
                      context_parallel=context_parallel, data_parallel=data_parallel).validate()
    # the job's one mesh, where a group is taken from it (none given, or its cp group, or FSDP's mesh): made now
    # if the script has not made it (collective: every rank reaches parallelize)
    needs_job = mesh is None and (tp_group is None or options.context_parallel > 1 or config is not None)
    ctx = current_context() if job is not None and needs_job else None
    given_mesh, given_group = mesh, tp_group  # where the data-parallel group comes from (_replicas)
    cp_group = context_dp = None
    if options.context_parallel > 1 and config is not None:  # FSDP shards over the dp and cp dims of the mesh
        mesh = _resolve_mesh(mesh, config, tp_group, ctx)
        cp_group = context_mesh(mesh, None, options.context_parallel, ctx).cp
        tp_group = None  # the mesh's tp dim
    elif options.context_parallel > 1:  # the groups from a mesh with a cp dim: tp's is its tp dim
        tp_group, cp_group, context_dp = context_mesh(mesh, tp_group, options.context_parallel, ctx)
        mesh = None
    mesh = _resolve_mesh(mesh, config, tp_group, ctx)
    group, tp, rank = _tensor_parallel(mesh, tp_group, ctx)
    device = _device(model, group, device)
    # random ops' streams (autotp.operators.rng): a sharded region's per (tp, cp) rank; a chunk's per cp rank
    cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0
    seed = torch.initial_seed()
    rng = RegionRNG(seed + SEED_OFFSET + rank + tp * cp_rank, device) if tp > 1 else None
    context_rng = RegionRNG(seed + CONTEXT_SEED_OFFSET + cp_rank, device) if cp_group is not None else None
    st = TPState(RankIdentity(group, tp, rank, device, mesh, cp_group, options.context_parallel), options,
                 type(model), model.__dict__.get("forward"), rng, stage_params, context_rng=context_rng,
                 replicas=_replicas(options, given_mesh, given_group, group, device, ctx, context_dp))
    args, kwargs = _split_example(example_inputs, _user_forward(model, st))
    training = model.training
    # a failure leaves the model exactly as it was (class, tensors); the process keeps no source file capture read
    with preserved(model, on_failure_only=True), source_lines_released():
        _swap_class(model)
        model.__dict__.pop("forward", None)
        attach_state(model, st)
        # a plan the cache holds shards the model here, and nothing is captured until its first call
        _first(model, st, args, kwargs, training, example_inputs is None,
               plan_cache_for(job_of(st.tp, st.options), plan_cache))
    return model


def _replicas(options: Options, mesh: DeviceMesh | None, tp_group: dist.ProcessGroup | None,
              group: dist.ProcessGroup, device: torch.device, ctx: RankContext | None = None,
              context_dp: dist.ProcessGroup | None = None) -> Replicas:
    """Which data parallelism the model runs: the pipeline's or FSDP's where they run, else autotp's DDP over
    the data-parallel group of ``mesh`` (its 'dp' dim) or, with neither a mesh nor a tp group given, of the
    job's mesh (``ctx``, autotp's launchers), else of the world :func:`context_mesh` cut into cp groups
    (``context_dp``); none where no such group has more than one rank (or ``data_parallel=False``)."""
    if options.pipeline is not None:
        return Replicas(PIPELINE, shards=group)
    if options.fsdp is not None or options.stage_fsdp:
        return Replicas(FSDP, shards=group)
    if mesh is not None:
        dp = mesh["dp"].get_group() if "dp" in (mesh.mesh_dim_names or ()) else None
    elif tp_group is None:
        dp = ctx.dp_group() if ctx is not None and ctx.grid.dp > 1 else context_dp
    else:
        dp = None
    if dp is None or dist.get_world_size(dp) == 1:
        return Replicas(NONE, shards=group)
    if options.data_parallel is False:
        return Replicas(OFF, dp, group)
    ddp = options.data_parallel if isinstance(options.data_parallel, dict) else {}
    return Replicas(AUTOTP_DDP, dp, group, dict(ddp), device)


def _first(model: nn.Module, st: TPState, args: tuple, kwargs: dict, training: bool, default: bool,
           cache: PlanCache | None) -> None:
    """Capture and shard by the first signature: the example's, or with none given the forward's default
    inputs; or shard by the plan ``cache`` holds for it. With context parallelism a default signature that
    cannot run on chunks (a forward without targets returns the last position's logits) runs whole, said
    once: each call is planned for its own signature, and a training call that cannot run on chunks is
    refused then, naming the op."""
    key = call_key(args, kwargs, training)
    try:
        _build(model, st, args, kwargs, key, cache=cache)
    except ContextRefused as refused:
        if not default:
            raise
        _say_whole(st, str(refused).splitlines()[-1].strip(), 5)  # a call with targets still runs on chunks
        _build(model, st, args, kwargs, (key, "whole context"), context=False)
