"""CPU ranks bound to cores of their own: the split (pure), and the binding the launcher asks its workers for."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from autotp.distributed.cpu_binding import ENV_BIND, bind_from_env, physical_cores, share_of_cores
from autotp.distributed.launch import LaunchSpec, launch

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")


def test_hyperthreads_of_a_core_stay_together():
    # 4 cores with 2 threads each, numbered as Linux does: cpu n and n + 4 are one core's threads
    topology = {cpu: (0, cpu % 4) for cpu in range(8)}
    cores = physical_cores(range(8), topology.get)
    assert cores == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert share_of_cores(0, 2, cores) == [0, 1, 4, 5]
    assert share_of_cores(1, 2, cores) == [2, 3, 6, 7]


def test_unknown_topology_counts_each_cpu_as_a_core():
    assert physical_cores([3, 1, 2], lambda cpu: None) == [[1], [2], [3]]


@pytest.mark.parametrize("n_cores,world,expect", [
    (2, 2, [[0], [1]]),
    (5, 2, [[0, 1, 2], [3, 4]]),  # the first ranks get the extra core
    (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
])
def test_exclusive_contiguous_shares(n_cores: int, world: int, expect: list):
    cores = [[c] for c in range(n_cores)]
    shares = [share_of_cores(r, world, cores) for r in range(world)]
    assert shares == expect
    assert sum(map(len, shares)) == len(set().union(*map(set, shares)))  # disjoint


@pytest.mark.parametrize("n_cores,world,expect", [
    (2, 4, [[0], [1], [0], [1]]),  # adjacent ranks (a TP group's) on different cores
    (3, 4, [[0], [1], [2], [0]]),
    (1, 2, [[0], [0]]),
])
def test_fewer_cores_than_ranks_are_dealt_round(n_cores: int, world: int, expect: list):
    assert [share_of_cores(r, world, [[c] for c in range(n_cores)]) for r in range(world)] == expect


def test_local_rank_out_of_range():
    with pytest.raises(ValueError, match="local rank 2 is out of range"):
        share_of_cores(2, 2, [[0], [1]])


def test_binding_needs_the_launcher_and_a_cpu_backend():
    assert bind_from_env("gloo", {}) is None
    assert bind_from_env("nccl", {ENV_BIND: "1"}) is None
    assert bind_from_env("gloo", {ENV_BIND: "bound"}) is None  # done once already: not split again


def _affinity_worker() -> dict:
    from autotp.distributed.launch import current_tp_group, init_from_env

    init_from_env()
    try:
        current_tp_group()  # parallelize's lookup binds too when the script made its own group: not twice
        threads = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
        return {"main": sorted(os.sched_getaffinity(0)), "threads": threads, "intra_op": torch.get_num_threads(),
                "request": os.environ.get(ENV_BIND)}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@needs_affinity
@pytest.mark.parametrize("bind", [True, pytest.param(False, marks=pytest.mark.extended)])
def test_launched_cpu_ranks_are_bound(bind: bool):
    allowed = sorted(os.sched_getaffinity(0))
    results = launch(LaunchSpec(tp=2, device="cpu", bind_cores=bind), _affinity_worker)
    expect = [share_of_cores(r, 2, physical_cores(allowed)) for r in range(2)]
    assert all(r["request"] == ("bound" if bind else "0") for r in results.values())
    if not bind:
        assert all(r["main"] == allowed for r in results.values())
        return
    assert [results[r]["main"] for r in range(2)] == expect
    assert len(allowed) < 2 or not set(expect[0]) & set(expect[1])
    for rank, r in results.items():
        # gloo's threads (started by init_process_group) and the mesh groups' ones run on the rank's cores
        assert len(r["threads"]) > 1 and all(cpus == expect[rank] for cpus in r["threads"].values())
        assert r["intra_op"] <= len(expect[rank])
