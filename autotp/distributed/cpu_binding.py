"""CPU ranks on one node, each on cores of its own: the CPU counterpart of torchrun's
``--numa-binding exclusive`` (which places GPU ranks only).

Unbound, N gloo ranks on N cores let the scheduler put two ranks' compute threads on one core for a
while and gloo's threads wherever there is room; every collective then waits for the slowest rank. Bound,
each rank's compute thread and its own gloo threads share that rank's cores and nothing else (measured
with ``benchmarks/speedup.py`` on 2 cores: median tp-2 steps of 91-100 ms bound against 94-106 ms
unbound over runs, with a far shorter tail).

:func:`bind_cpu_cores` binds the calling process; the launcher asks its workers to bind by setting
``AUTOTP_BIND_CORES=1`` and :func:`bind_from_env` does so once the process group exists.
"""
from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping, Sequence

import torch

ENV_BIND = "AUTOTP_BIND_CORES"

__all__ = ["ENV_BIND", "bind_cpu_cores", "bind_from_env", "physical_cores", "share_of_cores"]


def _sysfs_core(cpu: int) -> tuple[int, int] | None:
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        with open(f"{base}/physical_package_id") as pkg, open(f"{base}/core_id") as core:
            return int(pkg.read()), int(core.read())
    except (OSError, ValueError):
        return None


def physical_cores(cpus: Sequence[int], core_of: Callable[[int], tuple[int, int] | None] = _sysfs_core
                   ) -> list[list[int]]:
    """``cpus`` grouped by physical core (hyperthreads of one core together), in order of their first cpu.
    A cpu whose topology is unknown counts as a core of its own."""
    groups: dict[object, list[int]] = {}
    for cpu in sorted(cpus):
        key = core_of(cpu)
        groups.setdefault(key if key is not None else ("cpu", cpu), []).append(cpu)
    return list(groups.values())


def share_of_cores(local_rank: int, local_world: int, cores: Sequence[Sequence[int]]) -> list[int]:
    """The cpus of local rank ``local_rank`` of ``local_world``: a contiguous, exclusive share of ``cores``
    (the first ``len(cores) % local_world`` ranks get one core more). With fewer cores than ranks, rank r
    shares core r mod the core count with the ranks dealt to it after a full round (tp 4 on 2 cores: 125.8
    ms per step dealt, 175.6 ms unbound), so adjacent ranks, a TP group's, run on different cores."""
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} is out of range [0, {local_world})")
    if not cores:
        raise ValueError("no cores to share")
    if len(cores) < local_world:
        return sorted(cores[local_rank % len(cores)])
    per, extra = divmod(len(cores), local_world)
    start = local_rank * per + min(local_rank, extra)
    mine = cores[start:start + per + (local_rank < extra)]
    return sorted(cpu for core in mine for cpu in core)


def bind_cpu_cores(local_rank: int | None = None, local_world: int | None = None) -> list[int] | None:
    """Bind this process (every thread started so far that still runs anywhere it may, and all later ones,
    which inherit the main thread's binding) to its share of the cpus it may use, and cap torch's intra-op
    threads at that many. Call it in every local rank, after ``init_process_group`` (gloo's threads exist
    then), once. Ranks default to ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``. Returns the cpus, or None where the
    platform has no affinity control."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if local_world is None else local_world
    allowed = os.sched_getaffinity(0)
    cpus = share_of_cores(local_rank, local_world, physical_cores(allowed))
    os.sched_setaffinity(0, cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.sched_getaffinity(int(tid)) == allowed:  # threads bound elsewhere keep their binding
                os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread has exited
            pass
    if torch.get_num_threads() > len(cpus):
        torch.set_num_threads(len(cpus))
    return cpus


def bind_from_env(backend: str, environ: MutableMapping[str, str] | None = None) -> list[int] | None:
    """:func:`bind_cpu_cores` when the launcher asked for it (``AUTOTP_BIND_CORES=1``) and ranks run on CPU;
    once. The request is then marked done (``bound``): a second call would split the rank's own share again."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_BIND) != "1" or backend != "gloo":
        return None
    cpus = bind_cpu_cores()
    environ[ENV_BIND] = "bound"
    return cpus
