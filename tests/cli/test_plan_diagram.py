"""``autotp plan --svg``: a diagram of the rank grid and of each layer's sharding (autotp.cli.diagram), where
it used to save rich's picture of the terminal's tables. One process: plans are made on meta tensors."""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

from autotp.cli.diagram import draw
from autotp.cli.main import app
from autotp.distributed.rank_grid import RankGrid
from ranks import ROOT

NANOGPT = os.path.join(ROOT, "examples", "nanogpt.py")
SVG = "{http://www.w3.org/2000/svg}"
PAIRS = {"attn.c_attn": "column", "attn.c_proj": "row", "mlp.c_fc": "column", "mlp.c_proj": "row"}
runner = CliRunner()
WIDE = {"COLUMNS": "240"}


def _all(root: ET.Element, cls: str) -> list[ET.Element]:
    return [e for e in root.iter() if e.get("class") == cls]


def _texts(e: ET.Element) -> list[str]:
    return [t.text or "" for t in e.iter(f"{SVG}text")]


def _layers(root: ET.Element) -> dict[str, ET.Element]:
    return {e.get("data-module"): e for e in _all(root, "layer")}


def _colls(layer: ET.Element) -> set[tuple[str, str, str]]:
    return {(c.get("data-kind"), c.get("data-direction"), c.get("data-side")) for c in _all(layer, "collective")}


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """tp 2 × dp 2 × pp 2 on nodes of 4 GPUs, drawn by the command."""
    path = tmp_path_factory.mktemp("diagram") / "plan.svg"
    result = runner.invoke(app, ["plan", NANOGPT, "--tp", "2", "--dp", "2", "--pp", "2", "--gpus-per-node", "4",
                                 "--svg", str(path)], env=WIDE)
    return path, result


@pytest.fixture(scope="module")
def nanogpt():
    from autotp.parallel.planning import plan_file

    return plan_file(NANOGPT, 2, cache=False)


def test_cli_writes_a_diagram_and_says_where(staged) -> None:
    path, result = staged
    assert result.exit_code == 0, result.output
    # one line through the console: the path, the ranks and the modules described
    assert f"wrote diagram {path} (8 ranks, 16 modules)" in result.stdout
    root = ET.parse(path).getroot()
    # rich's save_svg drew the terminal: a <svg class="rich-terminal"> of text, no rank cells
    assert root.tag == f"{SVG}svg" and root.get("class") != "rich-terminal"
    ranks = _all(root, "rank")
    assert len(ranks) == 8
    for cell in ranks:
        t, d, p = (int(cell.get(f"data-{k}")) for k in ("tp", "dp", "pp"))
        r = (p * 2 + d) * 2 + t  # Megatron's order: tp innermost, then dp, then pp
        assert int(cell.get("data-rank")) == r and _texts(cell) == [f"r{r}", f"({t},{d},{p})"]
    # one box per pipeline rank, naming its stage's blocks; a dashed box per node of 4 ranks
    assert [s.get("data-pp") for s in _all(root, "stage")] == ["0", "1"]
    assert any("pp 1 · stage 1: transformer.h.1 + final norm, LM head, loss" in t for t in _texts(root))
    nodes = _all(root, "node")
    assert len(nodes) == 8 // 4
    assert [n.find(f"{SVG}title").text for n in nodes] == ["node 0: ranks 0–3", "node 1: ranks 4–7"]


def test_every_pair_is_cut_column_then_row_with_its_all_reduces(staged) -> None:
    layers = _layers(ET.parse(staged[0]).getroot())
    for b in (0, 1):  # one block per stage: not folded
        for module, role in PAIRS.items():
            layer = layers[f"transformer.h.{b}.{module}"]
            assert layer.get("data-role") == role
            cut = "col dim 0 /2" if role == "column" else "row dim 1 /2"
            assert any("weight " in t and cut in t for t in _texts(layer)), _texts(layer)
            # f: the column's input gradient summed backward; g: the row's output summed forward
            side = ("all_reduce", "backward", "in") if role == "column" else ("all_reduce", "forward", "out")
            assert _colls(layer) == {side}
    assert "weight 192×64 → col dim 0 /2: 96×64" in _texts(layers["transformer.h.0.attn.c_attn"])
    assert layers["transformer.wte"].get("data-role") == "vocab"
    assert _colls(layers["loss (vocab-parallel cross-entropy)"]) == {("all_reduce", "forward", "out")}


def test_identical_blocks_fold(nanogpt) -> None:
    grid = RankGrid.build(2, 2)
    root = ET.fromstring(draw("autotp plan <a & b>", nanogpt.plan, nanogpt.report, grid, nanogpt.names).svg)
    assert "autotp plan <a & b>" in _texts(root)  # escaped in the file, the same text once parsed
    headers = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "block"]
    assert headers == ["transformer.h.0–1  ×2 (the same shards and collectives)"]
    layers = _layers(root)
    assert {m: layers[f"transformer.h.0–1.{m}"].get("data-role") for m in PAIRS} == PAIRS
    assert len(_all(root, "pair")) == 2  # attn and mlp, drawn once for both blocks
    assert not _all(root, "node")  # no --gpus-per-node, no node boundaries


@pytest.mark.parametrize("tp,dp,pp,gpus", [(2, 2, 2, 4), (2, 4, 1, 2), (2, 3, 1, 4), (1, 4, 2, 8)])
def test_grid_cells_and_nodes(nanogpt, tp, dp, pp, gpus) -> None:
    grid = RankGrid.build(tp * dp * pp, tp, pp=pp, dp=dp, gpus_per_node=gpus)
    drawn = draw("t", nanogpt.plan, nanogpt.report, grid, nanogpt.names)
    root = ET.fromstring(drawn.svg)
    assert drawn.ranks == grid.world_size == len(_all(root, "rank"))
    assert sorted(int(c.get("data-rank")) for c in _all(root, "rank")) == list(range(grid.world_size))
    assert len(_all(root, "node")) == grid.num_nodes == -(-grid.world_size // gpus)


def test_a_large_grid_is_elided(nanogpt) -> None:
    grid = RankGrid.build(2 * 40, 2, dp=40)
    root = ET.fromstring(draw("t", nanogpt.plan, nanogpt.report, grid, nanogpt.names).svg)
    cells = [int(c.get("data-rank")) for c in _all(root, "rank")]
    assert 0 < len(cells) < 40 and 0 in cells and 79 in cells
    assert any(t.startswith("⋮ dp") for t in _texts(root))


def test_sequence_parallel_markers() -> None:
    from autotp.parallel.planning import plan_file

    planned = plan_file(NANOGPT, 2, sequence_parallel=True, cache=False)
    root = ET.fromstring(draw("t", planned.plan, planned.report, RankGrid.build(2, 2), planned.names).svg)
    layers = _layers(root)
    # the columns' input is all-gathered along the sequence, the rows' output reduce-scattered
    assert ("all_gather", "forward", "in") in _colls(layers["transformer.h.0–1.attn.c_attn"])
    assert ("reduce_scatter", "forward", "out") in _colls(layers["transformer.h.0–1.mlp.c_proj"])
    assert any("on s/tp positions" in t for t in _texts(layers["transformer.h.0–1.ln_1"]))


def test_svg_errors_are_one_line(tmp_path) -> None:
    result = runner.invoke(app, ["plan", NANOGPT, "--auto", "--world-size", "4", "--svg", str(tmp_path / "a.svg")],
                           env=WIDE)
    assert result.exit_code == 2 and "--svg and --html draw one layout's plan" in result.output
    missing = tmp_path / "no-such-folder" / "p.svg"
    result = runner.invoke(app, ["plan", NANOGPT, "--tp", "2", "--svg", str(missing)], env=WIDE)
    assert result.exit_code == 2, result.output
    assert "--svg: cannot write" in result.output and "Traceback" not in result.output
