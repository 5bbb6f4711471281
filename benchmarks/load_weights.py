"""Benchmark (not a test): loading a model that should never exist whole on one rank.

    python benchmarks/load_weights.py [--model 1.1b|246m] [--tp 2 4] [--cache /tmp/autotp-bench]
                                      [--out benchmarks/results]

Model: a Llama-shaped Hugging Face ``LlamaForCausalLM`` of 1.1B parameters (TinyLlama's shape: 22 layers,
hidden 2048, MLP 5632, 32 heads, 4 kv heads, vocab 32000, untied head), or with ``--model 246m`` one of 246M
(14 layers, hidden 1024, MLP 2816, 16 heads, 16 kv heads), fp32, random weights, written once by
``save_pretrained`` as sharded safetensors (1 GB files and an index; 200 MB for the small one) under ``--cache``.

For each tp, on gloo ranks of this machine (one path at a time, so they do not compete):

- autotp: the same model written in plain PyTorch (benchmarks/llama_shaped.py, Hugging Face's parameter
  names, so it reads the checkpoint as it is) built inside ``autotp.empty_weights()``, ``autotp.parallelize``
  (plans on meta, allocates the shards), ``autotp.load_weights(model, folder)``;
- autotp-hf: the same with Hugging Face's class, as a user writes it: ``AutoModelForCausalLM.from_config``
  inside ``autotp.empty_weights()``, ``parallelize(model, example_inputs=((), {"input_ids": ids,
  "use_cache": False}))``, ``load_weights``, and the first forward with the same ids;
- autotp-hf-mmap: the same with ``load_weights(..., mmap=True)``;
- autotp-mmap: autotp with ``load_weights(..., mmap=True)``: column and vocab shards left as views of the
  files' copy-on-write mappings, row shards copied;
- autotp-mmap-cached: the same job restarted: ``parallelize`` finds the plan the first run stored in the plan
  cache (:mod:`autotp.parallel.reuse`), shards from it and captures on the model's first call instead.
  Every other autotp path starts with an empty plan cache of its own;
- cli: the same model file through the command line, ``autotp shard FILE --tp N --weights folder --steps 0``
  (build on meta, load, check; nothing trained or saved): each rank's peak (``VmHWM``, read every 20 ms while
  the job runs) against its shard bytes (the autotp path's) plus the RSS of the fork server it started from;
- old: ``LlamaForCausalLM.from_pretrained(folder)`` (the whole model on every rank), then ``autotp.parallelize``;
- hf: ``from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto"))`` (needs accelerate).

Reported per path (the worst rank): peak RSS (``getrusage``, after the first forward) against the ideal, the
local shard bytes (every parameter and buffer the rank holds) plus the RSS of an empty process that imported
torch, and against the rank's own RSS before it built anything (torch, the process group and the model's library imported); the
bytes of checkpoint slices read against 1/tp of the sharded tensors plus the replicated ones; the wall time;
and the wall time plus one read of every weight (a sum of each local tensor): ``from_pretrained`` leaves
the weights as views of the memory-mapped files, whose pages are read on first use, while autotp copies
each slice into the rank's own memory as it loads (unless ``mmap=True``); and the first forward's time (a
(2, 8) batch, no gradients), where a cached plan's capture happens. Each autotp rank also records its RSS
(``/proc/self/statm``) and peak after each phase: start, build, parallelize, load, first forward. With
``--model 246m`` each rank then checks its logits against the unsharded model's (``from_pretrained``, after
every measurement): within 1e-5.
The old path runs only when tp whole copies fit in the memory available (with 20% to spare); otherwise the
result says so. Writes ``OUT/load_weights.json`` and ``OUT/load_weights.md`` (``load_weights-246m.*``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
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
SMALL = dict(CONFIG, hidden_size=1024, intermediate_size=2816, num_hidden_layers=14, num_attention_heads=16,
             num_key_value_heads=16)
MODELS = {"1.1b": CONFIG, "246m": SMALL}
GOAL = 1.1
PHASES = ("start", "build", "parallelize", "load", "forward")


def _rss() -> int:
    """This process's resident bytes now (/proc/self/statm: pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    """This process's peak resident bytes so far (getrusage: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _library_rss() -> int:
    """Resident bytes of shared libraries' mappings (/proc/self/smaps: ``*.so`` files): the code pages of
    libtorch and the rest that the ops run so far have touched. File-backed and clean, shared by every rank
    on the machine and dropped first under memory pressure, yet counted in each rank's RSS."""
    total, lib = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=6)
            if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line: range, perms, ..., path
                path = head[5].strip() if len(head) > 5 else ""
                lib = path.endswith(".so") or ".so." in path
            elif lib and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def _phase() -> tuple[int, int, int]:
    """(RSS now, peak RSS so far, shared libraries' resident code pages)."""
    return _rss(), _peak(), _library_rss()


def _status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _config(folder: str | None = None):
    from transformers import LlamaConfig

    if folder is not None:  # the checkpoint's own: the model it was written from
        return LlamaConfig.from_pretrained(folder)
    return LlamaConfig(**CONFIG)


def _held(model) -> int:
    """Bytes of the distinct tensors the model holds on this rank (a DTensor's local shard): parameters and
    buffers, counted by autotp.parallel.held as every report counts them."""
    from autotp.parallel.held import held

    return held([*model.parameters(), *model.buffers()]).bytes


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

    ids = torch.randint(0, 32000, (2, 8), generator=torch.Generator().manual_seed(0))
    if hf:  # as a user writes it: the Auto class, example inputs naming the call the model will get
        from transformers import AutoModelForCausalLM

        config = _config(folder)
        build = lambda: AutoModelForCausalLM.from_config(config)  # noqa: E731
        example, call = ((), {"input_ids": ids, "use_cache": False}), {"input_ids": ids, "use_cache": False}
    else:
        from llama_shaped import Config, LlamaShaped

        c = json.loads(Path(folder, "config.json").read_text())
        build = lambda: LlamaShaped(Config(**{k: c[k] for k in Config.__dataclass_fields__ if k in c}))  # noqa: E731
        example, call = None, None  # parallelize's default example: a (2, 8) batch of token ids
    phases = {"start": _phase()}
    start = phases["start"][0]
    t0 = time.perf_counter()
    with autotp.empty_weights():
        model = build()
    t1 = time.perf_counter()
    phases["build"] = _phase()
    model = autotp.parallelize(model, example_inputs=example)
    t2 = time.perf_counter()
    phases["parallelize"] = _phase()
    rss_planned = phases["parallelize"][0]

    loaded = autotp.load_weights(model, folder, mmap=mmap)
    t3 = time.perf_counter()
    phases["load"] = _phase()
    # a spot check that the slices are the checkpoint's: this rank's rows of the first q projection
    from safetensors import safe_open

    name = "model.layers.0.self_attn.q_proj.weight"
    index = json.loads(Path(folder, "model.safetensors.index.json").read_text())["weight_map"]
    st = autotp.tp_state(model)
    rows = st.shards[name].local_shape[0]
    with safe_open(str(Path(folder, index[name])), "pt") as f:
        want = f.get_slice(name)[st.rank * rows:(st.rank + 1) * rows]
    assert torch.equal(model.get_parameter(name), want), "loaded slice differs from the checkpoint"
    first, logits = _first_call(model, ids, call)
    phases["forward"] = _phase()
    peak = _peak()
    held = _held(model)
    touch = _touch(model)
    out = {"start_rss": start, "planned_rss": rss_planned, "peak_rss": peak, "held": held,
           "library_growth": phases["forward"][2] - phases["start"][2],
           "phases": {k: list(v) for k, v in phases.items()},
           "bytes_read": loaded.bytes_read, "expected_read": _expected_read(model), "mapped": loaded.mapped,
           "cached": st.cached is not None, "build_s": t1 - t0, "parallelize_s": t2 - t1, "load_s": t3 - t2,
           "total_s": t3 - t0, "touch_s": touch, "first_call_s": first}
    if os.environ.get("AUTOTP_BENCH_CHECK_LOGITS") == "1":
        out["logits_max_diff"] = _logits_diff(folder, ids, logits)
    return out


def _logits_diff(folder: str, ids, logits) -> float:
    """The largest difference between these logits and the unsharded model's (after every measurement)."""
    import torch
    from transformers import AutoModelForCausalLM

    whole = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    with torch.no_grad():
        want = whole(input_ids=ids, use_cache=False).logits
    got = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return float((got - want).abs().max())


def autotp_hf_rank(folder: str, plans: str) -> dict:
    return autotp_rank(folder, plans, hf=True)


def autotp_mmap_rank(folder: str, plans: str) -> dict:
    return autotp_rank(folder, plans, mmap=True)


def autotp_hf_mmap_rank(folder: str, plans: str) -> dict:
    return autotp_rank(folder, plans, hf=True, mmap=True)


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
    phases = {"start": _phase()}
    model = LlamaForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto"))
    t1 = time.perf_counter()
    phases["load"] = _phase()
    import torch

    ids = torch.randint(0, 32000, (2, 8), generator=torch.Generator().manual_seed(0))
    first, logits = _first_call(model, ids, {"input_ids": ids, "use_cache": False})
    phases["forward"] = _phase()
    peak = _peak()
    out = {"start_rss": start, "peak_rss": peak, "held": _held(model), "total_s": t1 - t0,
           "library_growth": phases["forward"][2] - phases["start"][2],
           "touch_s": _touch(model), "first_call_s": first, "phases": {k: list(v) for k, v in phases.items()}}
    if os.environ.get("AUTOTP_BENCH_CHECK_LOGITS") == "1":
        out["logits_max_diff"] = _logits_diff(folder, ids, logits)
    return out


def _first_call(model, ids, call: dict | None = None) -> tuple[float, object]:
    """Seconds of the model's first forward, a (2, 8) batch of token ids without gradients (``call``: as
    keywords), and its logits: where autotp sharded from the plan cache, this is where it captures."""
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(**call) if call is not None else model(ids)
    logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
    return time.perf_counter() - t0, logits


def _touch(model) -> float:
    """Seconds to read every weight once (a sum of each local tensor). from_pretrained leaves the weights as
    views of the memory-mapped files: their pages are read on first use, which this makes part of the count."""
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).sum()
    return time.perf_counter() - t0


def _save(folder: Path, config: dict, shard_size: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.save_pretrained(folder, max_shard_size=shard_size)


CLI_MODEL = """\
import json
import sys

sys.path.insert(0, {bench!r})
from llama_shaped import Config, LlamaShaped


def build_model():
    c = json.loads(open({config!r}).read())
    return LlamaShaped(Config(**{{k: c[k] for k in Config.__dataclass_fields__ if k in c}}))
"""


def _processes() -> dict[int, tuple[int, int]]:
    """{pid: (parent pid, peak RSS in bytes)} of every process this user can read."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/status") as f:
                hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        except (OSError, StopIteration, ValueError):
            continue
        out[int(pid)] = (ppid, hwm)
    return out


def cli_run(folder: Path, cache: Path, tp: int, held: int | None, base: int) -> dict:
    """``autotp shard`` on the checkpoint with ``--steps 0``, its ranks' peaks read from /proc while it runs."""
    model = cache / "cli_model.py"
    model.write_text(CLI_MODEL.format(bench=str(ROOT / "benchmarks"), config=str(folder / "config.json")))
    out = cache / f"cli-out-tp{tp}"
    shutil.rmtree(out, ignore_errors=True)
    log = open(cache / f"cli-tp{tp}.log", "w+")  # a file, not a pipe: a pipe left unread while polling fills up
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "autotp.cli", "shard", str(model), "--tp", str(tp), "--weights",
                             str(folder), "--steps", "0", "--out", str(out)], stdout=log, stderr=subprocess.STDOUT)
    seen: dict[int, tuple[int, int]] = {}
    while proc.poll() is None:
        now = _processes()
        family, todo = set(), [proc.pid]
        while todo:
            pid = todo.pop()
            family.add(pid)
            todo += [c for c, (parent, _) in now.items() if parent == pid and c not in family]
        seen.update({pid: now[pid] for pid in family if pid in now})
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    log.seek(0)
    said = log.read().strip().splitlines() or [""]
    log.close()
    if proc.returncode != 0:
        return {"failed": f"exit {proc.returncode}: {said[-1][:300]}"}
    ranks = sorted(seen.items(), key=lambda kv: -kv[1][1])[:tp]  # the ranks hold the shards: the largest peaks
    server = seen.get(ranks[0][1][0], (0, 0))[1]  # the fork server they started from: a rank's start
    peak = max(h for _, (_, h) in ranks)
    if held is None:
        return {"skipped": "needs the autotp path's shard bytes at this tp (run it too)"}
    return {"peak_rss": peak, "ideal_rss": held + base, "rss_ratio": peak / (held + base),
            "rss_ratio_own": peak / (held + server), "start_rss": server, "held": held, "total_s": wall}


def _empty_rss() -> int:
    code = ("import torch\nwith open('/proc/self/status') as f:\n    print(next(int(l.split()[1]) * 1024 for l in f "
            "if l.startswith('VmRSS:')))")
    return int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)


def _available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def _worst(ranks: dict, ideal_base: int) -> dict:
    rs = list(ranks.values())
    out = {k: max(r[k] for r in rs) for k in rs[0] if k != "phases"}
    out["ideal_rss"] = max(r["held"] for r in rs) + ideal_base
    out["rss_ratio"] = max(r["peak_rss"] / (r["held"] + ideal_base) for r in rs)
    out["rss_ratio_own"] = max(r["peak_rss"] / (r["held"] + r["start_rss"]) for r in rs)
    if "library_growth" in rs[0]:  # the same, less the shared libraries' code pages the run touched
        out["rss_ratio_own_less_code"] = max((r["peak_rss"] - r["library_growth"]) / (r["held"] + r["start_rss"])
                                             for r in rs)
    if "phases" in rs[0]:  # the phases of the rank whose peak is the furthest above its own ideal
        out["phases"] = max(rs, key=lambda r: r["peak_rss"] / (r["held"] + r["start_rss"]))["phases"]
    if "bytes_read" in out:
        out["read_ratio"] = max(r["bytes_read"] / r["expected_read"] for r in rs)
    return out


def main() -> None:
    from ranks import launch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(MODELS), default="1.1b")
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--cache", type=Path, default=Path("/tmp/autotp-bench"))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one intra-op thread per rank, as torchrun sets it
    config = MODELS[a.model]
    folder = a.cache / f"llama-{a.model}"
    if a.model != "1.1b":  # small enough for every rank to build the unsharded model after measuring
        os.environ["AUTOTP_BENCH_CHECK_LOGITS"] = "1"
    if not (folder / "model.safetensors.index.json").is_file():
        import multiprocessing as mp

        size = "1GB" if a.model == "1.1b" else "200MB"
        proc = mp.get_context("spawn").Process(target=_save, args=(folder, config, size))  # its memory is freed when it ends
        proc.start()
        proc.join()
    files = sorted(folder.glob("*.safetensors"))
    checkpoint = sum(f.stat().st_size for f in files)
    for f in files:  # into the page cache, so that the first path timed does not read the disk for the others
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    base = _empty_rss()
    result = {"model": config, "name": a.model, "checkpoint_bytes": checkpoint, "files": len(files),
              "empty_torch_rss": base,
              "load_average": [os.getloadavg()[0]], "runs": {}}
    for tp in a.tp:
        for path in a.paths:
            key = f"{path}@tp{tp}"
            if path == "old" and tp * (checkpoint + checkpoint // tp) * 1.2 > _available():
                result["runs"][key] = {"skipped": f"{tp} whole copies ({tp} × {checkpoint / 2**30:.1f} GiB) plus "
                                                  f"their shards do not fit in {_available() / 2**30:.1f} GiB available"}
                print(key, result["runs"][key], flush=True)
                continue
            plans = a.cache / "plans" / a.model / f"{path.removesuffix('-cached')}@tp{tp}"
            if not path.endswith("-cached"):  # a cold start: no plan cached
                shutil.rmtree(plans, ignore_errors=True)
            elif not plans.is_dir():  # a restarted job: the plan its first run stored
                launch(PATHS[path], tp, str(folder), str(plans))
            if path == "cli":
                own = result["runs"].get(f"autotp@tp{tp}", {})
                result["runs"][key] = cli_run(folder, a.cache, tp, own.get("held"), base)
                print(key, result["runs"][key], flush=True)
                continue
            t0 = time.perf_counter()
            try:
                ranks = launch(PATHS[path], tp, str(folder), str(plans))
                result["runs"][key] = {**_worst(ranks, base), "wall_s": time.perf_counter() - t0}
            except Exception as exc:  # noqa: BLE001 - a path that fails is a result too
                result["runs"][key] = {"failed": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"}
            print(key, result["runs"][key], flush=True)
    result["load_average"].append(os.getloadavg()[0])  # the machine is shared: times are only as quiet as it was
    a.out.mkdir(parents=True, exist_ok=True)
    stem = "load_weights" if a.model == "1.1b" else f"load_weights-{a.model}"
    (a.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (a.out / f"{stem}.md").write_text(_markdown(result))
    print(_markdown(result))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _markdown(r: dict) -> str:
    size = {"1.1b": "1.1B", "246m": "246M"}.get(r.get("name", "1.1b"), r.get("name"))
    lines = [f"# Loading a {size} Llama-shaped model into its shards ({r['files']} safetensors files, "
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
    lines += ["", "RSS after each phase, MiB (the peak so far where it is higher), of the rank furthest above its "
              "own ideal; \"+\" is the peak over the rank's start less what it holds (its shard bytes): what is "
              "not the model's own. Library code pages: the resident pages of shared libraries (libtorch's code "
              "above all) that the run touched between start and the first forward; file-backed and clean, shared "
              "by every rank on the machine, dropped first under memory pressure, yet part of each rank's RSS.", "",
              "| path | tp | " + " | ".join(PHASES)
              + " | shard bytes | peak − start − shards | of which library code pages | ratio to own start, less "
              "them | logits vs unsharded |",
              "|---|---|" + "---|" * (len(PHASES) + 5)]
    mib = 2**20
    for key, v in r["runs"].items():
        if "phases" not in v:
            continue
        path, tp = key.split("@")
        cells = []
        for ph in PHASES:
            if ph not in v["phases"]:
                cells.append("-")
                continue
            now, high = v["phases"][ph][:2]
            cells.append(f"{now / mib:.0f}" + (f" ({high / mib:.0f})" if high > now + mib else ""))
        start = v["phases"]["start"][0]
        extra = max(high for _, high, *_ in v["phases"].values()) - start - v["held"]
        code = v["phases"]["forward"][2] - v["phases"]["start"][2] if len(v["phases"]["start"]) > 2 else None
        diff = f"{v['logits_max_diff']:.1e}" if "logits_max_diff" in v else "-"
        lines.append(f"| {path} | {tp[2:]} | " + " | ".join(cells)
                     + f" | {v['held'] / mib:.0f} | {extra / mib:+.0f} | "
                     + (f"{code / mib:+.0f} | " if code is not None else "- | ")
                     + (f"{v['rss_ratio_own_less_code']:.3f} | " if "rss_ratio_own_less_code" in v else "- | ")
                     + f"{diff} |")
    for key, v in r["runs"].items():
        if key.startswith("autotp") and "peak_rss" in v:
            lines.append(f"\n{key}: build {v['build_s']:.1f} s, parallelize {v['parallelize_s']:.1f} s, load "
                         f"{v['load_s']:.1f} s; RSS when planned (shards allocated, nothing loaded) "
                         f"{_gib(v['planned_rss'])}, at the rank's start {_gib(v['start_rss'])}")
    return "\n".join(lines) + "\n"


PATHS = {"autotp": autotp_rank, "autotp-hf": autotp_hf_rank, "autotp-hf-mmap": autotp_hf_mmap_rank,
         "autotp-mmap": autotp_mmap_rank,
         "autotp-mmap-cached": autotp_mmap_rank, "cli": None, "old": old_rank, "hf": hf_rank}

if __name__ == "__main__":
    main()
