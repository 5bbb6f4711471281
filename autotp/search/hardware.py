"""What the layout search assumes about the machines: a hardware profile, as plain data.

A :class:`Hardware` says how fast one device multiplies matrices and moves bytes through its memory, how
much memory it has, and how long a collective takes inside a node and between nodes. Two presets describe
NVIDIA's 8-GPU nodes from their datasheets; ``autotp profile`` measures the machine it runs on and writes the
same fields as JSON (:func:`save` / :func:`load`), with the collectives it timed per group size.

A collective of ``S`` bytes over ``n`` ranks costs ``latency + wire(S, n) / bandwidth`` where ``wire`` is
what a ring sends per rank (NCCL's "bus bandwidth" convention): all-reduce 2·(n − 1)/n·S, all-gather and
reduce-scatter (n − 1)/n·S of the full tensor, a point-to-point send S. A group whose members sit on several
nodes runs at the inter-node bandwidth of one GPU times the members it has on each node (each GPU has its
own network card; NCCL runs one ring per card), never faster than the links inside a node.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROFILE_VERSION = 1
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send")


def wire(kind: str, nbytes: float, ranks: int) -> float:
    """Bytes a ring sends per rank for a ``kind`` collective of ``nbytes`` (the full tensor) over ``ranks``."""
    factor = {"all_reduce": 2 * (ranks - 1) / ranks, "all_gather": (ranks - 1) / ranks,
              "reduce_scatter": (ranks - 1) / ranks, "send": 1.0}
    if kind not in factor:
        raise ValueError(f"unknown collective {kind!r}; one of {', '.join(factor)}")
    return factor[kind] * nbytes


@dataclass(frozen=True)
class Link:
    latency: float  # seconds per collective
    bandwidth: float  # bytes/s of bus bandwidth (see the module doc)


@dataclass(frozen=True)
class Measured:
    """A collective timed on the machine itself, fitted to ``latency + wire / bandwidth``."""

    kind: str  # one of KINDS
    ranks: int
    link: Link
    points: tuple[tuple[int, float], ...] = ()  # (bytes, seconds) it was fitted to


@dataclass(frozen=True)
class Hardware:
    name: str
    matmul_flops: float  # sustained FLOP/s of the model's matmuls in its training dtype, per device
    peak_flops: float  # the datasheet peak in that dtype (for "% of peak")
    memory_bandwidth: float  # bytes/s: what memory-bound work (norms, softmax, activations) runs at
    memory_bytes: int  # per device
    gpus_per_node: int
    intra: Link  # collectives inside a node
    inter: Link  # between nodes, per GPU (one network card each)
    overhead: float = 0.0  # seconds of fixed cost per op dispatched (a kernel launch, eager dispatch on a CPU)
    optimizer: float = 0.0  # seconds of an AdamW step per parameter (0: its state read and written once)
    overlap: bool = True  # collectives run beside compute (GPUs' copy engines); not where they share its cores
    share: float = 1.0  # ranks taking turns on one device (more ranks than CPU cores): one's idle time is another's
    # how the matmuls' rate falls with their size: a micro-batch of M tokens on a rank, of a model of hidden size
    # h, runs its matmuls at matmul_flops · M / (M + matmul_tokens) · h / (h + matmul_width) (0: at matmul_flops
    # whatever the size); fewer rows and a shorter inner dimension leave more of the GPU's tiles idle
    matmul_tokens: float = 0.0
    matmul_width: float = 0.0
    # bytes/s read + written copying parameters and gradients into a collective's flat buffer and back out
    # (DDP's buckets, FSDP2's copy-in and copy-out), measured by autotp profile; 0: not measured, and the
    # memory bandwidth is assumed (:attr:`copy_rate`)
    copy_bandwidth: float = 0.0
    measured: tuple[Measured, ...] = ()
    matmuls: tuple[tuple[int, int, int, float], ...] = ()  # (m, k, n, FLOP/s) measured by autotp profile
    source: str = ""
    extra: dict = field(default_factory=dict, compare=False)  # free-form facts a profile records

    def link(self, kind: str, ranks: int, per_node: int) -> Link:
        """The link a ``kind`` collective over ``ranks`` ranks runs on, ``per_node`` of them on each node."""
        for m in self.measured:
            if m.kind == kind and m.ranks == ranks:
                return m.link
        if per_node >= ranks:
            return self.intra
        bandwidth = min(self.intra.bandwidth, self.inter.bandwidth * max(1, per_node))
        return Link(max(self.intra.latency, self.inter.latency), bandwidth)

    def collective(self, kind: str, nbytes: float, ranks: int, per_node: int | None = None, count: int = 1) -> float:
        """Seconds for ``count`` collectives of ``nbytes`` each (the full tensor) over ``ranks`` ranks."""
        if (ranks <= 1 and kind != "send") or nbytes <= 0 or count <= 0:
            return 0.0
        link = self.link(kind, ranks, ranks if per_node is None else per_node)
        return count * (link.latency + wire(kind, nbytes, ranks) / link.bandwidth)

    @property
    def copy_rate(self) -> float:
        """Bytes/s (read + written) of the copies into and out of communication buffers: measured, else the
        memory bandwidth (assumed)."""
        return self.copy_bandwidth or self.memory_bandwidth

    def matmul_rate(self, tokens: float, hidden: float) -> float:
        """FLOP/s of the matmuls of a model of ``hidden`` size for a micro-batch of ``tokens`` rows on one rank."""
        rows = tokens / (tokens + self.matmul_tokens) if tokens > 0 else 1.0
        width = hidden / (hidden + self.matmul_width) if hidden > 0 else 1.0
        return self.matmul_flops * rows * width

    def to_dict(self) -> dict:
        return {"version": PROFILE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> Hardware:
        version = d.get("version")
        if version != PROFILE_VERSION:
            raise ValueError(f"hardware profile version {version!r}, expected {PROFILE_VERSION}")
        try:
            measured = tuple(Measured(m["kind"], int(m["ranks"]), Link(**m["link"]),
                                      tuple((int(b), float(s)) for b, s in m.get("points", ())))
                             for m in d.get("measured", ()))
            hw = cls(name=str(d["name"]), matmul_flops=float(d["matmul_flops"]), peak_flops=float(d["peak_flops"]),
                     memory_bandwidth=float(d["memory_bandwidth"]), memory_bytes=int(d["memory_bytes"]),
                     gpus_per_node=int(d["gpus_per_node"]), intra=Link(**d["intra"]), inter=Link(**d["inter"]),
                     overhead=float(d.get("overhead", 0.0)), optimizer=float(d.get("optimizer", 0.0)),
                     overlap=bool(d.get("overlap", True)), share=float(d.get("share", 1.0)),
                     matmul_tokens=float(d.get("matmul_tokens", 0.0)), matmul_width=float(d.get("matmul_width", 0.0)),
                     copy_bandwidth=float(d.get("copy_bandwidth", 0.0)), measured=measured,
                     matmuls=tuple(tuple(x) for x in d.get("matmuls", ())),
                     source=str(d.get("source", "")), extra=dict(d.get("extra", {})))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"hardware profile is missing or mistypes a field: {exc}") from None
        bad = [k for k in ("matmul_flops", "peak_flops", "memory_bandwidth", "memory_bytes")
               if not (math.isfinite(getattr(hw, k)) and getattr(hw, k) > 0)]
        if bad or hw.gpus_per_node < 1:
            raise ValueError(f"hardware profile {hw.name!r}: {', '.join(bad) or 'gpus_per_node'} must be positive")
        return hw


GB = 10**9
GiB = 2**30

def _datasheet(name: str, peak: float, hbm: float, nvlink: int, infiniband: int, sheet: str) -> Hardware:
    """An 8-GPU node of 80 GB parts from its datasheet numbers (``peak`` dense bf16 FLOP/s, HBM GB/s, NVLink
    and InfiniBand GB/s each way per GPU), with the stated assumptions for what a training step sustains: the
    matmuls' rate a curve in the micro-batch's rows and the model's width whose three constants reproduce
    Megatron's published A100 throughput (``benchmarks/megatron_table1.py``), carried over to the H100."""
    return Hardware(
        name=name,
        matmul_flops=0.8 * peak,
        matmul_tokens=300,
        matmul_width=840,
        peak_flops=peak,
        memory_bandwidth=hbm * GB,
        memory_bytes=80 * GB,
        gpus_per_node=8,
        intra=Link(10e-6, 0.8 * nvlink * GB),
        inter=Link(20e-6, 0.9 * infiniband * GB),
        overhead=5e-6,
        source=f"{sheet} Assumed, not measured: matmuls sustain 80% of peak × M/(M + 300) × h/(h + 840) for "
               "micro-batches of M tokens per rank and hidden size h (the curve fitted to Narayanan et al. 2021, "
               f"Table 1, A100s: 58% of peak at M 2048, h 4096), NVLink collectives 80% of {nvlink} "
               f"GB/s each way, InfiniBand 90% of {infiniband} GB/s, 5 µs per op launched; run `autotp profile` "
               "on the cluster for measured numbers.",
    )


# A100-SXM4-80GB: NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOP/s dense bf16/fp16, 80 GB HBM2e at
# 2,039 GB/s, third-generation NVLink 600 GB/s per GPU (300 GB/s each way). DGX A100 user guide: eight
# ConnectX-6 200 Gb/s HDR InfiniBand cards for compute traffic, one per GPU (25 GB/s). This is the node of
# Narayanan et al. 2021 (Selene), §5.
A100 = _datasheet("a100", 312e12, 2039, 300, 25,
                  "NVIDIA A100 datasheet (312 TFLOP/s bf16 dense, 80 GB HBM2e, 2,039 GB/s, NVLink 600 GB/s); DGX "
                  "A100 user guide (8 × 200 Gb/s HDR InfiniBand, one per GPU).")

# H100-SXM5-80GB: NVIDIA H100 Tensor Core GPU datasheet: 989 TFLOP/s dense bf16 (1,979 with sparsity), 80 GB HBM3
# at 3.35 TB/s, fourth-generation NVLink 900 GB/s per GPU (450 GB/s each way). DGX H100 user guide: eight
# ConnectX-7 400 Gb/s NDR InfiniBand cards, one per GPU (50 GB/s).
H100 = _datasheet("h100", 989e12, 3350, 450, 50,
                  "NVIDIA H100 SXM datasheet (989 TFLOP/s bf16 dense, 80 GB HBM3, 3.35 TB/s, NVLink 900 GB/s); DGX "
                  "H100 user guide (8 × 400 Gb/s NDR InfiniBand, one per GPU).")

PRESETS = {"a100": A100, "h100": H100}


def save(hw: Hardware, path: Path) -> None:
    Path(path).write_text(json.dumps(hw.to_dict(), indent=2))


def load(path: Path) -> Hardware:
    """A profile written by ``autotp profile`` (JSON; never unpickled)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read hardware profile {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"hardware profile {path} is not a JSON object")
    return Hardware.from_dict(data)


def resolve(name_or_path: str) -> Hardware:
    """A preset by name (``a100``, ``h100``) or a profile file."""
    key = name_or_path.lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path)
    if not path.exists():
        raise ValueError(f"--gpu {name_or_path!r}: neither a preset ({', '.join(PRESETS)}) nor a profile file")
    return load(path)
