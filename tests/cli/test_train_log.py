"""The training log of ``autotp shard``: the metrics file, the logger hook, MFU and memory (no processes)."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from autotp.capture.modelfile import ModelFileError, load_model_file
from autotp.cli.shard_worker import batch_tokens
from autotp.cli.train_log import StepMetrics, TrainLog, mfu, peak_memory


def _metrics(step: int, **kw) -> StepMetrics:
    base = dict(step=step, loss=5.0 - step / 10, step_s=0.02, tokens=128, tokens_per_s=6400.0,
                tokens_per_s_per_rank=3200.0, grad_norm=1.25, peak_memory=3 << 20, mfu=None, lr=1e-3, elapsed_s=1.0)
    return StepMetrics(**{**base, **kw})


def test_each_record_is_a_json_line_and_reaches_the_hook(tmp_path: Path) -> None:
    seen: list[dict] = []
    log = TrainLog(tmp_path, active=True, hook=seen.append)
    log.record(_metrics(1))
    log.record(_metrics(2, grad_norm=None))
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["grad_norm"] is None
    assert seen == rows  # the hook gets the same record, as a plain dict
    # a resumed run appends to the same file
    TrainLog(tmp_path, active=True).record(_metrics(3))
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_other_ranks_log_nothing(tmp_path: Path) -> None:
    log = TrainLog(tmp_path / "out", active=False, hook=lambda m: pytest.fail("called on a rank that is not 0"))
    log.record(_metrics(1))
    assert not (tmp_path / "out").exists()


def test_the_console_line_says_what_it_knows() -> None:
    line = _metrics(4, mfu=0.4123).line()
    assert line.startswith("step 4 loss 4.6000 grad norm 1.2500 20 ms 6,400 tok/s (3,200/rank)")
    assert "MFU 41.23%" in line and "mem 3.0 MiB" in line
    assert "MFU" not in _metrics(4).line()  # no device peak: left out, not guessed


def test_mfu_is_model_flops_per_second_over_peak() -> None:
    assert mfu(2e12, 0.5, 8e12) == pytest.approx(0.5)
    assert mfu(None, 0.5, 8e12) is None and mfu(2e12, 0.5, None) is None
    assert peak_memory("cpu") > 10 << 20  # this process's peak resident set


def test_tokens_are_the_id_tensors_b_times_s() -> None:
    ids = torch.zeros(4, 32, dtype=torch.long)
    assert batch_tokens((ids, ids), {}) == 128
    assert batch_tokens((), {"input_ids": ids, "labels": ids}) == 128
    assert batch_tokens((torch.zeros(3, 7, 16),), {}) == 21  # embeddings in: b × s of the first tensor


def test_the_model_file_s_log_metrics_is_the_hook(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent("""
        import torch
        seen = []
        def build_model():
            return torch.nn.Linear(2, 2)
        def log_metrics(metrics):
            seen.append(metrics["step"])
    """))
    mf = load_model_file(path)
    TrainLog(tmp_path / "out", active=True, hook=mf.log_metrics).record(_metrics(7))
    assert mf.log_metrics.__globals__["seen"] == [7]
    path.write_text("import torch\nlog_metrics = 3\ndef build_model():\n    return torch.nn.Linear(2, 2)\n")
    with pytest.raises(ModelFileError, match="log_metrics"):
        load_model_file(path)
