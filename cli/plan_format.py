"""Number and name formatting shared by ``autotp plan``'s tables."""
from __future__ import annotations

DIRECTION = {"forward": "fwd", "backward": "bwd"}


def fmt_count(x: int | None) -> str:
    return "?" if x is None else f"{x:,}"


def fmt_size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def fmt_kind(kind: str, op: str) -> str:
    """``all-reduce(sum)``, ``reduce-scatter(sum)``, ``all-gather``."""
    return kind.replace("_", "-") + (f"({op})" if op else "")


def fmt_shape(s: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]"


# -- the tables ----------------------------------------------------------------------------------------


def data_parallel_name(dp: int, fsdp: int) -> str:
    """Which data parallelism runs over ``dp`` replicas: ``DDP`` (gradients averaged by all-reduce), ``FSDP``
    (``fsdp`` 1: parameters, gradients and optimizer state sharded over the dp ranks), ``HSDP 2×2`` (``fsdp``
    replica groups × the ranks each shards over); '' at dp 1."""
    if dp <= 1:
        return ""
    if fsdp > 1:
        return f"HSDP {fsdp}×{dp // fsdp}"
    return "FSDP" if fsdp == 1 else "DDP"
