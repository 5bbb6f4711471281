"""FSDP2 over the data-parallel ranks, composed with autotp's tensor parallelism inside each TP group.

:func:`apply_fsdp` runs once, after the model holds its tensor-parallel shards:

1. every parameter becomes a DTensor over the mesh's ``tp`` dim: ``Shard(dim)`` for a sharded one (its
   local tensor is this rank's shard, fused segments and padded vocab rows included: the global view is the
   shards side by side), ``Replicate()`` for one every TP rank holds whole. FSDP then shards dim 0 of each
   local shard over the data-parallel ranks, and a norm of the gradients (``clip_grad_norm_``) is the full
   model's, over both dims;
2. ``fully_shard`` each unit the plan names, in the order they run (the embeddings, each repeated block, the
   final norm with the LM head), then the root (whatever no unit owns: an LM head tied to the embedding),
   with the configured mixed precision, resharding, prefetching and offload;
3. each unit's FSDP forward method is registered (``register_fsdp_forward_method``): the rewritten graph,
   split at the units (:func:`autotp.passes.split_units`), runs each block's piece through it, so FSDP
   gathers the block's parameters just before the piece and reduce-scatters its gradients when the
   piece's backward ends.
"""
from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                    register_fsdp_forward_method)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autotp.distributed.data_parallel import FSDPConfig, fsdp_meshes
from autotp.errors import ShardingError
from autotp.io.checkpoint import reshard
from autotp.io.empty import swap_tensors
from autotp.plan.plan import Plan
from autotp.operators.pieces import UNIT_METHOD, PieceCall, run_unit
from autotp.state import TPState


def _free_root_without_backward(model: nn.Module, args, output) -> None:
    """FSDP keeps the root's (and the last unit's) gathered parameters for the backward; a call with
    gradients off (evaluation, sampling) has none, so they are freed at once and ``model.parameters()`` are
    the shards again."""
    if not torch.is_grad_enabled():
        reshard(model)


def _on_tp_mesh(model: nn.Module, st: TPState, tp_mesh: DeviceMesh) -> None:
    """Every allocated parameter of ``model`` as a DTensor over ``tp_mesh`` (``Shard(dim)`` for a TP shard,
    ``Replicate()`` for a whole one), and a full-size stand-in of each in ``st.full`` for later captures."""
    names: dict[int, str] = {}
    stand_in: dict[int, nn.Parameter] = {}  # one per tensor: later captures must see ties as ties
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
        # later captures see full-size stand-ins of every parameter: FSDP's are DTensors
        if id(p) not in stand_in:
            known = st.full.get(name)  # a sharded parameter's full-size stand-in, made when it was cut
            stand_in[id(p)] = known if known is not None else nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
        st.full.setdefault(name, stand_in[id(p)])

    def on_tp_mesh(p: torch.Tensor) -> nn.Parameter | None:
        if p.is_meta:  # another pipeline rank's stage: never allocated here
            return None
        shard = st.shards.get(names[id(p)])
        placement = Shard(shard.dim) if shard is not None else Replicate()
        local = p.detach().contiguous()
        return nn.Parameter(DTensor.from_local(local, tp_mesh, [placement], run_check=False),
                            requires_grad=p.requires_grad)

    swap_tensors(model, "parameters", on_tp_mesh)


def _fsdp_options(config: FSDPConfig, dp_mesh: DeviceMesh, pipelined: bool) -> dict:
    return dict(mesh=dp_mesh, reshard_after_forward=config.resharded(pipelined),
                mp_policy=MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype),
                offload_policy=CPUOffloadPolicy(pin_memory=False) if config.offload else OffloadPolicy())


def apply_fsdp(model: nn.Module, st: TPState, plan: Plan) -> None:
    """Shard ``model`` (holding its TP shards) over the data-parallel ranks with FSDP2, unit by unit."""
    config = st.options.fsdp
    dp_mesh, tp_mesh = fsdp_meshes(st.mesh, config)
    _on_tp_mesh(model, st, tp_mesh)
    options = _fsdp_options(config, dp_mesh, pipelined=False)
    units = []
    for u in plan.units:  # in the order they run: the embeddings, the blocks, the final norm and LM head
        members = [model.get_submodule(m) for m in u.members]
        # the last unit's backward starts as soon as its forward ends: keep it gathered (torchtitan does)
        keep = u.kind == "last" and options["reshard_after_forward"]
        fully_shard(members if len(members) > 1 else members[0],
                    **{**options, "reshard_after_forward": False} if keep else options)
        unit = members[0]  # the unit's FSDP forward method runs the graph's piece (a group shares one state)
        unit.__dict__[UNIT_METHOD] = types.MethodType(run_unit, unit)
        register_fsdp_forward_method(unit, UNIT_METHOD)
        units.append(unit)
    # the root's parameters (a tied embedding / LM head, code between the blocks) are the first the backward
    # needs: FSDP's default keeps them
    fully_shard(model, **{**options, "reshard_after_forward": None})
    if st.cp > 1:  # a cp group's gradients are parts of the same samples': summed over cp, averaged over dp
        # no PREMUL_SUM: a sum, then the division (HSDP's mesh has two dims, both on one backend)
        gloo = dist.get_backend(dp_mesh.get_all_groups()[0]) == "gloo"
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(dp_mesh.size() // st.cp)
                m.set_force_sum_reduction_for_comms(gloo)
    model.register_forward_hook(_free_root_without_backward)  # after FSDP's own post-forward hook
    if config.prefetch:
        for before, after in zip(units, units[1:]):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    st.units = tuple(u.module for u in plan.units)


@contextlib.contextmanager
def fsdp_hooks_off(model: nn.Module) -> Iterator[None]:
    """FSDP's forward hooks taken off every ``fully_shard``-ed module of ``model`` for the duration: a later
    call signature is exported on the model object, whose forward calls the blocks, and export computes
    nothing (the parameters are full-size stand-ins), so nothing must be gathered."""
    saved: dict[int, tuple[dict, dict]] = {}  # each hooks dict touched -> (it, its entries before)
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = fully_shard.state(m)
        for handle in (state._pre_forward_hook_handle, state._post_forward_hook_handle):
            for h in getattr(handle, "handles", (handle,)):  # a unit of several modules: one handle each
                hooks = h.hooks_dict_ref() if h is not None else None
                if hooks is not None and h.id in hooks:
                    saved.setdefault(id(hooks), (hooks, dict(hooks)))
                    del hooks[h.id]
    try:
        yield
    finally:
        for hooks, original in saved.values():  # restored whole, in order (FSDP's pre-hook runs first)
            hooks.clear()
            hooks.update(original)


def apply_stage_fsdp(model: nn.Module, st: TPState, stages: list[nn.Module], mesh: DeviceMesh,
                     config: FSDPConfig) -> None:
    """Pipeline × FSDP: each of this rank's pipeline stages (:class:`~autotp.operators.stages.StageModule`)
    is one FSDP unit over the stage's data-parallel ranks. The modules holding the parameters its piece reads
    are ``fully_shard``-ed together and the piece runs as their FSDP forward method, so the first
    micro-batch's forward gathers the stage's parameters; by default (torchtitan's choice for pipelining)
    they stay gathered until the last micro-batch's backward, one all-gather per step instead of one per
    micro-batch's forward and backward. The stage module itself is the FSDP root above them (holding none),
    which ``torch.distributed.pipelining`` drives as torchtitan's stages: gradients reduce-scattered once
    per step, after the last micro-batch's backward."""
    path_of = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    # each stage's unit: the modules holding the parameters its piece reads; checked for every stage before
    # any parameter changes
    groups = [list({id(owner): owner for owner, _ in stage.piece.owners()}.values()) for stage in stages]
    taken: dict[int, int] = {}  # module -> the stage whose unit it joins
    for i, members in enumerate(groups):
        shared = [m for m in members if taken.get(id(m), i) != i]
        if shared:
            raise ShardingError(f"fsdp with pipeline stages: {path_of[id(shared[0])]} holds parameters of two "
                                "stages on this rank, and one module can be one FSDP unit only",
                                hint="choose split points that keep each module in one stage, or drop fsdp")
        taken.update((id(m), i) for m in members)
    dp_mesh, tp_mesh = fsdp_meshes(mesh, config)
    _on_tp_mesh(model, st, tp_mesh)
    options = _fsdp_options(config, dp_mesh, pipelined=True)  # kept gathered by default, as torchtitan
    retie: dict[int, nn.Parameter] = {}  # a parameter FSDP replaced -> its replacement
    units = []
    for stage, members in zip(stages, groups):
        piece: PieceCall = stage.piece
        before = [(m, leaf, p) for m in members for leaf, p in m._parameters.items() if p is not None]
        fully_shard(members if len(members) > 1 else members[0], **options)
        # FSDP's parameters replace the unit's; a tie to a module outside it (a tied embedding whose
        # other half is in another stage) follows, so every name still reaches one parameter
        retie.update((id(p), m._parameters[leaf]) for m, leaf, p in before if m._parameters[leaf] is not p)
        unit = members[0]
        unit.__dict__[UNIT_METHOD] = types.MethodType(run_unit, unit)
        register_fsdp_forward_method(unit, UNIT_METHOD)
        piece.unit = path_of[id(unit)]
        piece.bind(model)
        units.append(piece.unit)
        # the stage's parameters are the unit's: registered through its modules, under the root FSDP module
        stage.held = nn.ParameterList()
        stage.units = nn.ModuleList(members)
        fully_shard(stage, **{**options, "reshard_after_forward": None})
        # root now: the evaluation graph's stage modules (not FSDP roots) run the same units later
        fully_shard.state(stage)._lazy_init()
    swap_tensors(model, "parameters", lambda p: retie.get(id(p)))
    st.units = tuple(units)
