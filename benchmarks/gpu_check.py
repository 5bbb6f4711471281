"""The GPU check: what one GPU can tell about autotp, in one command.

    python benchmarks/gpu_check.py            # on a machine with one CUDA GPU (≈ 5 minutes on an H100)
    python benchmarks/gpu_check.py --cpu      # the same code paths at tiny sizes on the CPU (CI)

1. exact: tp 2 as two processes on the one device (gloo on its tensors: nccl refuses two ranks on one GPU),
   for the example nanoGPT and a Hugging Face Llama from a config: fp32 loss, gradients and 3 AdamW steps
   within 1e-5 of the unsharded model; bf16 autocast and fp16 autocast + GradScaler against the unsharded
   model under the same autocast; ``compile=True`` and the user's ``torch.compile(model)`` (inductor, so
   triton on the GPU; aot_eager with --cpu); greedy KV-cache decoding token for token. Then autotp's own
   launcher at world 1 with the device left to it: nccl, a "cuda" mesh, a meta-built model placed on the GPU.
2. compute: one rank of tp 2, 4, 8 on torch's fake process group (collectives return at once) runs the
   shards of a Llama-70B-wide decoder layer (hidden 8192, 64 heads, 8 kv heads, SwiGLU 28672, bf16) forward
   and backward, 1 × 4096 and 8 × 2048 tokens: its time against the unsharded layer's / t, its TFLOP/s
   against the device's peak (the hardware profile's datasheet number).
3. memory: the peak allocated in a training step of one tp-8 rank (2 such layers, fp32 weights, bf16
   autocast, fused AdamW), with and without sequence parallelism and recomputation, against the memory
   ``autotp plan`` predicts for that layout. Goal: within 10%.
4. allreduce: gloo's all-reduce of tensors on the device between the two ranks: host staging over TCP
   loopback, not NVLink, recorded for completeness.

Settings stated in the JSON: TF32 off (``torch.backends.cuda.matmul.allow_tf32`` and cudnn's) so fp32 is
fp32; bf16/fp16 reduced-precision reductions at torch's defaults. Rows of section 1 pass or fail (exit
status 1 if any fails); sections 2–4 are measurements. Writes ``OUT/gpu-<device>.json``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("AUTOTP_PLAN_CACHE", "0")  # a benchmark leaves no plans behind

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

FP32_BOUND = 1e-5
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # datasheet dense bf16 (SXM)


def _sizes(cpu: bool) -> dict:
    from llama_shaped import Config

    if cpu:
        c = Config(vocab_size=128, hidden_size=128, intermediate_size=448, num_hidden_layers=1,
                   num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=64)
        # one shape (batched) for the eager and the compiled rows: a second shape only repeated the eager rows,
        # a capture each; 1 warm-up and 1 timed step: on the CPU the times are not the point, the step's path is
        return {"config": c, "shapes": [(2, 32)], "compiled": {(2, 32, 1), (2, 32, 8)}, "timing": (1, 1),
                "memory": {"t": 8, "layers": 2, "b": 1, "s": 64}, "backend": "aot_eager", "curve": 2 ** 16,
                "every_row": ("nanogpt",)}  # the Llama: fp32 and decoding only, to stay within a minute
    c = Config(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=1,
               num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096)
    return {"config": c, "shapes": [(1, 4096), (8, 2048)], "compiled": {(1, 4096, 1), (1, 4096, 8)},
            "memory": {"t": 8, "layers": 2, "b": 1, "s": 4096}, "backend": "inductor", "curve": 2 ** 26,
            "every_row": ("nanogpt", "llama")}


def _device_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, memory_bytes=p.total_memory, sms=p.multi_processor_count,
                    capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda)
        info["peak_bf16"] = next((v for k, v in PEAK_BF16.items() if k in p.name), None)
    else:
        info.update(name=platform.processor() or platform.machine(), memory_bytes=None, peak_bf16=None)
    return info


def run_exact(s: dict, device: torch.device, only: tuple[str, ...]) -> tuple[dict, dict]:
    from autotp.distributed.launch import LaunchSpec, launch
    from gpu_check_ranks import exactness, world_one

    ranks = launch(LaunchSpec(tp=2, device="cpu", bind_cores=False, timeout=180), exactness, str(device),
                   s["backend"], s["curve"], s["every_row"], only)
    one = launch(LaunchSpec(tp=1, device="cuda" if device.type == "cuda" else "cpu"), world_one)[0]
    return ranks, one


def _gb(x: float | None) -> str:
    return "—" if x is None else f"{x / 2**30:.2f} GiB"


def render(result: dict, console: Console) -> None:
    table = Table(title=f"autotp GPU check: {result['info']['name']} (torch {result['info']['torch']})")
    for col in ("section", "check", "measured", "bound / reference", "result", "note"):
        table.add_column(col, overflow="fold")
    for r in result.get("exact", []):
        value = "—" if r["value"] != r["value"] else f"{r['value']:.3g}"
        table.add_row("exact", r["check"], value, "—" if r["bound"] is None else f"≤ {r['bound']:.3g}",
                      "[green]pass" if r["ok"] else "[red]FAIL", r["note"])
    for r in result.get("compute", []):
        name = f"{r['batch']}×{r['seq']} tp {r['tp']} {'compiled' if r['compiled'] else 'eager'}"
        ref = f"unsharded/t {r['ideal_seconds'] * 1e3:.2f} ms" if r["ideal_seconds"] else "—"
        eff = f"split {r['split_efficiency']:.2f}" if r["split_efficiency"] else ""
        pct = f"{r['peak_pct']:.0f}% of peak" if r["peak_pct"] is not None else ""
        table.add_row("compute", name, f"{r['seconds'] * 1e3:.2f} ms", ref, eff,
                      f"{r['tflops']:.1f} TFLOP/s {pct}".strip())
    for r in result.get("memory", []):
        name = f"tp {r['tp']} ×{r['layers']} layers {r['batch']}×{r['seq']}" + (" sp" if r["sp"] else "") + (
            " recompute" if r["recompute"] else "")
        if "error" in r:
            table.add_row("memory", name, "—", "—", "[red]error", r["error"])
            continue
        pred = r["predicted"]
        verdict = "—" if r.get("ratio") is None else (
            f"[green]{r['ratio']:.2f}×" if abs(r["ratio"] - 1) <= 0.1 else f"[yellow]{r['ratio']:.2f}×")
        table.add_row("memory", name, _gb(r["peak"]), f"predicted {_gb(pred['total'])}", verdict,
                      f"state {_gb(pred['state'])}, activations {_gb(pred['activations'])}, "
                      f"other {_gb(pred['other'])}")
    for r in result.get("allreduce", []):
        table.add_row("allreduce", f"gloo {r['bytes'] / 2**10:.0f} KiB", f"{r['seconds'] * 1e3:.3f} ms", "—",
                      f"{r['bus_GBps']:.2f} GB/s", "gloo via host memory, not NVLink")
    one = result.get("world_one")
    if one:
        table.add_row("exact", "autotp launch at world 1: loss vs plain model", f"{one['loss_diff']:.3g}",
                      f"≤ {FP32_BOUND:g}", "[green]pass" if one["ok"] else "[red]FAIL",
                      f"{one['backend']}, mesh {one['mesh_device']}, tensors on {', '.join(one['devices'])}")
    console.print(table)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU: the same code paths, for CI")
    ap.add_argument("--only", nargs="+", choices=("compute", "memory", "exact"), default=None)
    ap.add_argument("--rows", nargs="+", default=(), help="exact: only the rows whose name holds one of these")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    if not a.cpu and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --cpu for the CPU mode")
    device = torch.device("cpu" if a.cpu else "cuda", None if a.cpu else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    s = _sizes(a.cpu)
    sections = set(a.only or ("compute", "memory", "exact"))
    if a.cpu and "exact" in sections:  # on 2 cores the ranks' imports are a large share of the run, not on a GPU's
        _warm_ranks()
    info = _device_info(device)
    result: dict = {"info": info, "seconds": {}}
    console = Console()
    import gpu_check_compute
    from gpu_check_compute import compute_rows, memory_rows
    from gpu_check_ranks import exact_settings

    if "timing" in s:  # warm-up and timed steps of each compute row (its time_step reads them when it runs)
        gpu_check_compute.WARMUP, gpu_check_compute.TIMED = s["timing"]
    result["settings"] = exact_settings()
    capacity = info["memory_bytes"] or 80 * 2**30
    steps = {
        "compute": lambda: result.__setitem__("compute", compute_rows(
            s["config"], s["shapes"], [2, 4, 8], s["compiled"], device, s["backend"], info["peak_bf16"], console.log)),
        "memory": lambda: result.__setitem__("memory", memory_rows(
            s["config"], device=device, capacity=capacity, log=console.log, **s["memory"])),
        "exact": lambda: _exact(result, s, device, tuple(a.rows)),
    }
    os.makedirs(a.out, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", info["name"].lower()).strip("-") if device.type == "cuda" else "cpu"
    path = os.path.join(a.out, f"gpu-{slug}.json")
    if a.cpu and sections & {"compute", "memory"}:  # on a GPU a collection is nothing beside a layer's steps
        _freeze_imports()
    for name in ("exact", "compute", "memory"):  # the exactness job's processes have exited before any timing
        if name in sections:
            t0 = time.perf_counter()
            with console.status(f"gpu check: {name}"):
                steps[name]()
            result["seconds"][name] = round(time.perf_counter() - t0, 1)
            with open(path, "w") as f:  # after each section: a run cut short keeps what it measured
                json.dump(result, f, indent=1, default=str)
    render(result, console)
    console.print(f"wrote {path}; seconds per section: {result['seconds']}")
    failed = [r["check"] for r in result.get("exact", []) if not r["ok"]]
    if result.get("world_one") and not result["world_one"]["ok"]:
        failed.append("autotp launch at world 1")
    if failed:
        console.print(f"[red]failed: {', '.join(failed)}")
    return 1 if failed else 0


def _warm_ranks() -> None:
    """The exactness job's ranks and the world-1 rank forked from one server that imports their module, the
    export machinery their first capture loads and the Llama's modeling code (transformers imports it on first
    use), once and in the background while this process imports its own: spawned, each of the three ranks
    imported all of it itself, seconds each, and on a 2-core machine they queue."""
    from autotp.distributed.warm import warm_ranks

    warm_ranks(["gpu_check_ranks", "torch._dynamo", "torch.export", "transformers.models.llama.modeling_llama"])


def _freeze_imports() -> None:
    """The modules a capture loads, imported now and with everything else imported so far left out of the
    collector's walks (``gc.freeze``): each layer of the compute and memory sections ends in a full
    collection for that layer's cycles, which otherwise walks all of torch's and transformers' objects (a
    fifth of a second each on a CI machine, more than the layer's own steps)."""
    import torch._dynamo  # noqa: F401
    import torch.export  # noqa: F401

    gc.freeze()


def _exact(result: dict, s: dict, device: torch.device, only: tuple[str, ...]) -> None:
    ranks, one = run_exact(s, device, only)
    rows = ranks[0]["rows"]
    for r, other in zip(rows, ranks[1]["rows"]):  # a row passes only where it passed on both ranks
        r["ok"] = r["ok"] and other["ok"]
        if other["value"] == other["value"] and (r["value"] != r["value"] or other["value"] > r["value"]):
            r["value"], r["note"] = other["value"], other["note"]
    cuda = device.type == "cuda"
    one["ok"] = one["loss_diff"] <= FP32_BOUND and (one["backend"], one["mesh_device"]) == (
        ("nccl", "cuda") if cuda else ("gloo", "cpu")) and one["devices"] == [str(torch.device(device.type, 0))
                                                                             if cuda else "cpu"]
    result["exact"], result["allreduce"], result["world_one"] = rows, ranks[0]["allreduce"], one
    result["settings"]["ranks"] = ranks[0]["settings"]


if __name__ == "__main__":
    sys.exit(main())
