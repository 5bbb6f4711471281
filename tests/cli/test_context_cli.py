"""Context parallelism from the command line: ``autotp layout --cp`` places cp between tp and dp, ``autotp
shard --cp`` trains with it and its checkpoints resume at other cp (and tp) sizes exactly, and a batch whose
length 2·cp does not divide is refused before any rank starts."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotp.cli.main import app
from autotp.distributed.rank_grid import RankGrid
from ranks import ROOT
from readme import readme_folder, run_readme

NANOGPT = os.path.join(ROOT, "examples", "nanogpt.py")
runner = CliRunner()


def _shard(*args: str):
    result = runner.invoke(app, ["shard", NANOGPT, *args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result


def test_layout_puts_cp_between_tp_and_dp() -> None:
    """Megatron's order tp, cp, dp, pp: a cp group's ranks are tp apart, a dp group's tp·cp apart."""
    grid = RankGrid.build(16, 2, pp=2, cp=2)
    assert grid.dp == 2 and grid.coords(5) == {"tp": 1, "cp": 0, "dp": 1, "pp": 0}
    assert grid.cp_groups[:2] == [[0, 2], [1, 3]] and grid.dp_groups[:2] == [[0, 4], [1, 5]]
    assert grid.pp_groups[0] == [0, 8] and grid.tp_groups[0] == [0, 1]
    assert "cp" not in RankGrid.build(8, 2).groups()  # without cp, as before
    result = runner.invoke(app, ["layout", "-w", "8", "--tp", "2", "--cp", "2", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(ValueError, match=r"tp \(2\) × cp \(3\) × pp \(1\) = 6 does not divide world size 8"):
        RankGrid.build(8, 2, cp=3)


def test_a_length_2cp_does_not_divide_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    """examples/nanogpt.py's batch has 32 tokens: cp 3 needs multiples of 6."""
    result = runner.invoke(app, ["shard", NANOGPT, "--tp", "1", "--cp", "3", "--out", str(tmp_path / "o")],
                           env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert "sequence length 32 is not divisible by 2·cp = 6 (cp 3)" in result.output
    assert "starting" not in result.output and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_shard_with_cp_resumes_at_other_cp_and_tp_sizes_exactly(tmp_path: Path) -> None:
    """The README's two commands: 2 steps at cp 2, resumed at tp 2 × cp 2 for steps 3-4: the losses of 4
    uninterrupted steps on one rank, within 1e-5; the checkpoint names cp 2, the plan the rings."""
    here = readme_folder(tmp_path / "readme")
    first = run_readme("autotp shard examples/nanogpt.py --tp 1 --cp 2 --steps 2 --out cp", here, columns=200)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "tp 1 × cp 2 × dp 1" in first.stdout and "pass" in first.stdout
    out = here / "cp"
    step2 = json.loads((out / "checkpoints" / "step-000002" / "autotp.json").read_text())
    assert step2["cp"] == 2 and step2["world_size"] == 2
    plan = json.loads((out / "plan.json").read_text())
    assert plan["context"]["cp"] == 2 and len(plan["context"]["attention"]) == 2
    again = run_readme("autotp shard examples/nanogpt.py --tp 2 --cp 2 --steps 4 --out cp --resume", here)
    assert again.returncode == 0, again.stdout + again.stderr
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["cp"] == 2 and resumed["start_step"] == 2 and resumed["parity"]["ok"]
    ref = tmp_path / "ref"
    _shard("--tp", "1", "--steps", "4", "--out", str(ref))
    want = json.loads((ref / "summary.json").read_text())["losses"]
    assert max(abs(a - b) for a, b in zip(resumed["losses"], want[2:])) <= 1e-5, (resumed["losses"], want)


def test_plan_shows_the_rings_and_what_a_rank_keeps_and_receives(tmp_path: Path) -> None:
    """``autotp plan --cp 2``: both attentions of the example (written out) as rings, the activations ÷ cp, and
    K/V per layer 2·b·s·h·(cp−1)/cp elements (fp32) each way."""
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", NANOGPT, "--tp", "1", "--cp", "2", "--no-cache", "--json", str(out)],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "context parallelism: cp 2, each rank runs 16 of the 32 tokens" in result.output
    # tp 1: what cp does and what a rank holds, not a table of 28 weights "tp 1: nothing is sharded" and a tp
    # communication table of h=?, L=0
    text = " ".join(result.stdout.split())
    assert "cp 2, tp 1: no weight is cut" in text and "gradient all-reduce / step │ 120,576 │" in text, text
    assert "h=?" not in text and "nothing is sharded" not in text and "transformer.h.0" not in text, text
    assert "tp collectives" not in text and len(result.stdout.splitlines()) < 40, result.stdout
    c = json.loads(out.read_text())["context"]
    assert (c["rings"], c["causal"], c["written"], c["losses"]) == (2, 2, 2, 1)
    assert c["activation_bytes"] * 2 == c["activation_unsharded"]
    b, s, h = 4, 32, 64
    assert c["kv_bytes"] == 2 * b * s * h * 4 // 2


def test_plan_names_an_op_that_mixes_positions(tmp_path: Path) -> None:
    """A running sum over the sequence cannot run on a chunk: named with its line, before anything runs."""
    path = tmp_path / "cumsum_gpt.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)\n\n"
        "    def forward(self, idx, targets):\n"
        "        x = self.emb(idx).cumsum(1)  # (b, s, h)\n"
        "        q = x.view(x.size(0), x.size(1), 2, 8).transpose(1, 2)\n"
        "        y = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(x.shape)\n"
        "        logits = self.head(y)\n"
        "        return logits, F.cross_entropy(logits.view(-1, 32), targets.view(-1))\n\n\n"
        "def build_model():\n    return M()\n\n\n"
        "def example_batch():\n    return torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)\n")
    result = runner.invoke(app, ["plan", str(path), "--tp", "1", "--cp", "2", "--no-cache"], env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert "aten.cumsum" in result.output and "cumsum_gpt.py:12" in result.output


def test_plan_with_cp_captures_the_model_once(monkeypatch) -> None:
    """``autotp plan --cp 2``: the tensor-parallel plan and the context plan come from one capture."""
    from autotp.parallel import planning

    calls = []
    real = planning.capture
    monkeypatch.setattr(planning, "capture", lambda *a, **k: calls.append(1) or real(*a, **k))
    result = runner.invoke(app, ["plan", NANOGPT, "--tp", "2", "--cp", "2", "--no-cache"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "context parallelism: cp 2, each rank runs 16 of the 32 tokens" in result.output and calls == [1]
