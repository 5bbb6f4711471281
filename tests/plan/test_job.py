"""The job value (autotp/distributed/job.py): the sizes travel as ints from the command line to the collective.

``autotp shard`` hands its ranks the :class:`RankJob` as the function's argument; ``autotp run`` in one
environment variable holding the whole value. Followed here without processes: the typer command's parsed
options -> the launcher's arguments (the launcher monkeypatched) -> a rank's mesh on torch's fake process group
of the job's world size -> the tp group's size.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from typer.testing import CliRunner

from autotp.cli.main import app
from autotp.distributed import launch as launch_module
from autotp.distributed.job import ENV_JOB, JOB_VERSION, RankJob, job_from_env
from autotp.distributed.launch import LaunchSpec, current_tp_group, init_job
from autotp.distributed.rank_grid import MESH_TP, RankGrid
from autotp.errors import LaunchError, ProcessGroupError

runner = CliRunner()


def _fake_world(world: int):
    """A process group of ``world`` ranks in this one process (torch's fake backend: no peers, no traffic)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def test_the_job_is_one_versioned_json_value_of_ints() -> None:
    spec = LaunchSpec(tp=2, dp=2, pp=2, cp=2, timeout=30, fsdp=True, hsdp=2, virtual_stages=2, device="cpu")
    env = spec.env()
    assert [k for k in env if k.startswith("AUTOTP_") and k != "AUTOTP_BIND_CORES"] == [ENV_JOB]
    data = json.loads(env[ENV_JOB])
    assert data["version"] == JOB_VERSION
    assert {k: data[k] for k in ("world_size", "tp", "cp", "dp", "pp", "fsdp", "virtual_stages")} == \
        {"world_size": 16, "tp": 2, "cp": 2, "dp": 2, "pp": 2, "fsdp": 2, "virtual_stages": 2}
    job = job_from_env(env)
    assert job == spec.job() and (job.backend, job.timeout) == ("gloo", 30.0)
    assert all(type(getattr(job.grid, k)) is int for k in ("tp", "cp", "dp", "pp", "world_size"))
    assert job_from_env({}) is None


@pytest.mark.parametrize("change, message", [
    ({"version": 0}, "job version 0, this autotp reads version 1"),
    ({"tp": 3}, "tp (3) × dp (2) × pp (1) = 6 ≠ world size 4 (the job's sizes: world_size 4, tp 3, cp 1, dp 2, "
                "pp 1)"),
    ({"fsdp": 3}, "hsdp 3 replica groups do not divide the dp 2 data-parallel ranks (tp 2 × cp 1 × dp 2 × pp 1 = "
                  "world 4)"),
    ({"backend": "mpi"}, "backend must be gloo or nccl, got 'mpi'"),
    ({"timeout": -1}, "timeout must be > 0 seconds, got -1"),
])
def test_a_bad_job_is_refused_naming_every_number(change: dict, message: str) -> None:
    data = {**RankJob(RankGrid.build(4, 2)).to_dict(), **change}
    with pytest.raises(LaunchError) as info:
        RankJob.from_json(json.dumps(data))
    assert isinstance(info.value, ValueError) and message in str(info.value)


def test_tp_is_an_int_from_autotp_shard_to_the_collective(tmp_path: Path, monkeypatch) -> None:
    """`autotp shard --tp 2 --dp 2`: the launcher gets the RankJob as the ranks' function argument, tp the int 2,
    and a rank's mesh built from that value has a tp group of 2 ranks (no environment read on the way)."""
    from autotp.cli import shard as shard_cli

    model = tmp_path / "tiny.py"
    model.write_text("import torch.nn as nn\n\ndef build_model():\n    return nn.Linear(4, 4)\n")
    launched = {}

    def fake_launch(spec, entrypoint, *args, **kwargs):
        launched.update(spec=spec, entrypoint=entrypoint, args=args)
        return {}

    monkeypatch.setattr(shard_cli, "preflight", lambda *a, **k: None)  # the capture is not what this follows
    monkeypatch.setattr(launch_module, "launch", fake_launch)
    monkeypatch.delenv(ENV_JOB, raising=False)
    result = runner.invoke(app, ["shard", str(model), "--tp", "2", "--dp", "2", "--device", "cpu", "--out",
                                 str(tmp_path / "out")], env={"COLUMNS": "500"})
    assert result.exit_code == 0, result.output
    ranks, job = launched["args"]
    assert launched["entrypoint"].__name__ == "shard_worker"
    assert isinstance(ranks, RankJob) and ranks == launched["spec"].job()
    assert type(ranks.grid.tp) is int and (ranks.grid.tp, ranks.grid.dp, ranks.grid.world_size) == (2, 2, 4)
    assert not hasattr(job, "tp") and not hasattr(job, "fsdp")  # the sizes travel once, in the RankJob
    _fake_world(ranks.grid.world_size)
    try:
        ctx = init_job(ranks)  # what shard_worker does first with its argument
        assert dist.get_world_size(ctx.tp_group()) == ranks.grid.tp == 2
        assert dist.get_process_group_ranks(ctx.tp_group()) == [0, 1]
        assert dist.get_world_size(ctx.dp_group()) == 2 and ctx.mesh.mesh_dim_names[-1] == MESH_TP
    finally:
        dist.destroy_process_group()


def test_tp_is_an_int_from_autotp_run_to_the_group_parallelize_takes(tmp_path: Path, monkeypatch) -> None:
    """`autotp run SCRIPT --tp 2 --dp 2`: the script's ranks get one variable holding the job; read back it is
    the int 2, and the group parallelize defaults to is the job's mesh's tp group of 2 ranks."""
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    launched = {}

    def fake_launch(spec, entrypoint, *args, **kwargs):
        launched.update(spec=spec, env=spec.env())
        return {}

    monkeypatch.setattr(launch_module, "launch", fake_launch)
    result = runner.invoke(app, ["run", str(script), "--tp", "2", "--dp", "2", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert not any(k in launched["env"] for k in ("AUTOTP_TP", "AUTOTP_DP", "AUTOTP_PP", "AUTOTP_CP"))
    job = job_from_env(launched["env"])
    assert type(job.grid.tp) is int and (job.grid.tp, job.grid.dp) == (2, 2)
    _fake_world(job.grid.world_size)
    try:
        ctx = init_job(job)  # the script's init_from_env()
        found = current_tp_group(launched["env"])  # parallelize's default: the mesh's group, not a new one
        assert found is ctx.tp_group() and dist.get_world_size(found) == 2
    finally:
        dist.destroy_process_group()


_REGISTRY = ("pg_group_ranks", "pg_map", "pg_names", "group_count")  # torch's private registry of live groups


@pytest.fixture
def no_registry_from_autotp(monkeypatch):
    """torch's registry of live groups (``distributed_c10d._World``'s properties) raises when autotp's own code
    reads it; torch's reads of it go on."""
    import sys

    from torch.distributed import distributed_c10d

    def guarded(name: str):
        original = getattr(distributed_c10d._World, name)

        def get(self):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller == "autotp" or caller.startswith("autotp."):
                raise AssertionError(f"{caller} read torch's private group registry ({name})")
            return original.fget(self)
        return property(get, original.fset)

    for name in _REGISTRY:
        monkeypatch.setattr(distributed_c10d._World, name, guarded(name))


def test_parallelize_takes_tp_from_the_job_not_from_torchs_group_registry(no_registry_from_autotp,
                                                                          monkeypatch) -> None:
    """`autotp run --tp 2 --dp 2` with the script's init_from_env(): parallelize(model) without a group takes the
    job's context, its tp the job's int 2, the tp and dp groups its one mesh's, and never looks a group up in
    torch's registry; a second init_job of the same job is the same context (no second mesh)."""
    import torch
    import torch.nn as nn

    import autotp
    from autotp.distributed.launch import current_dp_group, current_mesh

    monkeypatch.setenv("AUTOTP_PLAN_CACHE", "0")
    job = RankJob(RankGrid.build(4, 2, dp=2))
    monkeypatch.setenv(ENV_JOB, job.to_json())
    _fake_world(4)
    try:
        ctx = init_job(job)
        assert init_job(job) is ctx and current_mesh() is ctx.mesh and current_dp_group() is ctx.dp_group()
        with pytest.raises(LaunchError, match=r"set up for the job tp 2 × cp 1 × dp 2 × pp 1 = world 4, and were "
                                              r"handed another: tp 4 × cp 1 × dp 1"):
            init_job(RankJob(RankGrid.build(4, 4)))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        tpm = autotp.parallelize(model, example_inputs=(torch.randn(2, 8),))
        st = autotp.tp_state(tpm)
        assert (st.tp, st.rank) == (2, 0) and type(st.tp) is int
        assert st.group is ctx.tp_group() and st.replicas.group is ctx.dp_group()
        assert tuple(tpm[0].weight.shape) == (8, 8) and tuple(tpm[2].weight.shape) == (8, 8)  # 16 / tp rows, cols
    finally:
        dist.destroy_process_group()
    from torch.distributed import distributed_c10d

    with pytest.raises(AssertionError, match="pg_group_ranks"):  # the guard bites autotp's code, not torch's
        exec("distributed_c10d._world.pg_group_ranks", {"__name__": "autotp.probe", "distributed_c10d": distributed_c10d})
    assert isinstance(distributed_c10d._world.pg_group_ranks, dict)


def test_a_script_without_init_from_env_gets_the_jobs_cp_and_groups_once(no_registry_from_autotp,
                                                                        monkeypatch) -> None:
    """Under `autotp run --tp 1 --cp 2` a script that made no context: the first lookup makes the job's mesh and
    keeps it, every later one (tp, cp group, the cp size parallelize defaults to) is the same; after the process
    group is destroyed a new one gets a new context."""
    from autotp.distributed.context import context_mesh
    from autotp.distributed.launch import cp_from_env, current_context, current_cp_group

    job = RankJob(RankGrid.build(2, 1, cp=2))
    monkeypatch.setenv(ENV_JOB, job.to_json())
    _fake_world(2)
    try:
        ctx = current_context()
        assert ctx is not None and ctx.job == job and current_context() is ctx
        assert current_tp_group() is ctx.tp_group() and current_cp_group() is ctx.cp_group()
        assert dist.get_world_size(ctx.cp_group()) == cp_from_env() == 2
        groups = context_mesh(None, None, 2, ctx)
        assert (groups.tp, groups.cp, groups.dp) == (ctx.tp_group(), ctx.cp_group(), None)
        with pytest.raises(ProcessGroupError, match=r"context_parallel=4, and `--cp 2` laid out the ranks"):
            context_mesh(None, None, 4, ctx)
    finally:
        dist.destroy_process_group()
    _fake_world(2)
    try:
        assert current_context() is not ctx
    finally:
        dist.destroy_process_group()


def test_autotp_profile_hands_its_ranks_the_job(tmp_path: Path, monkeypatch) -> None:
    """`autotp profile --nproc 2`: the ranks' function gets the RankJob as its first argument (tp the int 2),
    as autotp shard's does, and reads no job from the environment."""
    import inspect
    import signal

    from autotp.errors import LaunchInterrupted
    from autotp.search.profile import ProfileJob, profile_worker

    launched = {}

    def fake_launch(spec, entrypoint, *args, **kwargs):
        launched.update(spec=spec, entrypoint=entrypoint, args=args)
        raise LaunchInterrupted(signal.SIGINT)

    monkeypatch.setattr(launch_module, "launch", fake_launch)
    monkeypatch.delenv(ENV_JOB, raising=False)
    result = runner.invoke(app, ["profile", "--nproc", "2", "--device", "cpu", "--quick", "--out",
                                 str(tmp_path / "p.json")], env={"COLUMNS": "500"})
    assert result.exit_code == 130, result.output
    ranks, job = launched["args"][:2]
    assert launched["entrypoint"] is profile_worker and isinstance(job, ProfileJob)
    assert isinstance(ranks, RankJob) and ranks == launched["spec"].job() and type(ranks.grid.tp) is int
    assert (ranks.grid.tp, ranks.grid.world_size) == (2, 2)
    assert list(inspect.signature(profile_worker).parameters)[:2] == ["ranks", "job"]
    import autotp.search.profile as profile_module

    assert "init_from_env" not in vars(profile_module) and "environ" not in inspect.getsource(profile_worker)
