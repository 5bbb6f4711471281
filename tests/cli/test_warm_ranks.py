"""Warm ranks (autotp/distributed/warm.py, cli/entry.py): ``autotp shard`` and ``autotp profile`` start a fork
server that imports the ranks' modules while the command imports and checks; their ranks are forked from it
with the environment a spawned rank would have had; every other command, and ``--help``, starts none."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from autotp.cli.entry import RANK_MODULES, rank_modules

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUPPORT = os.path.join(ROOT, "tests", "support")


@pytest.mark.parametrize("argv, want", [
    (["shard", "examples/nanogpt.py", "--tp", "2"], RANK_MODULES["shard"]),
    (["profile", "--tp", "2"], RANK_MODULES["profile"]),
    (["shard", "--help"], ()),
    (["shard", "m.py", "--tp", "2", "--help"], ()),
    (["run", "train.py", "--tp", "2"], ()),  # the user's script: its ranks import what it imports
    (["plan", "examples/nanogpt.py", "--tp", "2"], ()),
    (["--help"], ()),
    ([], ()),
])
def test_only_commands_that_launch_autotp_functions_warm_ranks(argv, want):
    assert rank_modules(argv) == want


def test_the_shard_ranks_preload_the_module_of_the_function_they_run():
    from autotp.cli.shard_worker import shard_worker
    from autotp.search.profile import profile_worker

    assert RANK_MODULES["shard"][0] == shard_worker.__module__
    assert RANK_MODULES["profile"][0] == profile_worker.__module__


DRIVER = f"""
import json, os, sys
sys.path.insert(0, {SUPPORT!r})
import multiprocessing.forkserver as fs
from autotp.distributed.launch import LaunchSpec, launch
from autotp.distributed.warm import warm_ranks, warmed
import warm_workers

if __name__ == "__main__":
    spec = LaunchSpec(tp=2, device="cpu", bind_cores=False)
    spawned = launch(spec, warm_workers.report)  # no server: spawned as before
    assert not warmed("warm_workers")
    os.environ["WARM_EARLY"] = "server"  # in the server's environment, gone from the launcher's by the launch
    assert warm_ranks(["warm_workers", "autotp.parallel.parallelize"])
    del os.environ["WARM_EARLY"]
    os.environ["WARM_LATE"] = "launcher"  # set after the server started
    forked = launch(spec, warm_workers.report)
    print(json.dumps({{"me": os.getpid(), "server": fs._forkserver._forkserver_pid, "spawned": spawned,
                      "forked": forked}}))
"""


@pytest.mark.slow
def test_warm_ranks_fork_from_the_server_with_the_launchers_environment(tmp_path):
    """The same launch, spawned and then warm: forked from the server (its child), the runtime already
    imported, with the launcher's variables (tp, the progress folder, threads per rank), the rest of its
    environment as it is at the launch (not as it was when the server started) and working folder as the
    spawned ranks have them."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([SUPPORT, env.get("PYTHONPATH", "")])  # the server imports by it
    proc = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    spawned, forked = out["spawned"], out["forked"]
    assert sorted(spawned) == sorted(forked) == ["0", "1"]
    for rank in spawned:
        s, f = spawned[rank], forked[rank]
        assert s["ppid"] == out["me"] and f["ppid"] == out["server"] != out["me"]
        assert f["preloaded"] and not s["preloaded"]
        assert f["tp"] == s["tp"] == 2 and f["omp"] == s["omp"] and f["threads"] == s["threads"] == int(s["omp"])
        assert f["progress"] and s["progress"] and f["progress"] != s["progress"]  # each launch its own folder
        assert f["cwd"] == s["cwd"] == str(tmp_path)
        assert f["late"] == "launcher" and f["early"] is None  # the launcher's environment now


def _failure(exitcode: int, message: str = "", timestamp: int = 0):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=100, exitcode=exitcode, error_file="<N/A>")
    failure.message = {"message": message} if message else ""
    failure.timestamp = timestamp
    return failure


@pytest.mark.parametrize("failures, root", [
    # a rank killed (SIGKILL) while its peer recorded the lost connection first (how a forked rank's death
    # often reaches the agent): the killed rank
    ({0: _failure(1, "RuntimeError: Connection closed by peer", 0), 1: _failure(-9, timestamp=1)}, 1),
    # an error of its own beats a kill and a lost peer
    ({0: _failure(-9), 1: _failure(1, "ValueError: bad batch", 5), 2: _failure(1, "Connection reset", 0)}, 1),
    # the agent's SIGTERM to the others is not a cause; a recorded timeout is
    ({0: _failure(1, "no peer answered within --timeout 3 s", 3), 1: _failure(-15, timestamp=0)}, 0),
    # a script's own exit code (sys.exit(3)) beats the agent's SIGTERM to its peer in the same second
    ({0: _failure(-15, timestamp=4), 1: _failure(3, timestamp=4)}, 1),
    # otherwise the earliest, then the lowest rank
    ({0: _failure(-9, timestamp=2), 1: _failure(-9, timestamp=1), 2: _failure(-9, timestamp=1)}, 1),
])
def test_the_root_failure_is_the_cause_not_the_first_seen(failures, root):
    from autotp.distributed.launch import root_failure

    assert root_failure(failures)[0] == root
