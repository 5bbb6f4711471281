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
from autotp.distributed.layout import MESH_TP, RankLayout
from autotp.errors import LaunchError

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
    assert all(type(getattr(job.layout, k)) is int for k in ("tp", "cp", "dp", "pp", "world_size"))
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
    data = {**RankJob(RankLayout.build(4, 2)).to_dict(), **change}
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
    assert type(ranks.layout.tp) is int and (ranks.layout.tp, ranks.layout.dp, ranks.layout.world_size) == (2, 2, 4)
    assert not hasattr(job, "tp") and not hasattr(job, "fsdp")  # the sizes travel once, in the RankJob
    _fake_world(ranks.layout.world_size)
    try:
        ctx = init_job(ranks)  # what shard_worker does first with its argument
        assert dist.get_world_size(ctx.tp_group()) == ranks.layout.tp == 2
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
    assert type(job.layout.tp) is int and (job.layout.tp, job.layout.dp) == (2, 2)
    _fake_world(job.layout.world_size)
    try:
        ctx = init_job(job)  # the script's init_from_env()
        found = current_tp_group(launched["env"])  # parallelize's default: the mesh's group, not a new one
        assert found is ctx.tp_group() and dist.get_world_size(found) == 2
    finally:
        dist.destroy_process_group()
