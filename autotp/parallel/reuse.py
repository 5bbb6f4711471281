"""A restarted job shards its model from the plan cache and captures on the first call.

``parallelize`` needs a plan before it returns: the plan says which slice of each parameter this rank keeps,
and :func:`autotp.load_weights` reads exactly those slices. Making it means capturing the forward (the
export of two blocks and the analysis: about 1 s for a 22-layer Llama, more on a shared machine), which a
job that restarts, or every rank of a serving fleet, would pay again for the same model. So parallelize
looks the plan up in the on-disk cache (:mod:`autotp.plan.cache`) under the key of what it depends on (the
ops the forward runs on meta, every tensor's name, shape and dtype, the plan's job: tp and the options, the
versions of torch and autotp), through :func:`autotp.parallel.planning.capture_and_plan` as everything that
plans does. On a hit it shards the parameters from the cached plan and captures nothing; the model's first
call captures its own signature then, as any later call signature is captured, and checks that its plan
cuts every parameter as the cached one did. On a miss it captures as always and stores the plan.

Only plain tensor parallelism at tp > 1 takes this path (:attr:`~autotp.parallel.planning.PlanJob.reusable`):
FSDP units and pipeline stages are cut from the graph at parallelize time, and at tp 1 the fused segments
are read from the graph. ``AUTOTP_PLAN_CACHE=0`` turns the user's cache off; the folder is the plan cache's
(``$AUTOTP_CACHE_DIR``, else ``~/.cache/autotp/plans``). ``autotp shard`` gives its ranks a folder of the
job's own instead, where its check before any rank starts stored the plan: the job plans once.
"""
from __future__ import annotations

import os
from pathlib import Path

from autotp.parallel.planning import PlanCache, PlanJob

__all__ = ["plan_cache_for"]


def plan_cache_for(job: PlanJob, folder: Path | str | None = None) -> PlanCache | None:
    """The cache ``parallelize`` looks the plan of ``job`` up in: ``folder`` (a job's own, whatever
    ``AUTOTP_PLAN_CACHE`` says), else the user's unless ``AUTOTP_PLAN_CACHE=0``; None where the job's plan is
    not reused."""
    if not job.reusable:
        return None
    if folder is not None:
        return PlanCache(Path(folder))
    return PlanCache() if os.environ.get("AUTOTP_PLAN_CACHE", "1") != "0" else None
