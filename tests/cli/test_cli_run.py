"""``autotp run``'s output: every line of every rank prefixed with its rank and never run into another rank's
(torch's tee, autotp.distributed.launch.RankOutput), ``--ranks`` to show some ranks only, ``--log-dir`` to keep
each rank's files. The script is plain Python (no torch), so each run takes a second or two."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotp.cli.main import app

runner = CliRunner()
LINES = 5
# each line written in two pieces, and one of them with a pause longer than the launcher's tailing interval
# (0.1 s) in between: the launcher sees unfinished lines, which must wait for their rest
SCRIPT = f"""
import os, sys, time
rank = os.environ["RANK"]
for i in range({LINES}):
    sys.stdout.write(f"line {{i}} ")
    sys.stdout.flush()
    if i == 2:
        time.sleep(0.3)
    sys.stdout.write(f"of rank {{rank}}\\n")
    sys.stdout.flush()
print(f"warning of rank {{rank}}", file=sys.stderr)
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "lines.py"
    path.write_text(SCRIPT)
    return path


def _lines(text: str) -> list[tuple[str, str]]:
    """(prefix rank, the rank the line says printed it) for each line the script printed; anything else fails."""
    found = []
    for line in text.splitlines():
        m = re.fullmatch(r"\[rank(\d+)\]:line \d of rank (\d+)", line)
        assert m is not None, f"not one whole line of one rank: {line!r}\n{text}"
        found.append(m.groups())
    return found


# autotp's own lines on stderr ("[   0.0 s] check: ..."), the script's stdout left to it
PHASE = re.compile(r"\[\s*\d+\.\d s\] (\w+): ")


def _phases(text: str) -> list[str]:
    return [m[1] for line in text.splitlines() if (m := PHASE.match(line))]


def _said(text: str) -> list[str]:
    """The ranks' lines on stderr, autotp's phase lines left out."""
    return [line for line in text.splitlines() if not PHASE.match(line)]


@pytest.mark.slow
def test_every_line_carries_its_rank(script: Path) -> None:
    result = runner.invoke(app, ["run", str(script), "--tp", "2"])
    assert result.exit_code == 0, result.output
    found = _lines(result.stdout)
    assert all(prefix == said for prefix, said in found), result.stdout
    assert sorted(found) == sorted((r, r) for r in "01" for _ in range(LINES))
    assert _phases(result.stderr) == ["check", "launch"]
    assert sorted(_said(result.stderr)) == ["[rank0]:warning of rank 0", "[rank1]:warning of rank 1"]


@pytest.mark.slow
@pytest.mark.extended
def test_ranks_shows_only_those_ranks(script: Path) -> None:
    result = runner.invoke(app, ["run", str(script), "--tp", "2", "--ranks", "1"])
    assert result.exit_code == 0, result.output
    assert _lines(result.stdout) == [("1", "1")] * LINES
    assert _said(result.stderr) == ["[rank1]:warning of rank 1"]


@pytest.mark.slow
@pytest.mark.extended
def test_log_dir_keeps_each_ranks_files(script: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = runner.invoke(app, ["run", str(script), "--tp", "2", "--log-dir", str(logs)])
    assert result.exit_code == 0, result.output
    (run,) = logs.iterdir()  # torch's folder for this run: <run id>_<random>
    for rank in (0, 1):
        files = run / "attempt_0" / str(rank)
        assert (files / "stdout.log").read_text().splitlines() == [f"line {i} of rank {rank}" for i in range(LINES)]
        assert (files / "stderr.log").read_text() == f"warning of rank {rank}\n"
    assert f"rank logs: {run}" in " ".join(result.stderr.split())  # one line, however wide the terminal


@pytest.mark.parametrize("flags, said", [
    (["--ranks", "0,x"], "--ranks '0,x': give local ranks separated by commas"),
    (["--ranks", "1,2"], "--ranks 1,2: this node runs local ranks 0 to 1, not 2"),
    (["--log-dir", "{script}"], "exists and is not a folder"),
])
def test_bad_output_flags_fail_before_any_rank(script: Path, flags: list[str], said: str) -> None:
    flags = [f.format(script=script) for f in flags]
    result = runner.invoke(app, ["run", str(script), "--tp", "2", *flags], env={"COLUMNS": "500"})
    assert result.exit_code == 2, result.output
    (error,) = _said(result.stderr)  # one line after the check's
    assert error.startswith("error: ") and said in error, result.stderr


def test_world_size_makes_dp_count_every_nodes_replicas(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--world-size W``: --dp counts every node's replicas, as ``autotp shard --world-size`` reads it, so a
    pipeline whose stages sit on different nodes is spelled (tp 2 × dp 1 × pp 4 on 4 nodes of 2); without it --dp
    is one node's (the same flags start 4 × 8 ranks). Sizes that do not multiply to W are refused before any rank
    starts. Nothing is launched: the launch is replaced by a recorder."""
    import autotp.distributed.launch as launching

    specs = []
    monkeypatch.setattr(launching, "launch", lambda spec, *args, **kwargs: specs.append(spec))
    flags = ["run", str(script), "--tp", "2", "--dp", "1", "--pp", "4", "--nnodes", "4",
             "--master-addr", "127.0.0.1", "--master-port", "29999"]
    for extra in (["--world-size", "8"], []):
        result = runner.invoke(app, [*flags, *extra], env={"COLUMNS": "500"})
        assert result.exit_code == 0, result.output
    across, per_node = specs
    assert (across.world_size, across.nproc_per_node, across.data_parallel) == (8, 2, 1)
    assert across.grid.pp_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]  # each stage on its own node
    assert (per_node.world_size, per_node.nproc_per_node, per_node.data_parallel) == (32, 8, 4)
    bad = runner.invoke(app, ["run", str(script), "--tp", "2", "--dp", "3", "--world-size", "4"],
                        env={"COLUMNS": "500"})
    assert bad.exit_code == 2 and len(specs) == 2
    (error,) = _said(bad.stderr)
    assert "--tp 2 × --dp 3 × --pp 1 = 6 ranks, not the --world-size 4" in error and "give --dp 2" in error
