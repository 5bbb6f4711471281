"""How an island (a block whose own code branches on the data, :mod:`autotp.capture.islands`) is sharded.

The block runs eagerly on every rank of the group, with the same inputs and the same routing. Its experts
are cut by the same analysis as the rest of the model, applied per module: each submodule the block calls
with two or more matrices (an expert's ``w1``/``w3``/``w2``, an ``nn.Sequential`` of linears) is captured
alone on the inputs the block gave it and planned (by the caller's ``plan_module``, the orchestration's one
capture-and-plan, :func:`~autotp.parallel.planning.capture_and_plan`): its column→row
pairs. Run eagerly on its slices, such a module gives this rank's partial sum of its output; that is proven
on the module itself before it is cut: random weights of its shapes, the module on the full weights against
the sum of its runs on every rank's slices (a module whose code reads a size the cut changes, or adds a bias
after its row matmul, fails it and stays whole).

Then the block's outputs: each must be the sum of what the cut modules give it (the experts' outputs scaled
by 0 and 2 through hooks scale it so: summed over ranks by one all-reduce at the block's output) or not
depend on them at all (a load-balancing loss from the router: the same on every rank, left as it is);
anything else leaves the block whole, with the reason. Backward (:mod:`autotp.operators.islands`) every
rank's gradient of the block's inputs and of its whole parameters (the router) is summed over the group:
each rank's share is its experts' slice, and a value the block returns unchanged by the experts passes
1/tp of its gradient to each rank.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module

from autotp.capture.structure import flatten
from autotp.errors import CaptureError, ShardingError
from autotp.plan.plan import ParamShard, Plan

__all__ = ["IslandPlan", "plan_island"]

_TOL = 1e-4  # relative: the probes run fp32 on random values

# a module captured alone on its call's arguments, with these tensors for its own, and planned at the island's
# tp; CaptureError or ShardingError where it cannot be
PlanModule = Callable[[nn.Module, tuple, dict[str, torch.Tensor]], Plan]


@dataclass(frozen=True)
class IslandPlan:
    """One island: its module path, the slices of its cut parameters (full names), per flat output
    ``"sum"`` (all-reduced) or ``"same"`` (every rank's already), the names of its parameters held whole
    (their gradients summed over the group), and why it runs whole ("" where it is cut)."""

    path: str
    params: tuple[tuple[str, ParamShard], ...] = ()
    outputs: tuple[str, ...] = ()
    whole_params: tuple[str, ...] = ()
    reason: str = ""


def plan_island(block: nn.Module, path: str, inputs: tuple, kwargs: dict, tp: int,
                shapes: Mapping[str, torch.Tensor], plan_module: PlanModule) -> IslandPlan:
    """``block`` (at ``path``) cut for ``tp`` ranks; ``inputs``/``kwargs``: real tensors shaped like its call's
    (values are not read); ``shapes``: each of its parameters' and buffers' full-size tensor (a shard's full
    shape where the model holds shards), by its name inside the block; ``plan_module``: a submodule's plan
    at ``tp``. The probes never advance the model's random stream (a training forward's dropout draws from
    it: the parallel model's draws must stay the unsharded model's)."""
    with torch.random.fork_rng(devices=[]):
        return _plan_island(block, path, inputs, kwargs, tp, shapes, plan_module)


def _plan_island(block: nn.Module, path: str, inputs: tuple, kwargs: dict, tp: int,
                 shapes: Mapping[str, torch.Tensor], plan_module: PlanModule) -> IslandPlan:
    gen = torch.Generator().manual_seed(0)
    state = {n: (torch.randn(t.shape, generator=gen) * t.shape[-1] ** -0.5).to(t.dtype)
             if t.is_floating_point() and t.dim() else torch.zeros(t.shape, dtype=t.dtype)
             for n, t in shapes.items()}
    state = {n: nn.Parameter(t, requires_grad=False) if isinstance(shapes[n], nn.Parameter) else t
             for n, t in state.items()}  # export takes a parameter's stand-in only as a Parameter
    calls: dict[str, tuple] = {}
    names = {id(m): n for n, m in block.named_modules() if n}
    hooks = [m.register_forward_pre_hook(lambda m, a: calls.setdefault(names[id(m)], a))
             for m in block.modules() if m is not block]
    try:
        with torch.no_grad(), _reparametrize_module(block, state):
            block(*inputs, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    cut: dict[str, ParamShard] = {}
    kept: list[str] = []
    random: list[str] = []
    for sub, args in calls.items():
        if any(sub.startswith(f"{c}.") for c in kept) or \
                sum(p.dim() >= 2 for p in block.get_submodule(sub).parameters()) < 2:
            continue
        found = _cut_module(block.get_submodule(sub), sub, args, tp, state, plan_module)
        if found is None:
            random.append(sub)
        elif found:
            cut.update(found)
            kept.append(sub)
    if random:  # one expert left whole would leave the block's sum uncut: the block runs whole
        return IslandPlan(path, reason=f"{', '.join(random[:3])}{' ...' if len(random) > 3 else ''} draw random "
                                       "numbers in training (dropout), and a rank's slice of their masks would not "
                                       "be the unsharded model's")
    if not cut:
        return IslandPlan(path, reason="no module it calls has a column→row pair that runs exactly on its slices")
    outputs = _outputs(block, inputs, kwargs, state, kept)
    if isinstance(outputs, str):
        return IslandPlan(path, reason=outputs)
    whole = tuple(f"{path}.{n}" for n, p in block.named_parameters() if n not in cut and p.requires_grad)
    return IslandPlan(path, tuple((f"{path}.{n}", replace(s, module=f"{path}.{s.module}")) for n, s in cut.items()),
                      outputs, whole)


def _cut_module(module: nn.Module, sub: str, args: tuple, tp: int, state: dict[str, torch.Tensor],
                plan_module: PlanModule) -> dict[str, ParamShard] | None:
    """``module`` (at ``sub`` inside the block) planned alone: its cut parameters by name inside the block,
    each's module path inside the block; empty where it has no pair or its slices do not sum to its output;
    None where it draws random numbers in training, whatever mode it is in now (a model parallelized in
    eval mode trains later)."""
    own = {n[len(sub) + 1:]: t for n, t in state.items() if n.startswith(f"{sub}.")}
    if _draws_random(module, args, own):
        return None
    try:
        plan = plan_module(module, tuple(args), own)
    except (CaptureError, ShardingError):
        return {}
    shards = dict(plan.params)
    if not shards or plan.buffers or any(s.role not in ("column", "row") for s in shards.values()):
        return {}
    with torch.no_grad():
        with _reparametrize_module(module, own):
            want = module(*args)
        got = None
        for r in range(tp):
            local = {n: shards[n].shard(t, tp, r) if n in shards else t for n, t in own.items()}
            try:
                with _reparametrize_module(module, local):
                    y = module(*args)
            except RuntimeError:  # a size its code reads changed with the cut
                return {}
            if not isinstance(y, torch.Tensor) or y.shape != want.shape:
                return {}
            got = y if got is None else got + y
    if not _close(got, want):
        return {}
    return {f"{sub}.{n}": replace(s, module=f"{sub}.{s.module}" if s.module else sub) for n, s in shards.items()}


def _draws_random(module: nn.Module, args: tuple, own: dict[str, torch.Tensor]) -> bool:
    """Whether two training-mode runs of ``module`` on the same inputs differ (dropout inside it)."""
    was = [(m, m.training) for m in module.modules()]
    module.train()
    try:
        with torch.no_grad(), _reparametrize_module(module, own):
            first, second = module(*args), module(*args)
    finally:
        for m, mode in was:
            m.training = mode
    return isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor) and not torch.equal(first, second)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = max(b.abs().max().item(), 1e-6)
    return (a - b).abs().max().item() <= _TOL * scale


def _outputs(block: nn.Module, inputs: tuple, kwargs: dict, state: dict[str, torch.Tensor],
             cut: list[str]) -> tuple[str, ...] | str:
    """Per flat output of the block: "sum" (linear in the cut modules' outputs) or "same" (independent of
    them); a reason where an output is neither."""
    runs = []
    for scale in (1.0, 0.0, 2.0):
        hooks = [block.get_submodule(c).register_forward_hook(lambda m, a, out, s=scale: out * s) for c in cut]
        try:
            with torch.no_grad(), _reparametrize_module(block, state):
                runs.append(flatten(block(*inputs, **kwargs))[0])
        finally:
            for h in hooks:
                h.remove()
    kinds = []
    for i, (one, zero, two) in enumerate(zip(*runs)):
        if torch.equal(one, zero) and torch.equal(one, two):
            kinds.append("same")
        elif one.is_floating_point() and one.abs().max().item() > 0 and _close(two, 2 * one) and \
                zero.abs().max().item() <= _TOL * one.abs().max().item():
            kinds.append("sum")
        else:
            return (f"its output {i} is neither a sum of its experts' outputs nor independent of them "
                    "(a residual or a norm after them), so no single all-reduce gives it")
    return tuple(kinds)
