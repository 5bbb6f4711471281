"""The training loops people already use, on a parallelized model: Hugging Face ``Trainer`` under
``autotp run`` (examples/hf_trainer.py) and Lightning Fabric's ``ModelParallelStrategy`` with autotp as its
``parallelize_fn`` (examples/fabric_train.py). Each sharded run is compared with the same example run
unsharded on one process: the same losses and gradient norms step by step, the same samples per step, the
ranks of a tensor-parallel group drawing the same samples and the data-parallel replicas different ones."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ranks import ROOT
from readme import readme_folder, run_readme

EXAMPLES = Path(ROOT, "examples")
TOL = 1e-5  # fp32, the same samples: only the order of the shards' partial sums differs
needs_fabric = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None and importlib.util.find_spec("lightning_fabric") is None,
    reason="Lightning Fabric is not installed (pip install lightning-fabric)")


def _results(stdout: str) -> list[dict]:
    # ranks started by Fabric's own launcher share one pipe: decode each object where it starts
    decode = json.JSONDecoder().raw_decode
    return sorted((decode(part)[0] for part in stdout.split("RESULT ")[1:]), key=lambda r: r["rank"])


def _checked(proc: subprocess.CompletedProcess) -> list[dict]:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return _results(proc.stdout)


def _run(cmd: list[str], cwd: Path) -> list[dict]:
    return _checked(subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd, env=dict(os.environ)))


def _autotp_run(script: str, tmp_path: Path, *flags: str, args: tuple[str, ...] = ()) -> list[dict]:
    return _run([sys.executable, "-m", "autotp.cli", "run", str(EXAMPLES / script), *flags, "--",
                 "--json", *args], tmp_path)


def _unsharded(script: str, batch: int) -> dict:
    """The example on one process without autotp (plain Trainer, Fabric's single-device strategy)."""
    (want,) = _run([sys.executable, str(EXAMPLES / script), "--unsharded", "--batch", str(batch), "--json"],
                   Path(tempfile.gettempdir()))
    return want


def _same_numbers(got: list[dict], want: dict) -> None:
    for r in got:
        assert len(r["losses"]) == len(want["losses"]) == 4
        assert max(abs(a - b) for a, b in zip(r["losses"], want["losses"])) <= TOL, (r["losses"], want["losses"])
        assert max(abs(a - b) for a, b in zip(r["grad_norms"], want["grad_norms"])) <= TOL, \
            (r["grad_norms"], want["grad_norms"])


def _same_samples(got: list[dict], want: dict, tp: int, batch: int) -> None:
    """Ranks of one TP group drew the same indices; the DP replicas' batches of each step are disjoint and
    together are the unsharded run's batch of that step (whose batch is dp × ``batch``)."""
    steps = len(want["losses"])
    replicas = [got[i:i + tp] for i in range(0, len(got), tp)]  # Megatron's order: TP groups of adjacent ranks
    for group in replicas:
        assert all(r["drawn"][:steps * batch] == group[0]["drawn"][:steps * batch] for r in group), \
            [r["drawn"] for r in group]
    dp = len(replicas)
    for s in range(steps):
        per_replica = [g[0]["drawn"][s * batch:(s + 1) * batch] for g in replicas]
        seen = [i for b in per_replica for i in b]
        assert len(set(seen)) == dp * batch, per_replica  # different data on each replica
        assert sorted(seen) == sorted(want["drawn"][s * dp * batch:(s + 1) * dp * batch]), (s, per_replica)


@pytest.mark.slow
def test_hf_trainer_tp2_dp2_matches_unsharded_trainer(tmp_path: Path):
    """``autotp.integrations.Trainer`` at tp 2 × dp 2 (DDP over each data-parallel group) against the unsharded
    Trainer with twice the batch: Trainer's logged losses and gradient norms are the same, the ranks of a TP
    group train on the same samples and the replicas on different halves of each unsharded batch, and
    ``save_model`` writes the full model the unsharded run writes. (``--fsdp`` takes the path through Trainer
    without DDP; FSDP2 under Fabric is tested below.)"""
    from safetensors.torch import load_file

    here = readme_folder(tmp_path / "readme")  # the README's two commands, as written there, plus --json --save
    (want,) = _checked(run_readme("python examples/hf_trainer.py --unsharded --batch 8", here,
                                  "--json", "--save", str(tmp_path / "unsharded")))
    got = _checked(run_readme("autotp run examples/hf_trainer.py --tp 2 --dp 2", here,
                              "--", "--json", "--save", str(tmp_path / "sharded")))
    assert [(r["rank"], r["dp_rank"]) for r in got] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    _same_numbers(got, want)
    _same_samples(got, want, tp=2, batch=4)
    full, ref = (load_file(tmp_path / d / "model.safetensors") for d in ("sharded", "unsharded"))
    assert full.keys() == ref.keys()
    assert all(full[k].shape == ref[k].shape for k in ref)
    # after 4 AdamW steps: Adam's normalised update magnifies the last-bit differences of tiny gradients
    assert max((full[k] - ref[k]).abs().max().item() for k in ref) <= 1e-4


@pytest.mark.slow
@needs_fabric
@pytest.mark.extended
def test_fabric_model_parallel_strategy_tp2_fsdp2_under_autotp_run(tmp_path: Path):
    """tp 2 × dp 2 under ``autotp run`` (Fabric takes the ranks torchelastic started): FSDP2 over Fabric's
    "data_parallel" dim, its data split by Fabric over that dim only."""
    want = _unsharded("fabric_train.py", 8)
    got = _autotp_run("fabric_train.py", tmp_path, "--tp", "2", "--dp", "2")
    assert [r["rank"] for r in got] == [0, 1, 2, 3]
    _same_numbers(got, want)
    _same_samples(got, want, tp=2, batch=4)
