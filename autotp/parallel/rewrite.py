"""One call signature's captured graph, planned and rewritten for this model's group, as parallelize runs it.

A graph whose repeated blocks are still to be copied in (:class:`~autotp.capture.tracer.CutGraph`) is planned
and rewritten whole on its first call signature: that plan cuts every parameter. A later signature (or the
first call after parallelize sharded by a cached plan) only has to agree with the cut already made, so the
blocks exported once are analysed and rewritten, and the rewritten blocks are copied for the rest::

    first signature:   cut graph ─copy blocks─▶ whole graph ─analyse, plan─▶ Plan ─passes─▶ rewritten
    later signatures:  cut graph ─analyse, plan─▶ Plan of the cut ─passes─▶ rewritten cut ─copy blocks─▶ rewritten

The later path costs the same at any depth. Its plan names the exported blocks only; each copy's tensors are
checked against the cut every parameter already has, under the copy's own names. It is not taken with
sequence parallelism, whose rewrite groups several blocks' values in one node (the norms' weight gradients
are summed in one bucket over all blocks): the blocks are copied first then, as on the first signature.
Copying refuses such a node anyway (:func:`~autotp.capture.repeats.expand`), and a rewritten graph it
refuses is captured and planned whole. Which path a capture takes, and the plan, are
:func:`~autotp.parallel.planning.capture_and_plan`'s (``blocks``); this module checks and rewrites.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import torch.fx as fx

from autotp.capture.repeats import Copies
from autotp.capture.structure import Spec
from autotp.errors import ShardingError
from autotp.parallel.planning import Planned
from autotp.passes import run_passes
from autotp.plan.plan import ParamShard, Plan
from autotp.state import TPState


class Rewritten(NamedTuple):
    gm: fx.GraphModule  # the whole model's graph, rewritten
    spec: Spec  # its output structure
    plan: Plan  # what the passes executed: of the whole graph, or of the exported blocks (``copied``)
    copied: bool  # the blocks were rewritten once and copied


def rewrite(st: TPState, planned: Planned, stacklevel: int) -> Rewritten:
    """Run the passes of ``planned`` (:func:`~autotp.parallel.planning.capture_and_plan`'s, for this rank's
    job) after checking its cuts against the ones already made: the rewritten blocks copied where the plan is
    of the exported blocks (see the module doc), else the whole graph rewritten."""
    plan = planned.plan
    warn_plan(st, plan, stacklevel=stacklevel + 1)
    if planned.copies is not None:
        check_consistent(st, plan, planned.copies)
        gm = run_passes(planned.gm, plan)
        spec = planned.copies.apply(gm)
        if spec is not None:
            return Rewritten(gm, spec, plan, True)
        planned = planned.whole()  # the rewritten blocks are not wired one after another
        plan = planned.plan
        warn_plan(st, plan, stacklevel=stacklevel + 1)
    check_consistent(st, plan)
    if planned.segments is not None:  # read off the graph as captured (the passes may wrap its parameters)
        st.segments = planned.segments
    return Rewritten(run_passes(planned.gm, plan), planned.spec, plan, False)


def warn_plan(st: TPState, plan: Plan, stacklevel: int = 4) -> None:
    """Say once what the plan leaves replicated or unsplit, and why."""
    for module, reason in plan.experts_kept:
        if ("experts", module) not in st.warned:
            st.warned.add(("experts", module))
            warnings.warn(f"autotp: {module or '<root>'} keeps expert tensor parallelism (1/tp of every expert), "
                          f"not whole experts per rank: {reason}", stacklevel=stacklevel)
    for module, reason in plan.replicated:
        if (module, reason) not in st.warned:
            st.warned.add((module, reason))
            warnings.warn(f"autotp: {module or '<root>'} left replicated (exact, not sharded): {reason}",
                          stacklevel=stacklevel)
    for note in plan.sequence.notes if plan.sequence is not None else ():
        if ("sequence", note) not in st.warned:
            st.warned.add(("sequence", note))
            warnings.warn(f"autotp: sequence parallelism: {note}", stacklevel=stacklevel)


def check_consistent(st: TPState, plan: Plan, copies: Copies | None = None) -> None:
    """A later call signature must cut every parameter exactly as the first one did (or as the cached plan
    parallelize sharded by). ``copies``: ``plan`` is of the exported blocks only, and holds for their copies
    under the copies' names."""
    if not st.shards:
        return
    by = f"the cached plan {st.cached_from}" if st.cached_from else "the first call"
    cuts: dict[str, ParamShard] = {}
    for name, shard in (*plan.params, *plan.buffers):
        cuts[name] = shard
        if copies is not None:  # the copies' own names, each under its own module
            for n, m in zip(copies.names(name), copies.names(shard.module)):
                cuts[n] = dataclasses.replace(shard, module=m)
    for name, shard in cuts.items():
        known = st.shards.get(name)
        if known is None:
            raise ShardingError(f"{name} is sharded by this call signature but was replicated by {by}")
        if known != shard:
            raise ShardingError(f"{name} is sharded as {known} by {by} and {shard} by this call")
    first = {n for n, _ in (*st.plan.params, *st.plan.buffers)}
    islands = {n for ip in st.islands.values() for n, _ in ip.params}  # cut by the block, not by the graph
    lost = sorted(first - set(cuts) - islands)
    if lost:
        reasons = "; ".join(f"{m}: {r}" for m, r in plan.replicated) or "no reason recorded"
        raise ShardingError(
            f"this call leaves {lost[0]} (and {len(lost) - 1} more) unsharded, but {by} sharded it: {reasons}",
            hint="call the model with inputs whose graph shards the same way, or report the pattern"
                 + ("; or delete the cached plan (AUTOTP_PLAN_CACHE=0 turns the cache off)" if st.cached_from else ""),
        )
