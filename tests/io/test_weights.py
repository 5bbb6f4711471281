"""Models built on meta and loaded straight into their shards (issue 12): Hugging Face safetensors (one file,
a folder, a sharded index), torch.distributed.checkpoint and torch files, at tp 4, 2 and 1; outputs and one
AdamW step against the unsharded model loaded the ordinary way; exports reloaded bit-identically."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file, save_model

import autotp
from autotp.errors import CheckpointError
from ranks import launch, reusing
from small_models import gpt2
from weights_workers import HF, MODELS, TOL, build, load_formats, reload_exports


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    """Each model (seed 0) saved the ordinary ways: Hugging Face ``save_pretrained`` (GPT-2 in 32 KiB shards
    with an index, Llama in one file) or safetensors' ``save_model`` (nanoGPT, one file), ``torch.save`` of
    its state dict, and ``dcp.save`` of it."""
    root = tmp_path_factory.mktemp("weights")
    for name in MODELS:
        model = build(name)[0]
        base = root / name
        base.mkdir()
        if name in HF:
            model.save_pretrained(base / "hf", max_shard_size="32KB" if name == "gpt2" else "1GB")
        else:
            save_model(model, str(base / "model.safetensors"))
        torch.save(model.state_dict(), base / "state.pt")
        dcp.save(model.state_dict(), checkpoint_id=str(base / "dcp"), no_dist=True)
    assert (root / "gpt2" / "hf" / "model.safetensors.index.json").is_file()
    assert (root / "llama" / "hf" / "model.safetensors").is_file()
    return str(root)


@pytest.fixture(scope="module")
def at_tp4(root) -> dict:
    return launch(reusing(load_formats), 4, root)


@pytest.mark.slow
def test_meta_model_loads_every_format_at_tp4(at_tp4) -> None:
    for rank, results in at_tp4.items():
        for name, r in results.items():
            assert r["tp"] == 4
            assert r["held"] < r["full"] / 3, (name, r["held"], r["full"])  # only the local shards were allocated
            assert "has no values yet" in r["refused"], r["refused"]
            assert set(r["formats"]) == {"safetensors", "torch", "dcp", "safetensors-mmap", "torch-mmap"}
            for fmt, f in r["formats"].items():
                assert f["differ"] == [], (rank, name, fmt, f["differ"])
                assert f["outputs"] <= TOL, (rank, name, fmt, f["outputs"])
                # mapped: the tensors whose slice is one run of the file (not GPT-2's Conv1D columns, not
                # nanoGPT's fused q|k|v segments, not row shards); the rest copied
                assert (f["mapped"] > 0) == fmt.endswith("-mmap"), (name, fmt, f["mapped"])
                assert f["mapped"] < f["tensors"], (name, fmt, f["mapped"], f["tensors"])
            # the AdamW step ran on views of the files' copy-on-write mappings: the files are as they were
            assert r["files_unchanged"]
            bytes_read = {f["bytes"] for f in r["formats"].values()}
            assert len(bytes_read) == 1, bytes_read  # each format reads exactly this rank's slices
            assert r["step"]["loss"] <= TOL and r["step"]["params"] <= 1e-4, (rank, name, r["step"])
            # 2 kv heads over 4 ranks: each k/v block is read (and held) by two ranks
            assert (len(r["kv_replicated"]) == 4) == (name == "llama"), r["kv_replicated"]


@pytest.mark.slow
def test_exports_are_the_full_trained_model(root, at_tp4) -> None:
    from transformers import AutoConfig

    for name in MODELS:
        base = os.path.join(root, name)
        want = torch.load(os.path.join(base, "trained.pt"), weights_only=True)
        files = sorted(os.listdir(os.path.join(base, "export")))
        assert "model.safetensors.index.json" in files and len(files) > 2, files
        written = {}
        for f in files:
            if f.endswith(".safetensors"):
                written.update(load_file(os.path.join(base, "export", f)))
        tied = {k for k in want if k not in written}
        assert tied == ({"lm_head.weight"} if name != "llama" else set()), tied  # tied weights written once
        assert all(torch.equal(written[k], want[k]) for k in written)
        state = torch.load(os.path.join(base, "export.pt"), weights_only=True)
        assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
        if name in HF:  # Hugging Face reads the export as its own
            AutoConfig.from_pretrained(os.path.join(base, "hf")).save_pretrained(os.path.join(base, "export"))
            model = type(build(name)[0]).from_pretrained(os.path.join(base, "export"))
            assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
@pytest.mark.extended
def test_checkpoint_and_exports_reload_at_tp2_and_tp1(root, at_tp4) -> None:
    for rank, results in launch(reusing(reload_exports), 2, root).items():
        assert {tp for _, tp, _ in results} == {1, 2}
        for (name, tp, fmt), r in results.items():
            assert r["kind"] == {"autotp": "dcp", "export": "safetensors", "export.pt": "torch"}[fmt]
            assert r["differ"] == [], (rank, name, tp, fmt, r["differ"])
            assert r["outputs"] <= TOL, (rank, name, tp, fmt, r["outputs"])


# -- one process, no group: unsharded models, names, errors ---------------------------------------------
@pytest.mark.slow
def test_unsharded_meta_model_reads_autotp_segments_and_hf_base_checkpoints(root, at_tp4, tmp_path) -> None:
    want = torch.load(os.path.join(root, "nanogpt", "trained.pt"), weights_only=True)
    with autotp.empty_weights():
        model = build("nanogpt")[0]
    loaded = autotp.load_weights(model, os.path.join(root, "nanogpt", "autotp"))  # q|k|v stored per segment
    assert loaded.kind == "dcp" and all(torch.equal(model.state_dict()[k], want[k]) for k in want)
    hub = build("gpt2")[0]
    # as the Hub's GPT-2 stores it: base-model keys (h.0..., no "transformer."), and the causal masks the model
    # no longer holds and declares it does not own (attn.bias)
    state = {k: v.clone() for k, v in hub.transformer.state_dict().items()}
    state.update({f"h.{i}.attn.bias": torch.ones(1, 1, 64, 64).tril() for i in range(2)})
    save_file(state, str(tmp_path / "base.safetensors"))
    with autotp.empty_weights():
        fresh = build("gpt2", seed=3)[0]
    autotp.load_weights(fresh, tmp_path / "base.safetensors")
    assert all(torch.equal(v, hub.state_dict()[k]) for k, v in fresh.state_dict().items())


def test_mismatched_checkpoints_fail_naming_the_keys(root) -> None:
    with autotp.empty_weights():
        llama = build("llama")[0]
    with pytest.raises(CheckpointError) as e:
        autotp.load_weights(llama, os.path.join(root, "nanogpt", "state.pt"))
    text = str(e.value)
    assert "missing (model.embed_tokens.weight" in text and "unexpected (transformer.h.0.attn.c_attn.bias" in text
    with autotp.empty_weights():
        wider = gpt2(vocab=128)[0]
    with pytest.raises(CheckpointError, match=r"transformer.wte.weight is \(97, 64\) in the checkpoint, \(128, 64\)"):
        autotp.load_weights(wider, os.path.join(root, "gpt2", "hf"))
    with torch.device("meta"):  # wholly on meta: the rotary table has no values, and no checkpoint holds it
        bare = build("llama")[0]
    with pytest.raises(CheckpointError, match="model.rotary_emb.inv_freq .* has no values yet"):
        autotp.load_weights(bare, os.path.join(root, "llama", "hf"))
    with pytest.raises(CheckpointError, match="do not exist"):
        autotp.load_weights(llama, os.path.join(root, "nowhere"))


@pytest.mark.slow
def test_cli_shard_loads_weights_and_checks_them_before_launching(root, tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from autotp.cli.main import app
    from ranks import ROOT

    nanogpt = os.path.join(ROOT, "examples", "nanogpt.py")
    bad = CliRunner().invoke(app, ["shard", nanogpt, "--tp", "2", "--weights", os.path.join(root, "llama", "state.pt")])
    assert bad.exit_code == 2 and "does not match the model" in bad.output and "missing" in bad.output, bad.output
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["shard", nanogpt, "--tp", "2", "--steps", "1", "--out", str(out), "--verify",
                                      "--weights", os.path.join(root, "nanogpt", "model.safetensors")],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parity"]["ok"] and "(safetensors)" in summary["weights"], summary["weights"]


def test_prefault_maps_pages_and_changes_no_value() -> None:
    """load_weights maps a shard's pages in one call before filling it: values stay as they are, and tensors it
    cannot or need not touch (meta, small, strided) are left alone."""
    from autotp.io.empty import PREFAULT_BYTES, prefault

    big = torch.arange(PREFAULT_BYTES // 2, dtype=torch.float32)  # 2 MiB, written: prefault must keep it
    before = big.clone()
    prefault(big)
    assert torch.equal(big, before)
    fresh = torch.empty(PREFAULT_BYTES, dtype=torch.uint8)
    prefault(fresh)
    fresh.fill_(7)
    assert int(fresh.sum()) == 7 * PREFAULT_BYTES
    for t in (torch.empty(3, device="meta"), torch.ones(4), big.view(-1, 2)[:, 0]):
        prefault(t)  # no-ops, no errors
    assert torch.equal(big, before)


def test_mmap_maps_whole_runs_of_the_file_and_copies_the_rest(tmp_path) -> None:
    """One process, no group: mmap=True makes a tensor a view of the file's private mapping where its bytes
    are one run in its own dtype and nothing else views it; the rest are copied; writes never reach the file."""
    import torch.nn as nn

    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    state = {k: v.contiguous() for k, v in src.state_dict().items()}
    state["0.bias"] = state["0.bias"].double()  # another dtype than the model's: converted by a copy
    save_file(state, str(tmp_path / "m.safetensors"))
    raw = (tmp_path / "m.safetensors").read_bytes()
    with autotp.empty_weights():
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    loaded = autotp.load_weights(model, tmp_path / "m.safetensors", mmap=True)
    assert loaded.tensors == 4 and loaded.mapped == 3, loaded
    assert loaded.bytes_read == sum(v.nbytes for v in state.values())  # the copied one counted once
    assert all(torch.equal(model.state_dict()[k], v.float()) for k, v in state.items())

    def in_file(t: torch.Tensor) -> bool:
        with open("/proc/self/maps") as f:
            spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in f if "m.safetensors" in line]
        return any(a <= t.data_ptr() < b for a, b in spans)

    assert [in_file(p) for p in model.parameters()] == [True, False, True, True]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()  # writes every parameter: the pages written are the process's own copies
    assert not torch.equal(model[0].weight, state["0.weight"])
    assert (tmp_path / "m.safetensors").read_bytes() == raw
    # a tensor something else views keeps its storage (the view would go on reading the old one): copied
    with autotp.empty_weights():
        again = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    from autotp.io.empty import allocate_meta

    allocate_meta(again, torch.device("cpu"))
    held = again[2].weight.t()  # (16, 4) -> (4, 16): a view, as a model caching a transpose holds one
    loaded = autotp.load_weights(again, tmp_path / "m.safetensors", mmap=True)
    assert loaded.mapped == 2 and torch.equal(held, state["2.weight"].t())
