"""What benchmarks/gpu_check.py measures in its own process: one tensor-parallel rank's compute and memory.

The rank runs on torch's fake process group (rank 0 of ``t``; every collective returns at once), so its
time is its own compute alone: the shards of a Llama-shaped decoder layer, forward and backward, against
the unsharded layer's time divided by ``t``. Its peak memory in a training step (fp32 weights, bf16
autocast, AdamW) is set against what ``autotp plan`` predicts for the same layout.

Timing on CUDA: each step is queued on the current stream; ``torch.cuda.synchronize`` before the first
event and after the last; CUDA events around each timed step; 2 warm-up steps (cuBLAS heuristics, the
caching allocator, inductor's autotuning) before 5 timed ones; the median is reported.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import autotp  # noqa: E402
from autotp.parallel.held import held_params  # noqa: E402
from llama_shaped import Config, Layer, rope_table  # noqa: E402

WARMUP, TIMED = 2, 5


class Stack(nn.Module):
    """``layers`` Llama decoder layers on hidden states: (b, s, h) in, (b, s, h) out; ``recompute`` runs each
    under activation checkpointing, as a training script does."""

    def __init__(self, c: Config, layers: int = 1, recompute: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(Layer(c) for _ in range(layers))
        self.recompute = recompute
        self.register_buffer("rope", rope_table(c), persistent=False)  # (positions, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        cos, sin = self.rope[:s].cos(), self.rope[:s].sin()  # (s, d)
        for layer in self.layers:
            x = checkpoint(layer, x, cos, sin, use_reentrant=False) if self.recompute else layer(x, cos, sin)
        return x


@contextlib.contextmanager
def fake_group(world: int) -> Iterator[None]:
    """Rank 0 of ``world`` in this process; collectives do nothing. world 1: no group at all."""
    if world == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step: Callable[[], None], device: torch.device) -> float:
    """Median seconds of ``step`` over 5 runs after 2 warm-ups."""
    for _ in range(WARMUP):
        step()
    _sync(device)
    times = []
    for _ in range(TIMED):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _layer(c: Config, t: int, x: torch.Tensor, compile: dict | None, layers: int = 1, recompute: bool = False,
           dtype: torch.dtype | None = None, sequence_parallel: bool = False) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(x.device):
        model = Stack(c, layers, recompute)
    if dtype is not None:
        model.to(dtype)
    if t > 1:
        return autotp.parallelize(model, example_inputs=((x,), {}), compile=compile or False,
                                  sequence_parallel=sequence_parallel)
    return torch.compile(model, **compile) if compile is not None else model


def _free(device: torch.device) -> None:
    gc.collect()  # a parallelized model's reference cycles: its memory goes back before the next measurement
    if device.type == "cuda":
        torch.cuda.empty_cache()


def compute_rows(c: Config, shapes: list[tuple[int, int]], tps: list[int], compiled: set[tuple[int, int, int]],
                 device: torch.device, backend: str, peak: float | None,
                 log: Callable[..., None] = print) -> list[dict]:
    """Forward + backward of one layer in bf16 on one rank of each tp, eager and (for the (b, s, t) in
    ``compiled``) compiled: seconds, achieved TFLOP/s (FLOPs counted by torch's FlopCounterMode on the rank's
    own shards), % of the device's peak, and the unsharded time / t over the rank's time (1.0: a perfect
    split of the compute)."""
    rows, flops = [], {}
    for b, s in shapes:
        x = torch.randn(b, s, c.hidden_size, device=device, dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        base: dict[bool, float] = {}
        for t in [1, *tps]:
            for comp in (False, True):
                if comp and (b, s, t) not in compiled:
                    continue
                with fake_group(t):
                    model = _layer(c, t, x, {"backend": backend} if comp else None, dtype=torch.bfloat16)
                    xr = x.detach().requires_grad_()

                    def step() -> None:
                        for p in model.parameters():
                            p.grad = None
                        xr.grad = None
                        model(xr).backward(dy)

                    if (b, s, t) not in flops:
                        with FlopCounterMode(display=False) as counter:
                            step()
                        flops[(b, s, t)] = counter.get_total_flops()
                    seconds = time_step(step, device)
                    model = xr = None  # freed before the next layer is built
                    _free(device)
                if t == 1:
                    base[comp] = seconds
                f = flops[(b, s, t)]
                ideal = base[comp] / t if comp in base else None
                rows.append({"batch": b, "seq": s, "tp": t, "compiled": comp, "seconds": seconds, "flops": f,
                             "tflops": f / seconds / 1e12, "peak_pct": 100 * f / seconds / peak if peak else None,
                             "ideal_seconds": ideal, "split_efficiency": ideal / seconds if ideal else None})
                log(f"compute {b}×{s} tp {t} {'compiled' if comp else 'eager'}: {seconds * 1e3:.2f} ms, "
                    f"{f / seconds / 1e12:.1f} TFLOP/s")
    return rows


def predicted_memory(c: Config, t: int, layers: int, b: int, s: int, sp: bool, recompute: bool,
                     capacity: float) -> dict:
    """What ``autotp plan`` predicts for one rank: the layout's memory from the model's facts (captured on
    meta), bf16 activations, fp32 weights with AdamW."""
    from autotp.search.cost import Candidate, Training, estimate
    from autotp.search.model_costs import capture_costs
    from autotp.search.hardware import H100

    with torch.device("meta"):
        net = Stack(c, layers)
    x = torch.zeros(b, s, c.hidden_size, device="meta")
    facts = capture_costs(net, (x,), {}, [t], b, s)
    hw = dataclasses.replace(H100, memory_bytes=capacity)
    lay = Candidate(tp=t, dp=1, pp=1, micro_batch=b, microbatches=1, sp=sp, recompute=recompute)
    mem = estimate(facts, hw, lay, Training(act_bytes=2, seq=s)).memory
    return {"state": mem.state, "activations": mem.activations, "other": mem.other, "total": mem.total}


def measured_memory(c: Config, t: int, layers: int, b: int, s: int, sp: bool, recompute: bool,
                    device: torch.device) -> dict:
    """Peak bytes allocated in the second training step (the first allocates AdamW's state) of one rank:
    fp32 weights, forward under bf16 autocast, backward, fused AdamW. None off CUDA (the step still runs)."""
    _free(device)
    x = torch.randn(b, s, c.hidden_size, device=device)
    with fake_group(t):
        model = _layer(c, t, x, None, layers, recompute, sequence_parallel=sp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        dy = torch.randn_like(x)

        marks: dict[str, int] = {}
        cuda = device.type == "cuda"

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            marks["start"] = torch.cuda.memory_allocated(device) if cuda else 0  # weights + AdamW state
            with torch.autocast(device.type, dtype=torch.bfloat16):
                y = model(x)
            marks["forward"] = torch.cuda.memory_allocated(device) if cuda else 0  # + what backward keeps
            marks["forward_peak"] = torch.cuda.max_memory_allocated(device) if cuda else 0
            y.backward(dy)
            opt.step()

        step()
        _sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        held = held_params(model).elements  # this rank's: local shards, a tied weight once
        model = opt = None
        _free(device)
    return {"peak": peak, "params": held, "marks": marks}


def memory_rows(c: Config, t: int, layers: int, b: int, s: int, device: torch.device, capacity: float,
                log: Callable[..., None] = print) -> list[dict]:
    rows = []
    for sp in (False, True):
        for recompute in (False, True):
            row = {"tp": t, "layers": layers, "batch": b, "seq": s, "sp": sp, "recompute": recompute}
            try:
                row["predicted"] = predicted_memory(c, t, layers, b, s, sp, recompute, capacity)
                row.update(measured_memory(c, t, layers, b, s, sp, recompute, device))
                if row["peak"]:
                    row["ratio"] = row["peak"] / row["predicted"]["total"]
            except Exception as exc:  # recorded: the other layouts still run
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            rows.append(row)
            log(f"memory sp={sp} recompute={recompute}: peak {row.get('peak')}, "
                f"predicted {row.get('predicted', {}).get('total')} {row.get('error', '')}")
    return rows
