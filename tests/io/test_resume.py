"""Resuming training at another layout (issue 15): a checkpoint saved at tp 2 after 3 AdamW steps resumes
at tp 1, 2 and 4 and at tp 2 × dp 2, and 3 more steps land where 6 uninterrupted steps at tp 2 do; and a
tampered checkpoint is refused, naming the file, with nothing in it run."""
from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autotp.errors import AutotpError, CheckpointError
from ranks import launch, reusing
from resume_workers import MODELS, SAVE_TP, resume_only, save_then_resume

TOL = 1e-5


def _resumed(out: Path, names: tuple[str, ...]) -> dict:
    # two launches: the save (and the resumes a world of 2 holds), then the resumes that need 4 ranks
    results = launch(reusing(save_then_resume), 2, str(out), (2, 1), names)[0]
    for name, got in launch(reusing(resume_only), 4, str(out), (4, 2), names)[0].items():
        results[name].update(got)
    return results


# Llama with 2 kv heads (replicated at tp 4) in the default run; the padded vocabulary, Falcon's fused groups and
# stacked experts in the extended run
CORE = ("llama_gqa",)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    return _resumed(tmp_path_factory.mktemp("resume"), CORE)


@pytest.fixture(scope="module")
def resumed_rest(tmp_path_factory) -> dict:
    return _resumed(tmp_path_factory.mktemp("resume-rest"), tuple(m for m in MODELS if m not in CORE))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("model", [m if m in CORE else pytest.param(m, marks=pytest.mark.extended) for m in MODELS])
def test_resume_at_any_layout_matches_uninterrupted_training(request, model) -> None:
    runs = request.getfixturevalue("resumed" if model in CORE else "resumed_rest")[model]
    reference = runs.pop("reference")
    assert set(runs) == {(1, 2), (2, 1), (4, 1), (2, 2)}
    diffs = {}
    for (tp, dp), run in sorted(runs.items()):
        assert run["step"] == 3
        diffs[(tp, dp)] = _max_diff(run["state"], reference)
        if (tp, dp) == (SAVE_TP, 1):
            assert run["note"] == "tp 2 × dp 1, as saved: nothing resharded"
        elif dp == 1:
            assert run["note"] == f"resumed from tp 2 → tp {tp}: weights and optimizer state resharded"
        else:
            assert "weights and optimizer state" in run["note"] and f"dp {dp}" in run["note"]
    print(f"\n{model}: max |Δparam| after resuming vs 6 uninterrupted steps at tp 2: "
          + ", ".join(f"tp {tp} × dp {dp}: {d:.1e}" for (tp, dp), d in diffs.items()))
    assert max(diffs.values()) <= TOL, diffs


# -- tampered checkpoints, in this process (a group of one) ------------------------------------------------
class _Payload:
    """Unpickling this creates ``path``: what a malicious checkpoint would do, made visible."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import nanogpt

    import autotp
    from autotp.io.ckpt_io import latest_checkpoint, save_training_state
    from autotp.distributed.launch import init_distributed

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = init_distributed(tp=1)
        args = nanogpt.example_batch()
        tpm = autotp.parallelize(nanogpt.GPT(nanogpt.GPTConfig(n_layer=1)), tp_group=ctx.tp_group(),
                                 example_inputs=args)
        opt = torch.optim.AdamW(tpm.parameters(), lr=1e-3)
        tpm(*args)[1].backward()
        opt.step()
        run = tmp_path_factory.mktemp("tampered")
        save_training_state(run / "good", 1, tpm, opt, ctx)
        yield run, latest_checkpoint(run / "good"), tpm, opt, ctx
    finally:
        dist.destroy_process_group()


def _copy(saved, name: str) -> Path:
    """A copy of the good checkpoint without its checksums (as one written before them, or whose manifest was
    rewritten too), so that the checks behind them are what refuses the tampering below
    (tests/io/test_ckpt_digest.py tests the checksums)."""
    run, good, *_ = saved
    dest = run / name
    shutil.copytree(good, dest)
    info = json.loads((dest / "autotp.json").read_text())
    info.pop("files", None)
    info.pop("manifest_crc32", None)
    (dest / "autotp.json").write_text(json.dumps(info))
    return dest


def _refused(saved, path: Path) -> CheckpointError:
    from autotp.io.ckpt_io import load_training_state

    _, _, tpm, opt, ctx = saved
    with pytest.raises(CheckpointError) as e:
        load_training_state(path, tpm, opt, ctx)
    assert isinstance(e.value, AutotpError)
    return e.value


def test_malicious_metadata_pickle_runs_nothing(saved, tmp_path: Path) -> None:
    from autotp.io.ckpt_safety import read_metadata

    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Payload(probe)))  # the payload is live: plain unpickling runs it
    assert probe.exists()

    marker = tmp_path / "pwned"
    whole = _copy(saved, "whole")
    (whole / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    err = _refused(saved, whole)
    assert str(whole / ".metadata") in str(err) and "refers to io.open" in str(err)
    # the payload hidden inside otherwise valid metadata
    nested = _copy(saved, "nested")
    meta = read_metadata(nested)
    meta.storage_meta = _Payload(marker)
    (nested / ".metadata").write_bytes(pickle.dumps(meta))
    assert str(nested / ".metadata") in str(_refused(saved, nested))
    assert not marker.exists()


def test_pickled_entry_is_refused(saved) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from autotp.io.ckpt_safety import read_metadata

    # DCP's own planner would torch.load(weights_only=False) an entry its metadata calls bytes
    path = _copy(saved, "bytes")
    meta = read_metadata(path)
    meta.state_dict_metadata["train.step"] = BytesStorageMetadata()
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    err = _refused(saved, path)
    assert "train.step is stored as a pickled object" in str(err) and str(path / ".metadata") in str(err)


def test_truncated_shard_is_refused(saved) -> None:
    path = _copy(saved, "truncated")
    shard = next(path.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    err = _refused(saved, path)
    assert f"{shard} is truncated" in str(err)


def test_metadata_of_another_model_is_refused(saved) -> None:
    import torch.distributed.checkpoint as dcp

    run, *_ = saved
    other = run / "other"
    dcp.save({"model": torch.nn.Linear(4, 4).state_dict()}, checkpoint_id=str(other))
    path = _copy(saved, "foreign")
    shutil.copy(other / ".metadata", path / ".metadata")
    err = _refused(saved, path)
    assert str(path / ".metadata") in str(err) and "does not match this model" in str(err)


def test_untouched_copy_loads(saved) -> None:
    from autotp.io.ckpt_io import load_training_state

    _, _, tpm, opt, ctx = saved
    resumed = load_training_state(_copy(saved, "intact"), tpm, opt, ctx)
    assert resumed.step == 1 and not resumed.resharded
