"""Benchmark (not a test): loading a model that should never exist whole on one rank.

    python benchmarks/load_weights.py [--tp 2 4] [--cache /tmp/autotp-bench] [--out benchmarks/results]

Model: a Llama-shaped Hugging Face ``LlamaForCausalLM`` of 1.1B parameters (TinyLlama's shape: 22 layers,
hidden 2048, MLP 5632, 32 heads, 4 kv heads, vocab 32000, untied head), fp32, random weights, written once
by ``save_pretrained`` as sharded safetensors (1 GB files and an index) under ``--cache``.

For each tp, on gloo ranks of this machine (one path at a time, so they do not compete):

- autotp: the same model written in plain PyTorch (benchmarks/llama_shaped.py, Hugging Face's parameter
  names, so it reads the checkpoint as it is) built inside ``autotp.empty_weights()``, ``autotp.parallelize``
  (plans on meta, allocates the shards), ``autotp.load_weights(model, folder)``;
- autotp-hf: the same with Hugging Face's ``LlamaForCausalLM`` class (its process imports transformers);
- autotp-mmap: autotp with ``load_weights(..., mmap=True)``: column and vocab shards left as views of the
  files' copy-on-write mappings, row shards copied;
- autotp-mmap-cached: the same job restarted: ``parallelize`` finds the plan the first run stored in the plan
  cache (:mod:`autotp.parallel.reuse`), shards from it and captures on the model's first call instead.
  Every other autotp path starts with an empty plan cache of its own;
- old: ``LlamaForCausalLM.from_pretrained(folder)`` (the whole model on every rank), then ``autotp.parallelize``;
- hf: ``from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto"))`` (needs accelerate).

Reported per path (the worst rank): peak RSS (VmHWM) against the ideal, the local shard bytes (every
parameter and buffer the rank holds) plus the RSS of an empty process that imported torch, and against the
rank's own RSS before it built anything (torch, the process group and the model's library imported); the
bytes of checkpoint slices read against 1/tp of the sharded tensors plus the replicated ones; the wall time;
and the wall time plus one read of every weight (a sum of each local tensor): ``from_pretrained`` leaves
the weights as views of the memory-mapped files, whose pages are read on first use, while autotp copies
each slice into the rank's own memory as it loads (unless ``mmap=True``); and the first forward's time (a
(2, 8) batch, no gradients), where a cached plan's capture happens.
The old path runs only when tp whole copies fit in the memory available (with 20% to spare); otherwise the
result says so. Writes ``OUT/load_weights.json`` and ``OUT/load_weights.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "support")]

CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
              num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2)
GOAL = 1.15


def _status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIG)


def _held(model) -> int:
    """Bytes of the distinct tensors the model holds on this rank (a DTensor's local shard)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        local = t.to_local() if hasattr(t, "to_local") else t
        key = (local.data_ptr(), tuple(local.shape), local.dtype)
        if key not in seen:
            seen.add(key)
            total += local.numel() * local.element_size()
    return total


def _expected_read(model) -> int:
    """1/tp of each sharded tensor (its owned vocab rows) plus every replicated tensor, in bytes."""
    import autotp

    st = autotp.tp_state(model)
    total, seen = 0, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        shard = st.shards.get(name)
        full = shard.full_shape if shard is not None else tuple(t.shape)
        n = 1
        for s in full:
            n *= s
        total += n * t.element_size() // (st.tp if shard is not None else 1)
    return total


def autotp_rank(folder: str, plans: str, hf: bool = False, mmap: bool = False) -> dict:
    os.environ["AUTOTP_CACHE_DIR"] = plans  # the path's own plan cache (ranks keep the launcher's first environment)
    import torch

    import autotp

    if hf:
        from transformers import LlamaForCausalLM

        build = lambda: LlamaForCausalLM(_config())  # noqa: E731
    else:
        from llama_shaped import Config, LlamaShaped

        build = lambda: LlamaShaped(Config())  # noqa: E731
    start = _status("VmRSS")
    t0 = time.perf_counter()
    with autotp.empty_weights():
        model = build()
    t1 = time.perf_counter()
    model = autotp.parallelize(model)
    t2 = time.perf_counter()
    rss_planned = _status("VmRSS")

    loaded = autotp.load_weights(model, folder, mmap=mmap)
    t3 = time.perf_counter()
    # a spot check that the slices are the checkpoint's: this rank's rows of the first q projection
    from safetensors import safe_open

    name = "model.layers.0.self_attn.q_proj.weight"
    index = json.loads(Path(folder, "model.safetensors.index.json").read_text())["weight_map"]
    st = autotp.tp_state(model)
    rows = st.shards[name].local_shape[0]
    with safe_open(str(Path(folder, index[name])), "pt") as f:
        want = f.get_slice(name)[st.rank * rows:(st.rank + 1) * rows]
    assert torch.equal(model.get_parameter(name), want), "loaded slice differs from the checkpoint"
    touch = _touch(model)
    return {"start_rss": start, "planned_rss": rss_planned, "peak_rss": _status("VmHWM"), "held": _held(model),
            "bytes_read": loaded.bytes_read, "expected_read": _expected_read(model), "mapped": loaded.mapped,
            "cached": st.cached is not None, "build_s": t1 - t0, "parallelize_s": t2 - t1, "load_s": t3 - t2,
            "total_s": t3 - t0, "touch_s": touch, "first_call_s": _first_call(model)}


def autotp_hf_rank(folder: str, plans: str) -> dict:
    return autotp_rank(folder, plans, hf=True)


def autotp_mmap_rank(folder: str, plans: str) -> dict:
    return autotp_rank(folder, plans, mmap=True)


def old_rank(folder: str, plans: str) -> dict:
    os.environ["AUTOTP_CACHE_DIR"] = plans
    from transformers import LlamaForCausalLM

    import autotp

    start = _status("VmRSS")
    t0 = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(folder)
    t1 = time.perf_counter()
    model = autotp.parallelize(model)
    t2 = time.perf_counter()
    return {"start_rss": start, "peak_rss": _status("VmHWM"), "held": _held(model), "load_s": t1 - t0,
            "parallelize_s": t2 - t1, "total_s": t2 - t0}


def hf_rank(folder: str, plans: str) -> dict:
    from transformers import DistributedConfig, LlamaForCausalLM

    start = _status("VmRSS")
    t0 = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto"))
    t1 = time.perf_counter()
    touch = _touch(model)
    return {"start_rss": start, "peak_rss": _status("VmHWM"), "held": _held(model), "total_s": t1 - t0,
            "touch_s": touch, "first_call_s": _first_call(model)}


def _first_call(model) -> float:
    """Seconds of the model's first forward, a (2, 8) batch of token ids without gradients: where autotp
    sharded from the plan cache, this is where it captures."""
    import torch

    ids = torch.zeros(2, 8, dtype=torch.long)
    t0 = time.perf_counter()
    with torch.no_grad():
        model(ids)
    return time.perf_counter() - t0


def _touch(model) -> float:
    """Seconds to read every weight once (a sum of each local tensor). from_pretrained leaves the weights as
    views of the memory-mapped files: their pages are read on first use, which this makes part of the count."""
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).sum()
    return time.perf_counter() - t0


def _save(folder: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    model.save_pretrained(folder, max_shard_size="1GB")


def _empty_rss() -> int:
    code = ("import torch\nwith open('/proc/self/status') as f:\n    print(next(int(l.split()[1]) * 1024 for l in f "
            "if l.startswith('VmRSS:')))")
    return int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)


def _available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def _worst(ranks: dict, ideal_base: int) -> dict:
    rs = list(ranks.values())
    out = {k: max(r[k] for r in rs) for k in rs[0]}
    out["ideal_rss"] = max(r["held"] for r in rs) + ideal_base
    out["rss_ratio"] = max(r["peak_rss"] / (r["held"] + ideal_base) for r in rs)
    out["rss_ratio_own"] = max(r["peak_rss"] / (r["held"] + r["start_rss"]) for r in rs)
    if "bytes_read" in out:
        out["read_ratio"] = max(r["bytes_read"] / r["expected_read"] for r in rs)
    return out


def main() -> None:
    from ranks import launch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--cache", type=Path, default=Path("/tmp/autotp-bench"))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one intra-op thread per rank, as torchrun sets it
    folder = a.cache / "llama-1.1b"
    if not (folder / "model.safetensors.index.json").is_file():
        import multiprocessing as mp

        proc = mp.get_context("spawn").Process(target=_save, args=(folder,))  # its memory is freed when it ends
        proc.start()
        proc.join()
    files = sorted(folder.glob("*.safetensors"))
    checkpoint = sum(f.stat().st_size for f in files)
    for f in files:  # into the page cache, so that the first path timed does not read the disk for the others
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    base = _empty_rss()
    result = {"model": CONFIG, "checkpoint_bytes": checkpoint, "files": len(files), "empty_torch_rss": base,
              "load_average": [os.getloadavg()[0]], "runs": {}}
    for tp in a.tp:
        for path in a.paths:
            key = f"{path}@tp{tp}"
            if path == "old" and tp * (checkpoint + checkpoint // tp) * 1.2 > _available():
                result["runs"][key] = {"skipped": f"{tp} whole copies ({tp} × {checkpoint / 2**30:.1f} GiB) plus "
                                                  f"their shards do not fit in {_available() / 2**30:.1f} GiB available"}
                print(key, result["runs"][key], flush=True)
                continue
            plans = a.cache / "plans" / f"{path.removesuffix('-cached')}@tp{tp}"
            if not path.endswith("-cached"):  # a cold start: no plan cached
                shutil.rmtree(plans, ignore_errors=True)
            elif not plans.is_dir():  # a restarted job: the plan its first run stored
                launch(PATHS[path], tp, str(folder), str(plans))
            t0 = time.perf_counter()
            try:
                ranks = launch(PATHS[path], tp, str(folder), str(plans))
                result["runs"][key] = {**_worst(ranks, base), "wall_s": time.perf_counter() - t0}
            except Exception as exc:  # noqa: BLE001 - a path that fails is a result too
                result["runs"][key] = {"failed": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"}
            print(key, result["runs"][key], flush=True)
    result["load_average"].append(os.getloadavg()[0])  # the machine is shared: times are only as quiet as it was
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "load_weights.json").write_text(json.dumps(result, indent=2) + "\n")
    (a.out / "load_weights.md").write_text(_markdown(result))
    print(_markdown(result))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _markdown(r: dict) -> str:
    lines = [f"# Loading a 1.1B Llama-shaped model into its shards ({r['files']} safetensors files, "
             f"{_gib(r['checkpoint_bytes'])}, fp32; CPU, gloo)", "",
             f"Ideal peak RSS per rank = local shard bytes + an empty process with torch imported "
             f"({_gib(r['empty_torch_rss'])}); goal ≤ {GOAL}× for autotp. \"Ratio to own start\": against the "
             "local shard bytes + the rank's RSS before it built anything (torch, the process group and the model's "
             f"library imported). Load average (2 cores, shared machine) {r['load_average'][0]:.1f} at the start, "
             f"{r['load_average'][-1]:.1f} at the end.", "",
             "| path | tp | peak RSS / rank | ideal | ratio | ratio to own start | bytes read / rank | 1/tp + replicated "
             "| ratio | time | time + one read of every weight | first call |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    # the old and Hugging Face paths against autotp with the same model class
    auto = {k.split("@")[1]: v for k, v in r["runs"].items() if k.startswith("autotp-hf@") and "peak_rss" in v}
    for key, v in r["runs"].items():
        path, tp = key.split("@")
        if "peak_rss" not in v:
            lines.append(f"| {path} | {tp[2:]} | {v.get('skipped') or v.get('failed')} | | | | | | | | | |")
            continue
        read = ("-", "-", "-") if "bytes_read" not in v else \
            (_gib(v["bytes_read"]), _gib(v["expected_read"]), f"{v['read_ratio']:.3f}")
        touched = f"{v['total_s'] + v['touch_s']:.1f} s" if "touch_s" in v else "-"
        first = f"{v['first_call_s']:.1f} s" if "first_call_s" in v else "-"
        rel = ""
        if path in ("old", "hf") and tp in auto:
            rel = f" ({v['peak_rss'] / auto[tp]['peak_rss']:.2f}× autotp-hf's, {v['total_s'] / auto[tp]['total_s']:.2f}× its time)"
        lines.append(f"| {path} | {tp[2:]} | {_gib(v['peak_rss'])}{rel} | {_gib(v['ideal_rss'])} | {v['rss_ratio']:.3f} | "
                     f"{v['rss_ratio_own']:.3f} | "
                     f"{read[0]} | {read[1]} | {read[2]} | {v['total_s']:.1f} s | {touched} | {first} |")
    for key, v in r["runs"].items():
        if key.startswith("autotp") and "peak_rss" in v:
            lines.append(f"\n{key}: build {v['build_s']:.1f} s, parallelize {v['parallelize_s']:.1f} s, load "
                         f"{v['load_s']:.1f} s; RSS when planned (shards allocated, nothing loaded) "
                         f"{_gib(v['planned_rss'])}, at the rank's start {_gib(v['start_rss'])}")
    return "\n".join(lines) + "\n"


PATHS = {"autotp": autotp_rank, "autotp-hf": autotp_hf_rank, "autotp-mmap": autotp_mmap_rank,
         "autotp-mmap-cached": autotp_mmap_rank, "old": old_rank, "hf": hf_rank}

if __name__ == "__main__":
    main()
