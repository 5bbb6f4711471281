"""The one value every rank of a job is told: :class:`RankJob`, its sizes, backend and timeout.

``autotp run`` and ``autotp shard`` decide the sizes once, in the launching process (:class:`~autotp.distributed.
launch.LaunchSpec`), and hand this frozen value to the ranks once: ``autotp shard``'s ranks run a Python function
and get it as the function's argument; ``autotp run``'s run the user's script, a process of its own, and find it
in one environment variable, ``AUTOTP_JOB``, holding the whole value as versioned JSON. A rank builds its
:class:`~autotp.distributed.rank_grid.RankGrid` and its one ``DeviceMesh`` from it
(:mod:`autotp.distributed.rank_context`); every size stays an int from the command line to the collective.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autotp.combinations import refused
from autotp.distributed.rank_grid import RankGrid
from autotp.errors import LaunchError

__all__ = ["BACKENDS", "ENV_JOB", "JOB_VERSION", "RankJob", "choose_backend", "job_from_env"]

ENV_JOB = "AUTOTP_JOB"  # the whole RankJob, as RankJob.to_json writes it, under `autotp run`
JOB_VERSION = 1  # bumped when the JSON's fields change meaning; a rank refuses a version it does not know
BACKENDS = ("gloo", "nccl")


def choose_backend(nproc_per_node: int) -> str:
    """nccl when this node has a GPU for every local rank, else gloo."""
    import torch  # only once a job is launched: this module is read before torch is imported

    if torch.cuda.is_available() and torch.cuda.device_count() >= nproc_per_node:
        return "nccl"
    return "gloo"


@dataclass(frozen=True)
class RankJob:
    """A job's ranks: ``grid`` (tp × cp × dp × pp = world; dp counts every node's replicas, Megatron's order),
    the process group's ``backend``, the collective ``timeout`` in seconds (None: torch's), ``fsdp`` the FSDP
    replica groups (1: FSDP over every data-parallel rank, R > 1: HSDP in R groups; None: no FSDP), and the
    pipeline's ``virtual_stages`` per rank (None: the schedule's default). Validated on construction: a
    ValueError (:class:`LaunchError`) naming every size."""

    grid: RankGrid
    backend: str = "gloo"
    timeout: float | None = None
    fsdp: int | None = None
    virtual_stages: int | None = None

    def __post_init__(self) -> None:
        g = self.grid
        if not isinstance(g, RankGrid):
            raise LaunchError(f"grid must be a RankGrid, got {type(g).__name__}", fields=("grid",))
        if self.backend not in BACKENDS:
            raise LaunchError(f"backend must be gloo or nccl, got {self.backend!r}", fields=("backend",))
        if self.timeout is not None and (isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float))
                                         or not self.timeout > 0):
            raise LaunchError(f"timeout must be > 0 seconds, got {self.timeout!r}", fields=("timeout",))
        for name in ("fsdp", "virtual_stages"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise LaunchError(f"{name} must be an integer >= 1 or None, got {value!r} ({self.sizes})",
                                  fields=(name,))
        if self.fsdp is not None:  # the rule LaunchSpec asked (autotp.combinations); a job read back asks it again
            reason = refused(fsdp=True, dp=g.dp, context_parallel=g.cp, hsdp=self.fsdp)
            if reason is not None:
                raise LaunchError(f"{reason.message} ({self.sizes})", hint=reason.hint, fields=reason.fields)

    @property
    def sizes(self) -> str:
        """Every size, for messages: ``tp 2 × cp 1 × dp 2 × pp 1 = world 4``."""
        g = self.grid
        return f"tp {g.tp} × cp {g.cp} × dp {g.dp} × pp {g.pp} = world {g.world_size}"

    @property
    def device_type(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def to_dict(self) -> dict[str, Any]:
        g = self.grid
        return {"version": JOB_VERSION, "world_size": g.world_size, "tp": g.tp, "cp": g.cp, "dp": g.dp,
                "pp": g.pp, "backend": self.backend, "timeout": self.timeout,
                "fsdp": self.fsdp, "virtual_stages": self.virtual_stages}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankJob:
        if data.get("version") != JOB_VERSION:
            raise LaunchError(f"job version {data.get('version')!r}, this autotp reads version {JOB_VERSION}: the "
                              "launcher and the ranks run different autotp versions", fields=("version",))
        sizes = {k: data.get(k) for k in ("world_size", "tp", "cp", "dp", "pp")}
        try:
            grid = RankGrid(**sizes)
        except (TypeError, ValueError) as exc:
            every = ", ".join(f"{k} {v!r}" for k, v in sizes.items())
            raise LaunchError(f"{exc} (the job's sizes: {every})") from None
        return cls(grid, data.get("backend"), data.get("timeout"), data.get("fsdp"), data.get("virtual_stages"))

    @classmethod
    def from_json(cls, text: str) -> RankJob:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LaunchError(f"{ENV_JOB} is not the JSON autotp writes ({exc})", fields=(ENV_JOB,)) from None
        if not isinstance(data, dict):
            raise LaunchError(f"{ENV_JOB} holds {type(data).__name__}, not a job", fields=(ENV_JOB,))
        return cls.from_dict(data)

    def env(self) -> dict[str, str]:
        """The one environment variable that carries this job to a script's ranks."""
        return {ENV_JOB: self.to_json()}


def job_from_env(environ: Mapping[str, str] | None = None) -> RankJob | None:
    """The job ``autotp run`` handed this process; None when it was not started by it."""
    environ = os.environ if environ is None else environ
    text = environ.get(ENV_JOB)
    return None if not text else RankJob.from_json(text)
