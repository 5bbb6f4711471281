"""Data parallelism by default (autotp/distributed/replicas.py): a parallelized model whose ranks hold
data-parallel replicas averages its gradients over the dp group with torch's DDP, once, whether the script
wraps its own DDP or not; ``autotp run examples/train.py --tp 2 --dp 2`` ends with identical replicas."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotp.errors import ShardingError
from autotp.options import Options
from ranks import ROOT, Launches

TOL = 1e-5


@pytest.mark.parametrize("value,says", [
    ({"process_group": None}, "process_group"), ({"device_ids": [0]}, "device_ids"), (3, "True, False or a dict"),
])
def test_data_parallel_options_are_checked(value, says):
    with pytest.raises(ShardingError, match=says):
        Options(data_parallel=value).validate()


def test_ddp_options_with_fsdp_are_refused():
    from autotp.distributed.data_parallel import FSDPConfig

    with pytest.raises(ShardingError, match="fsdp"):
        Options(fsdp=FSDPConfig(), data_parallel={"bucket_cap_mb": 1}).validate()
    assert Options(data_parallel={"bucket_cap_mb": 1}).validate().data_parallel == {"bucket_cap_mb": 1}


@pytest.fixture(scope="module")
def runs() -> Launches:
    from replica_workers import refused_over_the_world, train

    return Launches({2: {"compile": (train, "compile", 1)},
                     4: {"default": (train, "default"), "off": (train, "off"), "world": (refused_over_the_world,)}},
                    extended={4: {"script": (train, "script"), "context": (train, "context"),
                                  "context, no mesh": (train, "context, no mesh"), "compile": (train, "compile")}},
                    reuse_captures=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode,kind", [("default", "ddp"),
                                       pytest.param("script", "script ddp", marks=pytest.mark.extended)])
def test_replicas_train_as_one_device_on_the_whole_batch(runs, mode: str, kind: str):
    """tp 2 × dp 2, each replica on its own half of each batch, 3 AdamW steps: the gradients (last step) and
    parameters equal the unsharded model's on the whole batch within 1e-5 and are bit-identical across the
    replicas; the dp group all-reduces each rank's gradient elements exactly once per step, bucketed (one
    bucket here), and the tp group carries the same all-reduces as without data parallelism. With the
    script's own DDP over dp, autotp's stays out: still once."""
    got, off = runs(4, mode), runs(4, "off")
    for rank, r in got.items():
        assert r["kind"] == kind, (rank, r["kind"])
        assert max(r["grads"].values()) <= TOL, (rank, r["grads"])
        assert max(r["diffs"].values()) <= TOL, (rank, r["diffs"])
        assert r["identical"] and r["differing"] == 0, (rank, r["differing"])
        for step, calls in enumerate(r["dp_calls"]):
            assert sum(calls) == r["grad_elements"], (rank, step, calls, r["grad_elements"])
            assert 0 < len(calls) < r["params"], (rank, step, calls)
        assert r["tp_calls"] == off[rank]["tp_calls"], rank  # the tp group's traffic is the model's own
        assert all(n < r["grad_elements"] for calls in r["tp_calls"] for _, n in calls)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("mode", ["context", "context, no mesh"])
def test_context_parallel_replicas_sum_over_cp_then_average_over_dp(runs, mode: str):
    """cp 2 × dp 2 (tp 1), on a (dp, cp) mesh or on the groups ``context_parallel=2`` makes alone (the world
    cut into cp groups, the rest replicas): each chunk's gradients summed over cp in the backward, then
    averaged over dp by DDP: one device's numbers on the whole batch, replicas bit-identical, the dp group
    carrying each rank's gradient elements once per step."""
    for rank, r in runs(4, mode).items():
        assert r["kind"] == "ddp" and r["dp_ranks"] == (rank % 2, rank % 2 + 2), (rank, r["kind"], r["dp_ranks"])
        assert max(r["grads"].values()) <= TOL and max(r["diffs"].values()) <= TOL, (rank, r["grads"], r["diffs"])
        assert r["identical"], (rank, r["differing"])
        assert all(sum(calls) == r["grad_elements"] for calls in r["dp_calls"]), (rank, r["dp_calls"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_default_data_parallelism_with_compile(runs, world: int):
    """``compile=True`` at dp 2 (tp 1 on 2 ranks; tp 2 on 4): DDP's hooks average the gradients the compiled
    graph computes, once per step over dp, bucketed; after 3 AdamW steps the replicas are bit-identical and
    equal one device's on the whole batch within 1e-5."""
    for rank, r in runs(world, "compile").items():
        assert r["kind"] == "ddp", (rank, r["kind"])
        assert max(r["grads"].values()) <= TOL and max(r["diffs"].values()) <= TOL, (rank, r["grads"], r["diffs"])
        assert r["identical"] and r["differing"] == 0, (rank, r["differing"])
        for step, calls in enumerate(r["dp_calls"]):
            assert sum(calls) == r["grad_elements"] and 0 < len(calls) < r["params"], (rank, step, calls)


@pytest.mark.slow
def test_without_data_parallelism_the_replicas_drift(runs):
    """``data_parallel=False``: nothing crosses the dp group and the replicas drift apart (what the default
    prevents; the check above can fail)."""
    for rank, r in runs(4, "off").items():
        assert r["kind"] == "off" and r["dp_calls"] == [[], [], []]
        assert not r["identical"] and r["differing"] == r["params"], (rank, r["differing"])
        assert max(r["grads"].values()) > 1e-3


@pytest.mark.slow
def test_a_ddp_over_every_rank_is_refused(runs):
    """A DDP over the whole job at tp 2 would average different shards together: refused at its first call,
    naming the ranks and the fix."""
    for rank, said in runs(4, "world").items():
        assert "[0, 1, 2, 3]" in said and "different tensor-parallel shards" in said, said
        assert "dp_group()" in said, said


WRAPPER = """
import json, runpy, sys
import torch, torch.distributed as dist
import autotp
from autotp.distributed.launch import current_dp_group

sys.argv = [{example!r}, "--steps", "3"]
model = runpy.run_path({example!r}, run_name="__main__")["model"]  # the example as it is
group = current_dp_group()
tensors = [p.detach().reshape(-1) for p in model.parameters()]
flat = torch.cat(tensors)
every = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
dist.all_gather(every, flat, group=group)
split = [e.split([t.numel() for t in tensors]) for e in every]
differ = sum(not all(torch.equal(a, b) for b in rest) for a, *rest in zip(*split))
print("RESULT " + json.dumps({{"rank": dist.get_rank(), "kind": autotp.tp_state(model).replicas.kind,
                              "tensors": len(tensors), "differ": differ}}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.extended
def test_example_script_under_autotp_run_ends_with_identical_replicas(tmp_path: Path):
    """``autotp run examples/train.py --tp 2 --dp 2``, the script unchanged (run by a wrapper that then compares
    the replicas): after its steps every parameter tensor is bit-identical across the data-parallel replicas."""
    wrapper = tmp_path / "replicas.py"
    wrapper.write_text(WRAPPER.format(example=os.path.join(ROOT, "examples", "train.py")))
    cmd = [sys.executable, "-m", "autotp.cli", "run", str(wrapper), "--tp", "2", "--dp", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    decode = json.JSONDecoder().raw_decode
    got = [decode(part)[0] for part in proc.stdout.split("RESULT ")[1:]]
    assert sorted(r["rank"] for r in got) == [0, 1, 2, 3], proc.stdout[-2000:]
    for r in got:
        assert r["kind"] == "ddp" and r["tensors"] > 20 and r["differ"] == 0, r
