"""Tests of autotp.distributed.rank_grid and the ``autotp layout`` command."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotp.cli.main import app
from autotp.distributed.rank_grid import RankGrid

# Megatron's rank order (README, "Rank grid"): world 16, tp 2, pp 4 (dp 2).
TABLE_16 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "dp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "pp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    "mp": [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]],
    "embedding": [[0, 12], [1, 13], [2, 14], [3, 15]],
}


def test_design_table_16_ranks() -> None:
    grid = RankGrid.build(16, tp=2, pp=4)
    assert grid.groups() == TABLE_16
    assert list(grid.groups()) == ["tp", "dp", "pp", "mp", "embedding"]
    assert grid.tp_groups == TABLE_16["tp"]
    assert grid.dp_groups == TABLE_16["dp"]
    assert grid.pp_groups == TABLE_16["pp"]
    assert grid.mp_groups == TABLE_16["mp"]
    assert grid.embedding_groups == TABLE_16["embedding"]


def test_dp_derived_and_explicit_agree() -> None:
    derived = RankGrid.build(16, tp=2, pp=4)
    assert derived.dp == 2
    assert RankGrid.build(16, tp=2, pp=4, dp=2) == derived
    assert RankGrid.build(8, tp=8).dp == 1
    assert RankGrid.build(12, tp=2, pp=3).dp == 2


def test_every_group_kind_partitions_the_world() -> None:
    grid = RankGrid.build(24, tp=2, pp=3, gpus_per_node=4)
    for kind in ("tp", "dp", "pp", "mp"):
        flat = sorted(r for g in grid.groups()[kind] for r in g)
        assert flat == list(range(24)), kind


def test_coords() -> None:
    grid = RankGrid.build(16, tp=2, pp=4, gpus_per_node=8)
    assert grid.coords(0) == {"tp": 0, "dp": 0, "pp": 0, "node": 0}
    assert grid.coords(3) == {"tp": 1, "dp": 1, "pp": 0, "node": 0}
    assert grid.coords(13) == {"tp": 1, "dp": 0, "pp": 3, "node": 1}
    for r in range(16):
        c = grid.coords(r)
        assert grid.rank(c["tp"], c["dp"], c["pp"]) == r
    assert "node" not in RankGrid.build(16, tp=2, pp=4).coords(5)
    with pytest.raises(ValueError, match="16"):
        grid.coords(16)


def test_pp1_embedding_is_single_stage() -> None:
    grid = RankGrid.build(4, tp=2)
    assert grid.dp == 2
    assert grid.pp_groups == [[0], [1], [2], [3]]
    assert grid.embedding_groups == [[0], [1], [2], [3]]
    assert grid.mp_groups == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
    ("kwargs", "numbers"),
    [
        (dict(world_size=12, tp=2, pp=4), ["12", "2", "4", "8"]),
        (dict(world_size=16, tp=2, pp=1, dp=3), ["16", "2", "3", "6"]),
        (dict(world_size=16, tp=0), ["0", "16"]),
        (dict(world_size=16, tp=-2), ["-2", "16"]),
        (dict(world_size=16, tp=2, pp=-1), ["-1"]),
        (dict(world_size=0, tp=1), ["0"]),
        (dict(world_size=16, tp=2, dp=0), ["0"]),
        (dict(world_size=32, tp=16, gpus_per_node=8), ["16", "8"]),
        (dict(world_size=24, tp=4, gpus_per_node=6), ["4", "6"]),
    ],
)
def test_invalid_combinations_raise_with_numbers(kwargs: dict, numbers: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        RankGrid.build(**kwargs)
    message = str(info.value)
    for n in numbers:
        assert n in message, (n, message)


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ValueError, match="≠ world size 16"):
        RankGrid(world_size=16, tp=2, pp=2, dp=2)


def test_to_dict_and_json_round_trip() -> None:
    grid = RankGrid.build(16, tp=2, pp=4, gpus_per_node=8)
    data = json.loads(grid.to_json())
    assert data == grid.to_dict()
    assert data["groups"] == TABLE_16
    assert (data["world_size"], data["tp"], data["dp"], data["pp"]) == (16, 2, 2, 4)


runner = CliRunner()


def test_cli_json_matches_table() -> None:
    args = ["layout", "--world-size", "16", "--tp", "2", "--pp", "4", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == TABLE_16


def test_cli_world_from_dp() -> None:
    """Without --world-size the world is tp × cp × dp × pp: ``autotp layout --tp 2 --dp 2`` is world 4."""
    result = runner.invoke(app, ["layout", "--tp", "2", "--dp", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tp"] == [[0, 1], [2, 3]] and json.loads(result.stdout)["dp"] == [[0, 2], [1, 3]]
    assert "rank grid" in runner.invoke(app, ["--help"]).stdout


def test_cli_table_output() -> None:
    args = ["layout", "--world-size", "16", "--tp", "2", "--pp", "4", "--gpus-per-node", "8"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "[0,4,8,12]" in result.stdout
    assert "node" in result.stdout


@pytest.mark.parametrize(
    ("args", "numbers"),
    [
        (["--world-size", "12", "--tp", "2", "--pp", "4"], ["12", "8"]),
        (["--world-size", "16", "--tp", "0"], ["0"]),
        (["--world-size", "32", "--tp", "16", "--gpus-per-node", "8"], ["16", "8"]),
        (["--tp", "2"], ["--world-size", "--dp"]),  # no world and no dp to derive it from
        (["--tp", "0", "--dp", "2"], ["tp (0)"]),
    ],
)
def test_cli_invalid_exits_2_without_traceback(args: list[str], numbers: list[str]) -> None:
    result = runner.invoke(app, ["layout", *args])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert "error" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    for n in numbers:
        assert n in result.stderr
    assert result.stdout == ""


def test_cli_keeps_subcommand_name() -> None:
    result = runner.invoke(app, ["--world-size", "16", "--tp", "2"])
    assert result.exit_code != 0
    assert runner.invoke(app, []).exit_code in (0, 2)
    assert "layout" in runner.invoke(app, ["--help"]).stdout


def _mesh_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=30),
    )
    try:
        grid = RankGrid.build(world_size, tp=2, dp=2)
        mesh = grid.device_mesh("cpu")
        got = {
            kind: dist.get_process_group_ranks(mesh.get_group(kind)) for kind in ("tp", "dp")
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_device_mesh_matches_layout_gloo(tmp_path: Path) -> None:
    mp = pytest.importorskip("torch.multiprocessing")
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    world_size = 4
    init_file = tmp_path / "store"
    mp.spawn(
        _mesh_worker,
        args=(world_size, os.fspath(init_file), os.fspath(tmp_path)),
        nprocs=world_size,
        join=True,
    )
    grid = RankGrid.build(world_size, tp=2, dp=2)
    for rank in range(world_size):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["tp"] == next(g for g in grid.tp_groups if rank in g)
        assert got["dp"] == next(g for g in grid.dp_groups if rank in g)
    assert grid.tp_groups == [[0, 1], [2, 3]]
    assert grid.dp_groups == [[0, 2], [1, 3]]


def test_device_mesh_needs_process_group() -> None:
    dist = pytest.importorskip("torch.distributed")
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(RuntimeError, match="init_process_group"):
        RankGrid.build(2, tp=2).device_mesh("cpu")


def test_console_script_runs_the_app_and_keeps_its_exit_code(monkeypatch, capsys) -> None:
    """``autotp`` (pyproject's script) is ``run``: the app, with its exit status, for a good and a bad call."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from autotp.cli.entry import run

    with open(Path(__file__).resolve().parents[2] / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["autotp"] == "autotp.cli.entry:run"
    for args, code in ((["--world-size", "4", "--tp", "2", "--json"], 0), (["--world-size", "3", "--tp", "2"], 2)):
        monkeypatch.setattr(sys, "argv", ["autotp", "layout", *args])
        with pytest.raises(SystemExit) as exit_:
            run()
        assert exit_.value.code == code
    assert json.loads(capsys.readouterr().out)["tp"] == [[0, 1], [2, 3]]
