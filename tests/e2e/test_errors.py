"""Bad input gets a clear error naming the culprit, raised before any collective."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import autotp
from autotp.errors import CaptureError, ProcessGroupError, ShardingError


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # Python control flow on a tensor value: export cannot capture it
            return self.fc(x)
        return x


@pytest.fixture
def single_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_no_process_group_says_how_to_start_one():
    assert not dist.is_initialized()
    with pytest.raises(ProcessGroupError) as e:
        autotp.parallelize(nn.Linear(4, 4), example_inputs=(torch.randn(2, 4),))
    assert "init_process_group" in str(e.value) and "torchrun" in str(e.value)
    assert "autotp run train.py --tp 2" in str(e.value)  # autotp's own launcher first


def test_export_failure_shows_reason_and_user_line(single_rank_group):
    with pytest.raises(CaptureError) as e:
        autotp.parallelize(DataDependent(), example_inputs=(torch.randn(2, 3, 8),))
    msg = str(e.value)
    assert "torch.export could not capture DataDependent.forward" in msg
    assert "test_errors.py" in msg and "if x.sum() > 0" in msg


def test_heads_not_divisible_raises_before_any_collective(monkeypatch):
    from nanogpt import GPT, GPTConfig

    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(a))
    fake = type("G", (), {})()
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    with pytest.raises(ShardingError) as e:
        autotp.parallelize(GPT(GPTConfig(n_head=3, n_embd=48)), tp_group=fake)
    assert "transformer.h.0.attn.c_attn" in str(e.value) and "tp=2" in str(e.value)
    assert isinstance(e.value, ValueError)
    assert calls == []


def test_group_of_one_runs_unsharded(single_rank_group):
    from nanogpt import build_model, example_batch

    model = build_model()
    tpm = autotp.parallelize(model, example_inputs=example_batch())
    idx, targets = example_batch()
    assert torch.equal(tpm(idx, targets)[1], model(idx, targets)[1])
    assert autotp.tp_state(tpm).plan.params == ()


def test_cli_shows_export_reason_and_user_line_without_traceback(tmp_path):
    from typer.testing import CliRunner

    from autotp.cli.main import app

    model_py = tmp_path / "dd.py"
    model_py.write_text(
        "import torch, torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.e = nn.Embedding(32, 16); self.fc = nn.Linear(16, 32)\n"
        "    def forward(self, idx):\n"
        "        x = self.e(idx)\n"
        "        if x.sum() > 0:\n"
        "            x = x * 2\n"
        "        return self.fc(x).sum()\n"
        "def build_model(): return M()\n"
        "def example_batch(): return (torch.zeros(2, 8, dtype=torch.long),)\n"
    )
    result = CliRunner().invoke(app, ["shard", str(model_py), "--tp", "2"], env={"COLUMNS": "300"})
    assert result.exit_code == 2
    out = result.output
    said = [line for line in out.splitlines() if not line.startswith("[")]  # after the phase line ("[ 0.0 s] check: …")
    assert out.startswith("[") and said[0].startswith("error: torch.export could not capture M.forward"), out
    assert "dd.py:7" in out and "if x.sum() > 0" in out
    assert "Traceback" not in out and "def forward(self, arg0_1" not in out
