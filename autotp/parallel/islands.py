"""Each island of a captured graph planned once per model: its block cut for this group
(:mod:`autotp.plan.islands`), or run whole with the reason said once."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from autotp.capture.islands import ISLANDS_KEY, hint, is_island
from autotp.capture.structure import flatten, unflatten
from autotp.operators.islands import IslandCall
from autotp.parallel.planning import How, PlanJob, capture_and_plan
from autotp.plan.islands import PlanModule, plan_island
from autotp.state import TPState

__all__ = ["bind_islands", "module_planner", "plan_islands"]


def plan_islands(model: nn.Module, st: TPState, gm: fx.GraphModule, specs: dict, stacklevel: int) -> None:
    """Plan every island of ``gm`` (as captured; ``specs``: path -> its inputs' structure) that this model
    has not planned yet: a later call signature runs the blocks cut as the first one did."""
    for node in gm.graph.nodes:
        if not is_island(node) or node.args[0] in st.islands:
            continue
        path = node.args[0]
        block = model.get_submodule(path)
        flat = [_example(x.meta["val"]) for x in node.args[1]]
        args, kwargs = unflatten(flat, specs[path])
        prefix = f"{path}."
        shapes = {n: st.full.get(prefix + n, t) for n, t in [*block.named_parameters(remove_duplicate=False),
                                                             *block.named_buffers(remove_duplicate=False)]}
        plan = st.islands[path] = plan_island(block, path, tuple(args), dict(kwargs), st.tp, shapes,
                                              module_planner(st.tp))
        if plan.reason and st.tp > 1:
            warnings.warn(f"autotp: {path} runs whole on every rank (exact, not sharded): its code branches on "
                          f"the data, so it runs eagerly, and {plan.reason}", stacklevel=stacklevel)
        elif st.options.expert_parallel and st.tp > 1:  # asked for, and not what an island's cut gives
            warnings.warn(f"autotp: expert_parallel: {path} branches on the data, so it runs eagerly as one call, "
                          "with its experts cut by columns and rows on every rank (expert tensor parallelism: one "
                          "all-reduce forward, one backward), not placed whole per rank", stacklevel=stacklevel)


def module_planner(tp: int) -> PlanModule:
    """How an island's modules are planned: each captured alone on its call's arguments, with its own
    tensors' stand-ins, and planned at ``tp`` (:func:`~autotp.parallel.planning.capture_and_plan`)."""
    def plan(module: nn.Module, args: tuple, own: dict[str, torch.Tensor]):
        return capture_and_plan(module, args, {}, PlanJob(tp), how=How(params=own)).plan

    return plan


def _example(val: torch.Tensor) -> torch.Tensor:
    """A real tensor of a captured value's size (its hint where the size is symbolic): only shapes are read."""
    shape = tuple(hint(s) for s in val.shape)
    if val.is_floating_point():
        return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(val.dtype)
    return torch.zeros(shape, dtype=val.dtype)


def bind_islands(gm: fx.GraphModule, model: nn.Module, plans: dict, group: dist.ProcessGroup | None) -> None:
    """Turn each island node of ``gm`` (or of its pieces, where it is cut into FSDP units) into a call of its
    block (``plans``: path -> its IslandPlan)."""
    specs = gm.meta.get(ISLANDS_KEY) or {}
    if not specs:
        return
    for holder in [m for m in gm.modules() if isinstance(m, fx.GraphModule)]:
        n = 0
        for node in list(holder.graph.nodes):
            if not is_island(node):
                continue
            path, xs = node.args[0], node.args[1]
            plan, block = plans[path], model.get_submodule(path)
            call = IslandCall(block, _runner(block, specs[path]), plan.outputs,
                              tuple(p[len(path) + 1:] for p in plan.whole_params))
            call.bind(group)
            name = f"autotp_island_{n}"
            n += 1
            holder.add_submodule(name, call)
            node.op, node.target, node.args, node.kwargs = "call_module", name, tuple(xs), {}
        if n:
            holder.recompile()


def _runner(block: nn.Module, in_spec: object):
    def run(flat: list[torch.Tensor]) -> list[torch.Tensor]:
        args, kwargs = unflatten(flat, in_spec)
        return list(flatten(block(*args, **kwargs))[0])

    return run
