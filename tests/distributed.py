"""Helpers for multi-process tests: launch a function on N gloo ranks, count collectives."""
from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@record
def _entry(fn: Callable, *args):
    sys.path[:0] = [os.path.join(ROOT, "examples"), os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "scripts")]
    dist.init_process_group("gloo")
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable, world_size: int, *args) -> dict[int, object]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks with torch's elastic launcher; rank -> return value."""
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=uuid.uuid4().hex,
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
        monitor_interval=0.1, start_method="spawn",
    )
    return elastic_launch(config, _entry)(fn, *args)


_REDUCE_OPS = {0: "sum", 3: "min", 4: "max"}  # c10d's RedOpType


@dataclass
class CollectiveLog(TorchDispatchMode):
    """Records every all-reduce (functional or c10d) and functional collective as (op name, reduce op,
    number of elements)."""

    calls: list[tuple[str, str, int]] = field(default_factory=list)

    def __post_init__(self):
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in ("all_reduce", "all_gather_into_tensor",
                                                             "reduce_scatter_tensor", "all_to_all_single"):
            x = args[0]
            op = args[1] if isinstance(args[1], str) else ""
            self.calls.append((name, op, x.numel()))
        elif func.namespace == "c10d" and name == "allreduce_":  # eager all-reduces are plain c10d ones
            self.calls.append(("all_reduce", _REDUCE_OPS.get(args[2].op(), "?"), args[0][0].numel()))
        return func(*args, **(kwargs or {}))
