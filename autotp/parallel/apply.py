"""The steps after planning, in the one order they run: :data:`APPLY_ORDER`.

One call signature's captured graph and its Plan (:func:`~autotp.parallel.planning.capture_and_plan`'s
:class:`~autotp.parallel.planning.Planned`) become the graph the model runs on this rank. Each step is a
function of the :class:`Applying` record, run in this order (why each comes where it does):

1. ``plan_islands``: each block that branches on the data (an island) planned on its own, before the rewrite,
   from its inputs as captured; pipeline stages refuse one.
2. ``rewrite_graph``: the Plan's passes (:data:`autotp.passes.DEFAULT_PASSES`: collectives, vocab, sequence,
   expert and context parallelism) on the graph, its cuts checked against the ones already made. Every later
   step works on the rewritten graph, so every later piece and region holds the collectives it needs.
3. ``cut_units``: with FSDP, the graph cut into one piece per unit (a repeated block), each run as its unit's
   forward so FSDP gathers around it (:func:`autotp.passes.split_units`); after the rewrite, so a unit's
   piece holds its own blocks' collectives.
4. ``cut_stages``: with pipeline stages, the graph cut into one piece per stage
   (:func:`autotp.passes.split_stages`); on the first call the pieces say which parameters this rank's stages
   read, so the next step allocates no other stage's.
5. ``hold_shards``: the model's parameters and buffers become this rank's shards (sliced once, the first call;
   what is still on the meta device allocated). The rank enters here.
6. ``shard_units``: ``fully_shard`` of the units (once); after ``hold_shards``, since FSDP keeps the tensors
   it is given: the TP shards, already allocated.
7. ``read_model_tensors``: the graph's attributes pointed at the model's own tensors (the shards, buffers).
8. ``bind_groups``, ``bind_streams``, ``bind_vocab``, ``bind_model_pieces``: the operators bound to the tp
   (and cp) groups and this rank, the random ops to their streams, each piece to the model's modules.
9. ``outline_functions``, ``outline_autocast``, ``outline_recompute``: the model's own autograd Functions,
   autocast regions and checkpointed regions put back (:mod:`autotp.passes.outline_functions` and the
   others), innermost first, so a Function stays inside the autocast region and the checkpointed region it
   ran in; on the bound graph, inside every piece, as torchtitan applies activation checkpointing per
   block: a region recomputes within its piece's backward, where FSDP has gathered the unit's parameters
   again, and with the random streams its ops were bound to in step 8.
10. ``compile_graph``: last, as torchtitan compiles after activation checkpointing: ``torch.compile`` traces
    the finished graph (its collectives bound, its regions outlined); with FSDP only the pieces are compiled,
    so FSDP's hooks run eagerly around each (as torchtitan compiles each block and leaves ``fully_shard``'s
    hooks outside). Pipeline stages are compiled when the pipeline builds them
    (:mod:`autotp.parallel.pipeline`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Hashable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from autotp.capture.islands import ISLANDS_KEY
from autotp.capture.values import CHECKS_KEY
from autotp.capture.structure import Spec
from autotp.capture.writes import WRITES_KEY
from autotp.errors import PipelineError, ShardingError
from autotp.operators.collectives import bind_collectives as bind_collectives_to, define_ops
from autotp.operators.gathered import bind_outputs, local_outputs
from autotp.operators.rng import bind_rng
from autotp.operators.pieces import bind_pieces
from autotp.operators.vocab_ops import bind_vocab as bind_vocab_to
from autotp.parallel.fsdp import apply_fsdp, fsdp_hooks_off
from autotp.parallel.islands import bind_islands, plan_islands as plan_island_blocks
from autotp.parallel.planning import Planned
from autotp.parallel.rewrite import rewrite
from autotp.parallel.shard import hold, other_stages
from autotp.parallel.stage_writes import mark_outputs, output_facts
from autotp.parallel.writeback import fingerprint, written_at
from autotp.passes import PassError, outline_autocast as outline_autocast_regions, \
    outline_functions as outline_function_calls, outline_recompute as outline_recompute_regions, run_passes
from autotp.passes.split_stages import split_stages
from autotp.passes.split_units import split_units
from autotp.plan.plan import Plan
from autotp.state import Captured, TPState

# A step's warnings point as far up the stack as when parallelize's _build ran the steps itself: the step and
# apply are the frames between _build and what a step calls.
_UP = 2


@dataclasses.dataclass
class Applying:
    """One call signature on its way from its plan to the graph the model runs; each step fills in its part."""

    model: nn.Module
    st: TPState
    planned: Planned
    fresh: list[str]  # parameters that were on the meta device (not other stages'): unloaded until a load fills them
    gm: fx.GraphModule | None = None  # rewritten; then cut into pieces; then bound, outlined
    spec: Spec | None = None  # the forward's output structure
    plan: Plan | None = None  # what the passes executed (the islands' parameters added)
    copied: bool = False  # the plan is of the exported blocks, rewritten once and copied
    islands: dict | None = None  # island path -> its inputs' structure
    writes: object = None  # the state the forward writes on the model, read before the graph is cut
    run: nn.Module | None = None  # what the model calls: ``gm``, or its compiled form
    call: nn.Module | None = None  # with compiled pieces: ``gm`` returning gathered-on-use outputs as local ones
    wrap: dict = dataclasses.field(default_factory=dict)  # flat output index -> the module that wraps it after


Step = Callable[[Applying], None]


def _capturing(a: Applying) -> contextlib.AbstractContextManager:
    """Once FSDP shards the model its hooks would gather parameters inside an export: a step that may capture
    (an island's modules, the whole model where the rewritten blocks cannot be copied) runs with them off."""
    return fsdp_hooks_off(a.model) if a.st.units is not None else contextlib.nullcontext()


def plan_islands(a: Applying) -> None:
    a.islands = a.planned.gm.meta.get(ISLANDS_KEY)
    if a.islands and a.st.options.pipeline is not None:
        raise ShardingError(f"{next(iter(a.islands))} branches on the data, so it runs eagerly as one call "
                            "(an island), which pipeline stages do not run yet",
                            hint="parallelize it without pipeline stages (FSDP runs islands in their blocks' "
                                 "units), or write its loop in a dense form (every expert on every token, "
                                 "weighted by the routing)")
    if a.islands:  # before the passes: the blocks' inputs as captured
        with _capturing(a):
            plan_island_blocks(a.model, a.st, a.planned.gm, a.islands, stacklevel=5 + _UP)


def rewrite_graph(a: Applying) -> None:
    with _capturing(a):
        a.gm, a.spec, a.plan, a.copied = rewrite(a.st, a.planned, stacklevel=4 + _UP)
    a.writes = a.gm.meta.get(WRITES_KEY)  # read before the graph is cut into FSDP units' or stages' pieces
    if a.islands:  # the blocks' own parameters, cut as each block's plan says
        a.gm.meta[ISLANDS_KEY] = a.islands
        a.plan = dataclasses.replace(a.plan, params=a.plan.params + tuple(
            (n, s) for path in a.islands for n, s in a.st.islands[path].params))


def cut_units(a: Applying) -> None:
    """The graph cut into one piece per FSDP unit (a block), each run as that unit's forward. A graph that
    cannot be cut makes the whole model one unit (the first call), with a warning that says why."""
    if a.st.options.fsdp is None:
        return
    st, gm, plan = a.st, a.gm, a.plan
    if st.units is not None:  # FSDP is applied: a later call signature runs the same units (the pass checks
        plan = dataclasses.replace(plan, units=st.plan.units)  # that each piece reads only its unit's)
    try:
        top = run_passes(gm, plan, (split_units,))
    except PassError as e:
        if st.units:
            raise ShardingError(f"this call's graph cannot be cut at the blocks FSDP shards: {e.__cause__}") from e
        warnings.warn(f"autotp: fsdp shards the whole model as one unit (all parameters gathered at once): "
                      f"{e.__cause__}", stacklevel=3 + _UP)  # from this step's own frame
        plan = dataclasses.replace(plan, units=())
        top = run_passes(gm, plan, (split_units,))  # one piece: it still reads the parameters when it runs
    _drop_stand_ins(gm)
    if a.islands:  # in the units' pieces: each runs inside its block's unit, its parameters gathered by FSDP
        top.meta[ISLANDS_KEY] = a.islands
    a.gm, a.plan = top, plan


def cut_stages(a: Applying) -> None:
    """The graph cut into one piece per pipeline stage, each reading the model's parameters when it runs."""
    if a.st.options.pipeline is None:
        return
    gm, plan = a.gm, a.plan
    facts = output_facts(gm)  # each output's value and the inputs it is made from (the loss, the written state)
    try:
        top = run_passes(gm, plan, (split_stages,))
    except PassError as e:
        raise PipelineError(f"the graph cannot be cut into pipeline stages at the blocks "
                            f"{', '.join(s.blocks[0] for s in plan.stages)}: {e.__cause__}") from e
    mark_outputs(top, facts)
    _drop_stand_ins(gm)
    a.gm = top
    st = a.st
    if not st.graphs and st.stage_params is not None:  # the first call: other ranks' stages are never allocated
        st.dropped = other_stages(a.model, st.stage_params(top))
        a.fresh = [n for n in a.fresh if n not in st.dropped]


def _drop_stand_ins(gm: fx.GraphModule) -> None:
    """The pieces read the model's parameters; the captured graph's stand-ins (full size) are dropped."""
    for name, _ in list(gm.named_parameters(remove_duplicate=False)):
        path, _, leaf = name.rpartition(".")
        (gm.get_submodule(path) if path else gm)._parameters.pop(leaf, None)


def hold_shards(a: Applying) -> None:
    hold(a.model, a.st, a.plan, a.fresh)


def shard_units(a: Applying) -> None:
    if a.st.options.fsdp is not None and a.st.units is None:
        apply_fsdp(a.model, a.st, a.plan)  # on allocated shards: FSDP keeps the tensors it is given


def read_model_tensors(a: Applying) -> None:
    """Point the graph at the model's own tensors (shards, buffers)."""
    tensors = {**dict(a.model.named_parameters(remove_duplicate=False)),
               **dict(a.model.named_buffers(remove_duplicate=False))}
    for node in a.gm.graph.nodes:
        if node.op == "get_attr" and node.target in tensors:
            _set_attr(a.gm, node.target, tensors[node.target])


def _set_attr(root: nn.Module, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    mod = root
    for p in path:
        mod = getattr(mod, p)
    if isinstance(value, nn.Parameter):
        mod._buffers.pop(leaf, None)
        mod._parameters[leaf] = value
    else:
        mod._parameters.pop(leaf, None)
        mod._buffers[leaf] = value


def bind_groups(a: Applying) -> None:
    """Collectives to the tp group (the islands' too) and the cp group."""
    st = a.st
    bind_collectives_to(a.gm, st.group)
    bind_islands(a.gm, a.model, st.islands, st.group)
    bind_collectives_to(a.gm, st.cp_group, axis="cp")
    if st.tp > 1:
        define_ops()  # the user may torch.compile the model: its CPU all-reduces then trace as one op each


def bind_streams(a: Applying) -> None:
    bind_rng(a.gm, a.st.rng, a.st.context_rng)


def bind_vocab(a: Applying) -> None:
    """The vocab-parallel operators and the gathered-on-use outputs to this rank of the tp (and cp) group."""
    st = a.st
    bind_vocab_to(a.gm, st.group, st.rank)
    bind_outputs(a.gm, st.group, st.rank)
    if st.cp_group is not None:
        bind_outputs(a.gm, st.cp_group, dist.get_rank(st.cp_group), axis="cp")


def bind_model_pieces(a: Applying) -> None:
    bind_pieces(a.gm, a.model)


def outline_functions(a: Applying) -> None:
    outline_function_calls(a.gm)  # the model's own autograd Functions, called again (inside any region below)


def outline_autocast(a: Applying) -> None:
    outline_autocast_regions(a.gm)  # the model's autocast regions, inside its checkpointed ones


def outline_recompute(a: Applying) -> None:
    outline_recompute_regions(a.gm)  # last: the regions' modules are bound already


def compile_graph(a: Applying) -> None:
    a.run = a.gm
    if not a.st.options.compile:
        return
    from autotp.operators.compile import compile_graph as compiled, compile_pieces

    options = a.st.options.compile if isinstance(a.st.options.compile, dict) else {}
    if a.st.options.fsdp is None:
        a.run = compiled(a.gm, **options)
    else:  # FSDP gathers around each unit's piece: the pieces are compiled, as torchtitan compiles blocks
        compile_pieces(a.gm, **options)
        a.call, a.wrap = local_outputs(a.gm)


APPLY_ORDER: tuple[Step, ...] = (
    plan_islands, rewrite_graph,  # the Plan executed on the graph
    cut_units, cut_stages,  # the rewritten graph cut into FSDP units' or pipeline stages' pieces
    hold_shards, shard_units,  # this rank's tensors: TP shards, then FSDP over them
    read_model_tensors, bind_groups, bind_streams, bind_vocab, bind_model_pieces,  # bound to the model and rank
    outline_functions, outline_autocast, outline_recompute,  # the model's own regions, innermost first
    compile_graph,  # the finished graph
)


def apply(model: nn.Module, st: TPState, planned: Planned, key: Hashable, fresh: list[str]) -> Captured:
    """Run :data:`APPLY_ORDER` on ``planned`` for this rank and record the graph the model runs for call
    signature ``key`` (``st.graphs[key]``), with the state its forward writes and the checks it was captured
    under."""
    checks = planned.gm.meta.get(CHECKS_KEY, ())  # as captured, before any step
    a = Applying(model, st, planned, fresh)
    for step in APPLY_ORDER:
        step(a)
    index = {n.name: i for i, n in enumerate(n for n in a.gm.graph.nodes if n.op == "placeholder")}
    seq = a.plan.sequence
    length = (index[seq.length[0]], seq.length[1]) if seq is not None and seq.length and seq.leaves else None
    chunked = a.plan.context.inputs[0] if a.plan.context is not None and a.plan.context.inputs else None
    c = st.graphs[key] = Captured(a.run, a.plan, a.spec, tuple((index[s.node], s) for s in a.plan.sharded_inputs),
                                  length, planned.accepts, a.copied, a.call if a.wrap else None,
                                  tuple(a.wrap.items()), None if chunked is None else (index[chunked[0]], chunked[1]),
                                  local=bool(st.options.compile))
    if a.writes:  # the state this graph writes, and the written state it was captured on (as the model holds it now)
        st.written.update(dict.fromkeys(written_at(w) for w in a.writes.items))
    if st.written or checks:
        c = st.graphs[key] = dataclasses.replace(c, writes=a.writes, state=fingerprint(model, st.written),
                                                 checks=checks)
    return c
