"""Measure the machine a job runs on: matmul rate, memory bandwidth, and collectives per group size.

``autotp profile`` starts N ranks on this node with :func:`autotp.distributed.launch.launch` and runs
:func:`profile_worker` on each, handing it the job (:class:`~autotp.distributed.job.RankJob`) as its argument.
Every measurement runs on all ranks at once, as a training job's ranks run: an oversubscribed CPU or a shared
memory bus then shows the per-rank rate a real job sees, not one rank's rate on an idle machine. A sample is
the mean of enough back-to-back calls to outlast the timer's noise (the same count on every rank); a number is
the median of several samples after a warm-up, and the slowest rank's median is kept, since a synchronous job
waits for its slowest rank.

Collectives run in every group size ``n`` that divides the world, on groups of adjacent ranks ([0..n-1],
[n..2n-1], ...), all groups at once, as tensor-parallel groups are placed; point-to-point is a ping-pong
between ranks 2i and 2i+1 (half a round trip per message). Each (kind, n) is fitted to the cost model of
:mod:`autotp.search.hardware` (``latency + wire(S, n) / bandwidth``, its wire convention exactly), so
``Hardware.collective`` reproduces the measured times. Rank 0 assembles the :class:`Hardware`.
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autotp.distributed.job import RankJob
from autotp.distributed.launch import init_job
from autotp.search.hardware import Hardware, Link, Measured, wire

__all__ = ["DTYPES", "ProfileJob", "block_sizes", "default_shapes", "fit_link", "message_sizes", "profile_worker",
           "wire_bytes"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# what rank 0 says as it starts each measurement: (phase, what), e.g. ("matmuls", "8 shapes in bf16 ...")
Say = Callable[[str, str], None]
KiB, MiB = 2**10, 2**20
# the fit's bound when times do not grow with size (noise at small sizes): above any real link
MAX_BANDWIDTH = 1e13
wire_bytes = wire  # what a ring sends per rank, as Hardware.collective counts it


def fit_link(kind: str, ranks: int, points: Sequence[tuple[int, float]]) -> Link:
    """``seconds = latency + wire / bandwidth`` fitted to ``(bytes, seconds)`` points by least squares.

    Errors are weighted relative to each time (1/seconds²): sizes span four orders of magnitude, and plain
    least squares would let the largest messages' noise decide the latency. The fit is constrained to
    latency ≥ 0 and bandwidth ≤ :data:`MAX_BANDWIDTH`; where the free fit breaks one, the better fit on
    either boundary is taken (a two-parameter least squares' constrained optimum lies on one).
    """
    pts = [(wire_bytes(kind, b, ranks), float(s)) for b, s in points]
    if not pts or any(not (x > 0 and math.isfinite(y) and y > 0) for x, y in pts):
        raise ValueError(f"{kind} over {ranks} ranks: need points of positive bytes and seconds, got {list(points)}")
    w = [1 / y**2 for _, y in pts]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, pts))
    sy = sum(wi * y for wi, (_, y) in zip(w, pts))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, pts))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, pts))
    min_slope = 1 / MAX_BANDWIDTH

    def cost(a: float, b: float) -> float:
        return sum(wi * (a + b * x - y) ** 2 for wi, (x, y) in zip(w, pts))

    det = sw * sxx - sx * sx
    if det > 1e-12 * sw * sxx:
        slope = (sw * sxy - sx * sy) / det
        latency = (sy - slope * sx) / sw
        if latency >= 0 and slope >= min_slope:
            return Link(latency, 1 / slope)
    through_origin = (0.0, max(sxy / sxx, min_slope))
    flat = (max(0.0, (sy - min_slope * sx) / sw), min_slope)
    latency, slope = min((through_origin, flat), key=lambda c: cost(*c))
    return Link(latency, 1 / slope)


def default_shapes(device: str, quick: bool = False) -> tuple[tuple[int, int, int], ...]:
    """(m, k, n) of a transformer's matmuls at a size the device finishes in seconds: m tokens, k and n the
    hidden and MLP widths. Small on a CPU, where several ranks may share a core."""
    if device == "cuda":
        shapes = ((8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096), (8192, 8192, 8192))
        return shapes[:2] if quick else shapes
    if quick:
        return (512, 256, 256), (512, 512, 512), (512, 512, 1024)
    return (512, 256, 256), (512, 512, 512), (512, 1024, 1024), (512, 1024, 2048), (512, 2048, 2048)


def message_sizes(device: str, quick: bool = False) -> tuple[int, ...]:
    """Bytes of the full tensor, powers of 4 from 4 KiB to 16 MiB; to 256 MiB on GPUs, whose collectives
    reach their bandwidth only at hundreds of MiB."""
    top = 256 * MiB if device == "cuda" else 16 * MiB
    sizes = tuple(4 * KiB * 4**i for i in range(20) if 4 * KiB * 4**i <= top)
    return sizes[::2] if quick else sizes


@dataclass(frozen=True)
class ProfileJob:
    """What every rank measures; made by the launching process, sent to each rank."""

    device: str  # "cpu" (gloo) or "cuda" (nccl)
    dtype: str  # of the matmuls: a key of DTYPES
    shapes: tuple[tuple[int, int, int], ...]  # (m, k, n)
    sizes: tuple[int, ...]  # message bytes, the full tensor
    copy_bytes: int  # the tensor copied for the memory bandwidth
    repeats: int  # samples per number (the median is kept)
    target: float  # seconds a sample should last at least
    shapes_from: str = "default transformer shapes"  # for the profile's source line
    buffer_hidden: int = 1024  # the buffer copies' tensors: one transformer block's parameters of this width

    @classmethod
    def make(cls, device: str, dtype: str, shapes: Sequence[tuple[int, int, int]] | None = None,
             quick: bool = False, shapes_from: str | None = None) -> ProfileJob:
        copy_bytes = (512 if device == "cuda" else 64) * MiB
        return cls(device, dtype, tuple(shapes or default_shapes(device, quick)), message_sizes(device, quick),
                   copy_bytes, 3 if quick else 5, 0.005 if quick else 0.02,
                   shapes_from or "default transformer shapes", 4096 if device == "cuda" else 1024)


class _Ctx:
    """This rank's device and the world-wide agreement every measurement needs."""

    def __init__(self, device: torch.device, job: ProfileJob) -> None:
        self.device, self.job = device, job

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def world_max(self, values: Sequence[float]) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def time(self, fn: Callable[[], object]) -> float:
        """The slowest rank's median seconds per ``fn()``; collective: every rank calls it, in the same order."""
        fn()  # warm-up: first-call costs (connections, kernels, page faults)
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        # the same count everywhere, from the slowest rank's call: a collective's ranks must all call it, and
        # ranks stopping early would free cores for the others
        once = self.world_max([time.perf_counter() - start])[0]
        iters = min(1000, max(1, math.ceil(self.job.target / max(once, 1e-7))))
        samples = []
        for _ in range(self.job.repeats):
            self.world_max([0.0])  # all ranks start together
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            self.sync()
            samples.append((time.perf_counter() - start) / iters)
        return self.world_max([statistics.median(samples)])[0]


def _matmuls(ctx: _Ctx) -> list[tuple[int, int, int, float]]:
    dtype = DTYPES[ctx.job.dtype]
    out = []
    for m, k, n in ctx.job.shapes:
        a = torch.randn(m, k, device=ctx.device).to(dtype)
        b = torch.randn(k, n, device=ctx.device).to(dtype)
        c = torch.empty(m, n, device=ctx.device, dtype=dtype)
        seconds = ctx.time(lambda: torch.mm(a, b, out=c))
        out.append((m, k, n, 2 * m * k * n / seconds))
        del a, b, c
    return out


def _memory_bandwidth(ctx: _Ctx) -> float:
    src = torch.ones(ctx.job.copy_bytes // 4, device=ctx.device)
    dst = torch.empty_like(src)
    seconds = ctx.time(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / seconds  # read + written


def block_sizes(h: int) -> list[int]:
    """Elements of one GPT block's parameters at width ``h`` (qkv, projection, MLP in and out with their biases,
    two norms): the tensors a DDP bucket or an FSDP unit copies into one flat buffer."""
    return [3 * h * h, 3 * h, h * h, h, 4 * h * h, 4 * h, 4 * h * h, h, h, h, h, h]


def _buffer_copies(ctx: _Ctx) -> float:
    """Bytes/s (read + written) of copying a block's parameters into one flat buffer and back out, as DDP's
    buckets and FSDP2's all-gather copy-in and copy-out do around each collective: ``torch.cat`` into the
    buffer, ``split_with_sizes_copy`` out of it (fp32, as gradients are reduced)."""
    sizes = block_sizes(ctx.job.buffer_hidden)
    tensors = [torch.ones(n, device=ctx.device) for n in sizes]
    flat = torch.empty(sum(sizes), device=ctx.device)

    def both() -> None:
        torch.cat(tensors, out=flat)
        torch.split_with_sizes_copy(flat, sizes, out=tensors)

    seconds = ctx.time(both)
    return 2 * 2 * flat.numel() * flat.element_size() / seconds  # two copies, each read + written


def _op_overhead(ctx: _Ctx) -> float:
    """The fixed cost of one op: an add on 16 elements, launched (GPU) or dispatched (CPU) from Python as an
    eager graph runs its nodes; the planner charges it per op of the model's graph and per pass."""
    x = torch.ones(16, device=ctx.device)
    y = torch.empty_like(x)
    return ctx.time(lambda: torch.add(x, 1, out=y))


def _optimizer(ctx: _Ctx) -> float:
    """Seconds per parameter of one AdamW step (torch's default implementation for the device) on 4M
    parameters with gradients: what the planner charges per parameter a rank holds."""
    n = 1 << 22
    params = [torch.nn.Parameter(torch.randn(n // 4, device=ctx.device)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)
    return ctx.time(opt.step) / n


def _first(*names: str) -> Callable | None:
    # torch 2.13 renames the tensor collectives (*_single) and deprecates the old names
    return next((getattr(dist, n) for n in names if hasattr(dist, n)), None)


def _collective(kind: str, nbytes: int, group: dist.ProcessGroup, n: int, dtype: torch.dtype,
                device: torch.device, listed: bool = False) -> tuple[Callable[[], object], int]:
    """The call to time and the bytes of its full tensor (rounded down to n equal shards)."""
    elt = torch.empty((), dtype=dtype).element_size()
    numel = max(n, nbytes // elt // n * n)
    full = torch.ones(numel, dtype=dtype, device=device)
    shard = torch.ones(numel // n, dtype=dtype, device=device)
    if kind == "all_reduce":
        call = lambda: dist.all_reduce(full, group=group)  # noqa: E731
    elif kind == "all_gather" and listed:
        parts = list(full.chunk(n))
        call = lambda: dist.all_gather(parts, shard, group=group)  # noqa: E731
    elif kind == "all_gather":
        gather = _first("all_gather_single", "all_gather_into_tensor")
        call = lambda: gather(full, shard, group=group)  # noqa: E731
    else:
        scatter = _first("reduce_scatter_single", "reduce_scatter_tensor")
        call = lambda: scatter(shard, full, group=group)  # noqa: E731
    return call, numel * elt


def _supported(kind: str, group: dist.ProcessGroup, n: int, dtype: torch.dtype, device: torch.device,
               listed: bool = False) -> bool:
    """Whether every rank's backend runs ``kind``: an unsupported one raises before it communicates."""
    try:
        call, _ = _collective(kind, 64 * n, group, n, dtype, device, listed)
        call()
        ok = 1.0
    except (RuntimeError, NotImplementedError, ValueError, TypeError):
        ok = 0.0
    t = torch.tensor([ok], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _pingpong(nbytes: int, dtype: torch.dtype, device: torch.device, rank: int, world: int) -> Callable[[], object]:
    buf = torch.ones(max(1, nbytes // torch.empty((), dtype=dtype).element_size()), dtype=dtype, device=device)
    if rank % 2 == 0 and rank + 1 < world:
        return lambda: (dist.send(buf, rank + 1), dist.recv(buf, rank + 1))
    if rank % 2 == 1:
        return lambda: (dist.recv(buf, rank - 1), dist.send(buf, rank - 1))
    return lambda: None  # the odd one out of an odd world


def _collectives(ctx: _Ctx, rank: int, world: int, say: Say) -> tuple[list[Measured], dict[str, str]]:
    # gloo reduces bf16 slowly, on the CPU, element by element: the bytes on the wire are what is measured
    dtype = DTYPES[ctx.job.dtype] if ctx.device.type == "cuda" else torch.float32
    sizes = [n for n in range(2, world + 1) if world % n == 0]
    groups: dict[int, dist.ProcessGroup] = {}
    for n in sizes:  # every rank creates every group, in the same order
        for start in range(0, world, n):
            g = dist.group.WORLD if n == world else dist.new_group(list(range(start, start + n)))
            if start <= rank < start + n:
                groups[n] = g
    measured, notes = [], {}
    for n in sizes:
        say("collectives", f"all-reduce, all-gather and reduce-scatter over groups of {n} ranks, "
            f"{len(ctx.job.sizes)} message sizes each")
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            listed = False
            if not _supported(kind, groups[n], n, dtype, ctx.device):
                if kind == "all_gather" and _supported(kind, groups[n], n, dtype, ctx.device, listed=True):
                    listed = True
                    notes["all_gather"] = "timed as all_gather into a list: the backend has no all_gather_single"
                else:
                    notes[kind] = f"not measured: the {dist.get_backend()} backend does not support it"
                    continue
            points = []
            for nbytes in ctx.job.sizes:
                call, actual = _collective(kind, nbytes, groups[n], n, dtype, ctx.device, listed)
                points.append((actual, ctx.time(call)))
            measured.append(Measured(kind, n, fit_link(kind, n, points), tuple(points)))
    say("collectives", "send and receive between pairs of ranks")
    points = []
    for nbytes in ctx.job.sizes:
        seconds = ctx.time(_pingpong(nbytes, dtype, ctx.device, rank, world))
        points.append((nbytes, seconds / 2))  # half a round trip per message
    measured.append(Measured("send", 2, fit_link("send", 2, points), tuple(points)))
    return measured, notes


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def _memory_bytes(device: torch.device, per_node: int) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // per_node


def _silent(phase: str, what: str) -> None:
    pass


def profile_worker(ranks: RankJob, job: ProfileJob, say: Say | None = None) -> dict | None:
    """One rank of ``autotp profile`` (``ranks``: the job the launcher handed it, its ranks all on this node);
    rank 0 returns the profile (``Hardware.to_dict()``), the others None. ``say(phase, what)``: rank 0 says
    what it measures next (the whole run takes tens of seconds)."""
    ctx = init_job(ranks)
    try:
        return _profile(job, _Ctx(ctx.device, job), ctx.rank, ranks.grid.world_size,
                        say if say is not None and ctx.rank == 0 else _silent)
    finally:
        dist.destroy_process_group()


def _profile(job: ProfileJob, ctx: _Ctx, rank: int, world: int, say: Say = _silent) -> dict | None:
    torch.manual_seed(rank)
    say("matmuls", f"{len(job.shapes)} shapes in {job.dtype}, on all {world} ranks at once")
    matmuls = _matmuls(ctx)
    say("memory", f"bandwidth: a {job.copy_bytes // MiB} MiB copy")
    bandwidth = _memory_bandwidth(ctx)
    say("memory", f"buffer copies: a block's parameters (width {job.buffer_hidden}) into a flat buffer and out")
    copies = _buffer_copies(ctx)
    say("overhead", "one op's fixed cost: an add of 16 elements")
    overhead = _op_overhead(ctx)
    say("optimizer", "an AdamW step on 4M parameters")
    optimizer = _optimizer(ctx)
    measured, notes = _collectives(ctx, rank, world, say)
    if rank != 0:
        return None
    per_node = world  # one node measured: every rank is on it
    flops = sum(2 * m * k * n for m, k, n, _ in matmuls)
    seconds = sum(2 * m * k * n / rate for m, k, n, rate in matmuls)
    largest = max((x for x in measured if x.kind == "all_reduce"), key=lambda x: x.ranks)
    cuda = ctx.device.type == "cuda"
    memory = "total device memory" if cuda else f"physical RAM / {per_node} ranks per node"
    source = (f"measured by `autotp profile` on {world} {job.device} ranks of one node ({job.dtype} matmuls), "
              f"{datetime.date.today().isoformat()}, every measurement on all ranks at once, the slowest rank's "
              f"median kept. matmul_flops: sustained over {len(matmuls)} shapes ({job.shapes_from}), total "
              f"flops / total time; peak_flops: the best single shape measured, not a datasheet peak; "
              f"memory_bandwidth: a {job.copy_bytes // MiB} MiB copy per rank, bytes read + written; copy_bandwidth: "
              f"a GPT block's fp32 parameters (width {job.buffer_hidden}) copied into one flat buffer (torch.cat) and "
              f"out of it (split_with_sizes_copy), bytes read + written; overhead: "
              f"one add of 16 elements; optimizer: an AdamW step on 4M parameters, per parameter; overlap: "
              f"{'collectives on copy engines beside compute' if cuda else 'none, gloo runs on the ranks cores'}; "
              f"share: ranks per core; "
              f"memory_bytes: {memory}; measured: each collective per group size of adjacent ranks, all groups "
              f"at once, fitted to latency + wire / bandwidth (send: half a ping-pong round trip between ranks "
              f"2i and 2i+1); intra: all_reduce fitted over {largest.ranks} ranks; inter: the same as intra (one "
              f"node measured, no link between nodes).")
    hw = Hardware(
        name=torch.cuda.get_device_name(ctx.device) if cuda else f"cpu-{socket.gethostname()}",
        matmul_flops=flops / seconds, peak_flops=max(rate for *_, rate in matmuls),
        memory_bandwidth=bandwidth, copy_bandwidth=copies, overhead=overhead, optimizer=optimizer, overlap=cuda,
        share=1.0 if cuda else max(1.0, per_node / (os.cpu_count() or per_node)), memory_bytes=_memory_bytes(ctx.device, per_node), gpus_per_node=per_node,
        intra=largest.link, inter=largest.link, measured=tuple(measured), matmuls=tuple(matmuls), source=source,
        extra={"nproc": world, "device": job.device, "dtype": job.dtype, "torch": torch.__version__,
               "threads_per_rank": torch.get_num_threads(), "backend": dist.get_backend(),
               "collective_dtype": "bf16" if cuda and job.dtype == "bf16" else "fp32",
               "cpu": _cpu_model(), "shapes": job.shapes_from, "collective_notes": notes},
    )
    return hw.to_dict()

