"""Every file of a checkpoint has a CRC-32 in the manifest, taken as it was written; a load checks them first:
a byte flipped inside a tensor's data (which DCP's metadata and the file sizes cannot show) is refused, named,
before any value is used."""
from __future__ import annotations

import json
import zlib

import xxhash
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import autotp
from autotp.distributed.launch import init_distributed
from autotp.errors import CheckpointError
from autotp.io.ckpt_io import check_resumable, load_training_state, save_training_state
from recompute_models import build


@pytest.fixture
def saved(tmp_path: Path):
    """A checkpoint of a small model, saved by a one-rank job; (path, the model, its optimizer, context)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = init_distributed(1)
        model, (idx, targets) = build("layer", recompute=False)
        tpm = autotp.parallelize(model, example_inputs=((idx, targets), {}))
        opt = torch.optim.AdamW(tpm.parameters())
        tpm(idx, targets)[1].backward()
        opt.step()
        yield save_training_state(tmp_path, 1, tpm, opt, ctx), tpm, opt, ctx
    finally:
        dist.destroy_process_group()


def test_the_manifest_holds_each_files_checksum(saved):
    path, tpm, opt, ctx = saved
    files = json.loads((path / "autotp.json").read_text())["files"]
    written = sorted(p.name for p in path.iterdir() if p.name != "autotp.json")
    assert sorted(files) == written and ".metadata" in files
    for name, d in files.items():  # taken while writing: the same as reading the file back
        data = (path / name).read_bytes()
        assert d == {"xxh3_64": xxhash.xxh3_64(data).intdigest(), "bytes": len(data)}, name
    assert load_training_state(path, tpm, opt, ctx).step == 1


def test_a_manifest_with_crc32_digests_is_checked_with_them(saved):
    """Manifests written before XXH3 carry CRC-32s: still checked, still refusing a changed file."""
    path, tpm, opt, ctx = saved
    info = json.loads((path / "autotp.json").read_text())
    info.pop("manifest_crc32")
    info["files"] = {name: {"crc32": zlib.crc32((path / name).read_bytes()), "bytes": d["bytes"]}
                     for name, d in info["files"].items()}
    (path / "autotp.json").write_text(json.dumps(info))
    assert load_training_state(path, tpm, opt, ctx).step == 1
    shard = path / "__0_0.distcp"
    _flip(shard, shard.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp does not match its checksum \(crc32"):
        load_training_state(path, tpm, opt, ctx)


def _flip(file: Path, where: int) -> None:
    data = bytearray(file.read_bytes())
    data[where:where + 64] = bytes(b ^ 0xFF for b in data[where:where + 64])
    file.write_bytes(bytes(data))


def test_a_flipped_byte_is_refused_before_any_value_is_used(saved):
    path, tpm, opt, ctx = saved
    shard = path / "__0_0.distcp"
    _flip(shard, shard.stat().st_size // 2)  # inside the tensors' data: sizes and metadata unchanged
    before = {n: p.detach().clone() for n, p in tpm.named_parameters()}
    with pytest.raises(CheckpointError, match=f"{shard} does not match its checksum"):
        load_training_state(path, tpm, opt, ctx)
    assert all(torch.equal(p, before[n]) for n, p in tpm.named_parameters())


def test_a_tampered_metadata_file_is_refused_before_any_rank_starts(saved):
    path = saved[0]
    _flip(path / ".metadata", 16)
    with pytest.raises(CheckpointError, match=r"\.metadata does not match its checksum"):
        check_resumable(path.parent.parent)


def test_a_nonsense_digest_table_is_named(saved):
    path, tpm, opt, ctx = saved
    info = json.loads((path / "autotp.json").read_text())
    info["files"] = {"../escape": {"crc32": 1, "bytes": 2}}
    info.pop("manifest_crc32")  # as a manifest rewritten whole would: its own checksum refuses any edit first
    (path / "autotp.json").write_text(json.dumps(info))
    with pytest.raises(CheckpointError, match="the digest of '../escape'"):
        load_training_state(path, tpm, opt, ctx)


@pytest.mark.parametrize("edit, says", [
    ({"optimizer": "bogus"}, "its optimizer entry is str 'bogus'"),
    ({"tp": 8}, "says tp 8 × dp 1 × pp 1 on 1 ranks, but the folder holds the files of ranks [0]"),
    ({"tp": 8, "world_size": 8}, None),  # consistent with itself and the files: nothing to contradict it
])
def test_the_manifest_is_checked_against_itself_and_the_files(saved, edit: dict, says: str | None):
    from autotp.io.ckpt_io import read_manifest

    path = saved[0]
    info = json.loads((path / "autotp.json").read_text())
    info.pop("manifest_crc32")
    (path / "autotp.json").write_text(json.dumps({**info, **edit}))
    if says is None:
        assert read_manifest(path)["tp"] == 8
        return
    with pytest.raises(CheckpointError, match=says.replace("[", r"\[").replace("]", r"\]")):
        read_manifest(path)


def test_every_flipped_byte_of_the_manifest_is_refused(saved):
    """The manifest carries the checksum of its own content: a byte flipped anywhere in it either breaks the
    JSON or changes a value, and both are refused by name; none loads as a different manifest."""
    from autotp.io.ckpt_io import read_manifest

    path = saved[0]
    file = path / "autotp.json"
    good = file.read_bytes()
    assert read_manifest(path)["manifest_crc32"]
    for i in range(len(good)):
        file.write_bytes(good[:i] + bytes([good[i] ^ 0x01]) + good[i + 1:])
        with pytest.raises(CheckpointError, match="autotp.json"):
            read_manifest(path)
    file.write_bytes(good)


def test_a_manifest_step_that_is_not_the_datas_is_refused(saved):
    from autotp.io.ckpt_digest import manifest_digest
    from autotp.io.ckpt_io import load_training_state

    path, tpm, opt, ctx = saved
    info = json.loads((path / "autotp.json").read_text())
    info["step"] = 7
    info["manifest_crc32"] = manifest_digest(info)  # rewritten consistently: only the data can contradict it
    (path / "autotp.json").write_text(json.dumps(info))
    with pytest.raises(CheckpointError, match="says step 7, its data holds step 1"):
        load_training_state(path, tpm, opt, ctx)


def test_a_failed_save_says_why_and_keeps_the_last_checkpoint(saved, tmp_path: Path, monkeypatch):
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    import autotp.io.ckpt_io as ckpt_io
    from autotp.io.ckpt_io import resume_target

    first, tpm, opt, ctx = saved

    def full_disk(*args, **kwargs):
        raise CheckpointException("save", {0: (OSError(errno.ENOSPC, "No space left on device"), None)})

    monkeypatch.setattr(ckpt_io.dcp, "save", full_disk)
    with pytest.raises(CheckpointError) as err:
        ckpt_io.save_training_state(tmp_path, 2, tpm, opt, ctx, run="r")
    assert str(err.value).splitlines()[0] == \
        f"cannot save step 2 to {tmp_path / 'checkpoints' / '.tmp-step-000002'}: No space left on device (ENOSPC)"
    assert "step-000001" in str(err.value)  # the hint names the checkpoint still published
    assert resume_target(tmp_path) == first
