"""Drop-in: a training script written for one device keeps working with one added line, and the
parallelized model is the user's own object (class, attributes, methods, config)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ranks import ROOT, Launches

SCRIPTS = os.path.join(ROOT, "tests", "scripts")
ADDED = "import autotp; model = autotp.parallelize(model)  # the one added line"


def _results(stdout: str) -> list[dict]:
    # two ranks print to one pipe: lines may run into each other, so decode each object where it starts
    decode = json.JSONDecoder().raw_decode
    return [decode(part)[0] for part in stdout.split("RESULT ")[1:]]


def _single_and_under_autotp_run(script: str, tmp_path: Path, env: dict[str, str],
                                 flags: tuple[str, ...] = ()) -> tuple[dict, list[dict]]:
    """``script`` run as is on one device, and with the one added line under ``autotp run --tp 2`` (and
    ``flags``): the single run's result and every rank's (each rank runs the whole script)."""
    src = Path(SCRIPTS, script).read_text()
    assert "model = GPT(config)\n" in src
    (tmp_path / "train_tp.py").write_text(src.replace("model = GPT(config)\n", f"model = GPT(config)\n{ADDED}\n"))
    env = {**os.environ, "PYTHONPATH": SCRIPTS, **env}
    single = subprocess.run([sys.executable, str(Path(SCRIPTS, script))], capture_output=True, text=True,
                            timeout=300, env=env)
    assert single.returncode == 0, single.stderr[-2000:]
    (want,) = _results(single.stdout)
    cmd = [sys.executable, "-m", "autotp.cli", "run", str(tmp_path / "train_tp.py"), "--tp", "2", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    got = _results(proc.stdout)
    ranks = 2  # tp 2, times each other dimension asked for
    for flag in ("--dp", "--cp"):
        ranks *= int(flags[flags.index(flag) + 1]) if flag in flags else 1
    assert len(got) == ranks
    return want, got


@pytest.mark.slow
def test_single_device_script_with_one_added_line(tmp_path: Path):
    want, got = _single_and_under_autotp_run("train.py", tmp_path, {})
    for r in got:
        # the model's own optimizer factory, clip_grad_norm_, estimate_mfu, generate and config all work
        assert max(abs(a - b) for a, b in zip(r["losses"], want["losses"])) <= 1e-5, (r["losses"], want["losses"])
        assert r["sample"] == want["sample"]
        assert r["is_gpt"] and r["block_size"] == want["block_size"] and r["mfu"]
        assert r["params"] < want["params"]  # get_num_params counts this rank's shards


@pytest.mark.slow
@pytest.mark.extended
def test_single_device_script_under_autotp_run_fsdp(tmp_path: Path):
    """The same one added line under ``autotp run --tp 2 --dp 2 --fsdp``: FSDP2 over the data-parallel ranks,
    the script's own optimizer groups, clip_grad_norm_ (the full model's norm) and sampling loop unchanged."""
    want, got = _single_and_under_autotp_run("train.py", tmp_path, {}, ("--dp", "2", "--fsdp"))
    for r in got:
        assert max(abs(a - b) for a, b in zip(r["losses"], want["losses"])) <= 1e-5, (r["losses"], want["losses"])
        assert r["sample"] == want["sample"]
        assert r["is_gpt"] and r["block_size"] == want["block_size"] and r["mfu"]
        assert r["params"] == want["params"]  # FSDP's DTensors count the whole model


@pytest.mark.slow
@pytest.mark.extended
def test_single_device_script_under_autotp_run_cp(tmp_path: Path):
    """The same one added line under ``autotp run --tp 2 --cp 2``: parallelize with no example captures the
    forward's default inputs (no targets: the last position's logits), which cannot run on chunks; it says so
    once and runs such calls whole on every cp rank, so the script's sampling loop draws the same tokens,
    while its training calls (with targets) run on chunks, exact."""
    want, got = _single_and_under_autotp_run("train.py", tmp_path, {}, ("--cp", "2"))
    for r in got:
        assert max(abs(a - b) for a, b in zip(r["losses"], want["losses"])) <= 1e-5, (r["losses"], want["losses"])
        assert r["sample"] == want["sample"] and r["is_gpt"] and r["mfu"]


def in_place_worker() -> dict:
    import copy

    import autotp
    from nanogpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    ref = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    modules = dict(model.named_modules())
    out = autotp.parallelize(model)
    st = autotp.tp_state(model)
    idx = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        logits, _ = model(idx)  # (b, 1, V) gathered when read: user code indexes it like any tensor
        rlogits, _ = ref(idx)
    norms = []
    for m in (model, ref):  # clip_grad_norm_ of the user's script sees the full gradients' norm
        m(idx, idx)[1].backward()
        norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9).item())
        norms.append(m.transformer.h[0].attn.c_attn.weight.grad.norm().item())
    model.eval()
    return {
        "same_object": out is model, "isinstance": isinstance(model, GPT), "class_name": type(model).__name__,
        "names": [n for n, _ in model.named_parameters()] == names,
        "modules_kept": all(dict(model.named_modules())[n] is m for n, m in modules.items()),
        "config": model.config is ref.config or model.config == ref.config,
        "local_c_fc": tuple(model.transformer.h[0].c_fc.weight.shape),
        "tied": model.transformer.wte.weight is model.lm_head.weight,
        "state_dict_local": tuple(model.state_dict()["transformer.h.0.c_fc.weight"].shape),
        "logits_diff": (logits[:, -1, :] - rlogits[:, -1, :]).abs().max().item(),
        "eval_propagates": not model.transformer.h[0].training,
        "tp": st.tp, "norm_diff": max(abs(norms[0] - norms[2]), abs(norms[1] - norms[3])) / norms[2],
        "twice": _raises(lambda: autotp.parallelize(model)),
    }


def _raises(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__
    return ""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Launches:
    """The multi-process tests' jobs, one launch per world: the model changed in place, ``generate`` (with the
    KV cache) and ``save_pretrained`` at tp 2; ``generate`` without the cache at tp 4 in the extended run (four
    ranks on CI's two cores cost the most of any launch)."""
    from parity_workers import hf_generate

    tmp = str(tmp_path_factory.mktemp("pretrained"))
    return Launches({2: {"in place": (in_place_worker,), "generate": (hf_generate, ["gpt2", "llama"], True, tmp)}},
                    extended={4: {"generate": (hf_generate, ["gpt2", "llama"], False, None)}})


@pytest.mark.slow
def test_parallelize_changes_the_model_in_place(runs):
    results = runs(2, "in place")
    for rank, r in results.items():
        assert r["same_object"] and r["isinstance"] and r["class_name"] == "GPT"
        assert r["names"] and r["modules_kept"] and r["config"] and r["tied"] and r["eval_propagates"]
        assert r["local_c_fc"] == (128, 64) and r["state_dict_local"] == (128, 64)
        assert r["logits_diff"] <= 1e-5, r
        assert r["norm_diff"] <= 1e-5, r
        assert r["twice"] == "ShardingError"


# with and without the KV cache, each at one tp (both ways at both tp cost 45 s more and cover nothing new)
@pytest.mark.slow
@pytest.mark.parametrize("world,use_cache", [(2, True), pytest.param(4, False, marks=pytest.mark.extended)])
def test_hf_generate_and_save_pretrained(runs, world: int, use_cache: bool):
    """Greedy ``generate`` gives the unsharded model's tokens, with the model's own KV cache (kept as
    local shards between steps: nothing but the last position's logits is gathered) and without one;
    ``save_pretrained`` writes the full model once and ``from_pretrained`` loads it back bit-identical."""
    results = runs(world, "generate")
    for rank, by_kind in results.items():
        assert list(by_kind) == ["gpt2", "llama"]
        for kind, r in by_kind.items():
            assert r["same_tokens"] and r["new"] == 8, (rank, kind, r)
            assert len(r["gathers"]) == 8 and all(g[-1] == 128 for g in r["gathers"]), r["gathers"]
            if use_cache:
                assert r["round_trip"], (rank, kind)
                assert "model.safetensors" in r["files"], r["files"]


@pytest.mark.slow
@pytest.mark.extended  # autocast and GradScaler on the ranks: tests/runtime/test_amp.py; the script: here, extended
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_autocast_training_script_under_autotp_run(tmp_path: Path, dtype: str):
    """nanoGPT's GPU recipe — ``ctx = torch.autocast(...)``, a GradScaler for float16, unscale, clip, step,
    then the model's own generate() under ctx — with one added line, under ``autotp run --tp 2``: the
    single-device run's losses (within 4·eps of the dtype, see tests/runtime/test_amp.py), scales and tokens."""
    want, got = _single_and_under_autotp_run("train_amp.py", tmp_path, {"AMP_DTYPE": dtype})
    tol = 4 * torch.finfo(getattr(torch, dtype)).eps
    for r in got:
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], want["losses"])) <= tol, (r["losses"], want["losses"])
        assert r["scales"] == want["scales"]
        assert r["sample"] == want["sample"], (r["sample"], want["sample"])
