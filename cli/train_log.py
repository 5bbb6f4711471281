"""The training log of ``autotp shard``: what trainers log, per step, where people look for it.

Every ``--log-every`` steps rank 0 records a :class:`StepMetrics` and sends it to

- ``OUT/metrics.jsonl``: one JSON object per line (appended, so a resumed run continues the file);
- TensorBoard (``OUT/tensorboard``) when the ``tensorboard`` package is installed (the ``tensorboard`` extra):
  a scalar per field under ``train/``;
- the model file's ``log_metrics(metrics: dict)``, when it defines one: the hook for any other logger
  (``wandb.log``, MLflow, a print);
- the console: a line per logged step when piped, the progress bar's fields in a terminal.

Throughput is counted as torchtitan and Megatron count it: tokens per step are the batch's tokens times the
data-parallel replicas; tokens/s per rank divides by every rank (tp × dp × pp). MFU is the model's FLOPs per
step (three times the forward's matmul and attention FLOPs, from the captured graph's shapes:
:mod:`autotp.analysis.flops`) per rank per second, against the device's peak (``--gpu`` or
``./autotp-profile.json``); without a peak it is left out, never guessed.
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    step_s: float  # this step's wall time on rank 0 (forward, backward, optimizer step)
    tokens: int  # tokens trained this step, over every data-parallel replica
    tokens_per_s: float  # all ranks together
    tokens_per_s_per_rank: float  # tokens_per_s / world size
    grad_norm: float | None  # the full model's gradient norm before clipping (None: not computed)
    peak_memory: int  # bytes: this rank's peak (CUDA: max allocated; CPU: the process's peak resident set)
    mfu: float | None  # model FLOPs utilisation, 0-1 (None: no device peak known)
    lr: float
    elapsed_s: float  # since the command started

    def line(self) -> str:
        """The console's line for this step."""
        norm = "" if self.grad_norm is None else f" grad norm {self.grad_norm:.4f}"
        mfu = "" if self.mfu is None else f" MFU {100 * self.mfu:.2f}%"
        return (f"step {self.step} loss {self.loss:.4f}{norm} {self.step_s * 1e3:.0f} ms "
                f"{self.tokens_per_s:,.0f} tok/s ({self.tokens_per_s_per_rank:,.0f}/rank){mfu} "
                f"mem {size(self.peak_memory)}")


def peak_memory(device_type: str) -> int:
    """This rank's peak memory so far, in bytes: CUDA's max allocated, else the process's peak RSS."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes


def mfu(flops_per_rank_step: float | None, step_s: float, peak_flops: float | None) -> float | None:
    if not flops_per_rank_step or not peak_flops or step_s <= 0:
        return None
    return flops_per_rank_step / step_s / peak_flops


class TrainLog:
    """Rank 0's sinks for :class:`StepMetrics` (see the module docstring); a no-op on the other ranks."""

    def __init__(self, out: Path, active: bool, hook: Callable[[dict], object] | None = None):
        self.active = active
        self.hook = hook
        self.path: Path | None = out / METRICS_FILE  # None once it cannot be written
        self.tensorboard: Path | None = None
        self._writer = None
        if not active:
            return
        out.mkdir(parents=True, exist_ok=True)
        try:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (an extra)
        except ImportError:
            return
        try:
            self._writer = SummaryWriter(log_dir=str(out / TENSORBOARD_DIR))
        except OSError:  # an output folder that cannot take it: the JSON lines say why, if they cannot either
            return
        self.tensorboard = out / TENSORBOARD_DIR

    def record(self, m: StepMetrics) -> None:
        if not self.active:
            return
        data = asdict(m)
        if self.path is not None:
            try:
                with self.path.open("a") as f:  # a line at a time: a crash loses at most the step being written
                    f.write(json.dumps(data) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:  # the log is not worth the run: say so once and keep training
                from autotp.io.ckpt_safety import cause

                print(f"warning: cannot write the metrics file {self.path}: {cause(exc)}; the metrics go on to "
                      "the console only", file=sys.stderr, flush=True)
                # the folder cannot be written: TensorBoard's writer thread would fail there too, loudly
                self.path, self._writer = None, None
        if self._writer is not None:
            for key, value in data.items():
                if key != "step" and value is not None and math.isfinite(value):
                    self._writer.add_scalar(f"train/{key}", value, m.step)
            self._writer.flush()
        if self.hook is not None:
            self.hook(dict(data))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
