"""What a parallelized model carries: :class:`TPState`, reached only through :func:`tp_state`.

:func:`autotp.parallelize` attaches one :class:`TPState` to the model (in its ``__dict__``, not as a
submodule, so ``state_dict``, ``named_modules`` and ``to()`` never see it). Everything that reads it (the
forward, checkpoints, weight loading and export) goes through :func:`tp_state` or :func:`find_tp_state`;
this module alone knows where it is kept.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from torch.distributed.device_mesh import DeviceMesh

from autotp.capture.structure import Spec
from autotp.capture.writes import Writes
from autotp.distributed.replicas import Replicas
from autotp.operators.rng import RegionRNG
from autotp.options import Options
from autotp.plan.plan import ParamShard, Plan, ShardedInput

__all__ = ["Captured", "RankIdentity", "TPState", "attach_state", "detach_state", "find_tp_state", "tp_state"]

_KEY = "_autotp"


@dataclass(frozen=True)
class Captured:
    """One call signature's rewritten graph and the plan it executes: flat tensors in, flat tensors out."""

    module: nn.Module  # the rewritten graph module (compiled when asked)
    plan: Plan
    out: Spec  # how to rebuild the forward's output around the graph's results
    local_inputs: tuple[tuple[int, ShardedInput], ...] = ()  # flat input index -> taken as its local shard
    seq_length: tuple[int, int] | None = None  # sequence parallel: (flat input index, dim) of the length
    # whether the graph takes these flat inputs (as called, before local shards): the sizes export guarded it on
    accepts: Callable[[list[torch.Tensor]], bool] | None = None
    # ``plan`` is of the exported blocks only: they were rewritten once and copied (autotp.parallel.rewrite)
    copied: bool = False
    # what a compiler traces: ``module`` with its gathered-on-use outputs returned as local tensors, and
    # (flat output index, the module that wraps it) applied after, outside the trace
    call: nn.Module | None = None
    wrap: tuple[tuple[int, nn.Module], ...] = ()
    # context parallelism: (flat input index, dim) of the sequence each rank takes a chunk of
    cp_length: tuple[int, int] | None = None
    # whether ``call`` and ``wrap`` are settled: an eager graph gets them on its first call under the user's
    # torch.compile
    local: bool = True
    # the state the forward writes on the model, replayed after each call (autotp.parallel.writeback), and
    # the written state the model held when this graph was captured (a call on other state captures again)
    writes: Writes | None = None
    state: tuple = ()
    # checks the forward made on the values of the model's state, with the answers this graph was captured for
    # (autotp.capture.values): a call whose state answers otherwise is captured again
    checks: tuple = ()


@dataclass(frozen=True)
class RankIdentity:
    """This rank in its tensor-parallel group: the group, its size and this rank's index, the device its
    shards live on, with FSDP the device mesh of the dp and tp dims, and with context parallelism the group
    of ranks that each run a chunk of the sequence."""

    group: dist.ProcessGroup
    tp: int
    rank: int
    device: torch.device
    mesh: DeviceMesh | None = None
    cp_group: dist.ProcessGroup | None = None
    cp: int = 1


@dataclass
class TPState:
    """What :func:`autotp.parallelize` keeps on the model: who this rank is (:class:`RankIdentity`), what was
    asked for (:class:`~autotp.options.Options`), both set once, and what the calls have found since."""

    who: RankIdentity
    options: Options
    base: type  # the user's own class
    forward: Callable | None  # a forward the user set on the instance (partial, bound method), else None
    rng: RegionRNG | None = None  # this rank's stream for random ops in sharded regions
    # pipelined: the parameter names this rank's stages of a split graph read (never allocated: the others)
    stage_params: Callable[[fx.GraphModule], set[str]] | None = None
    context_rng: RegionRNG | None = None  # with cp: this rank's stream for random ops on its sequence chunk
    # which data parallelism runs (replicas.kind: "ddp", "script ddp", "fsdp", "pipeline", "off", "none") and,
    # for autotp's DDP over the data-parallel group, its engine
    replicas: Replicas | None = None
    # -- found by the calls -----------------------------------------------------------------------------
    shards: dict[str, ParamShard] = field(default_factory=dict)  # every name of a sharded parameter
    # tp 1 only: how fused parameters divide into segments (q|k|v), which checkpoints name at every tp
    segments: dict[str, ParamShard] = field(default_factory=dict)
    full: dict[str, torch.Tensor] = field(default_factory=dict)  # meta, full size, for later captures
    graphs: dict[Hashable, Captured] = field(default_factory=dict)  # call signature -> its graph and plan
    checked: set[Hashable] = field(default_factory=set)
    warned: set[tuple[str, str]] = field(default_factory=set)
    written: dict[tuple, None] = field(default_factory=dict)  # every piece of state a graph writes, in order
    # with cp: call signatures whose graph cannot run on chunks -> why (calls without gradients run whole)
    unchunked: dict[Hashable, str] = field(default_factory=dict)
    unloaded: tuple[str, ...] = ()  # tensors of a model built on meta that no load gave values yet
    units: tuple[str, ...] | None = None  # with fsdp: the blocks FSDP gathers one at a time, once applied
    dropped: frozenset[str] = frozenset()  # pipelined: parameters of other ranks' stages (meta here)
    cached: Plan | None = None  # the plan parallelize sharded by, read from the plan cache (nothing captured)
    cached_from: str = ""  # its file
    # blocks run eagerly because their code branches on the data: path -> how they are cut (autotp.plan.islands)
    islands: dict = field(default_factory=dict)

    # this rank's identity, read everywhere
    group = property(lambda self: self.who.group)
    tp = property(lambda self: self.who.tp)
    rank = property(lambda self: self.who.rank)
    device = property(lambda self: self.who.device)
    mesh = property(lambda self: self.who.mesh)
    cp = property(lambda self: self.who.cp)
    cp_group = property(lambda self: self.who.cp_group)

    @property
    def plan(self) -> Plan:
        """The plan of the first captured call (the cached one parallelize sharded by, on a cache hit)."""
        return self.cached if self.cached is not None else next(iter(self.graphs.values())).plan


def find_tp_state(model: nn.Module) -> TPState | None:
    """The model's :class:`TPState`, or None when it is not parallelized."""
    st = model.__dict__.get(_KEY)
    return st if isinstance(st, TPState) else None


def tp_state(model: nn.Module) -> TPState:
    """The tensor-parallel state of a parallelized model (its group, tp, rank, graphs and plans, shards)."""
    st = find_tp_state(model)
    if st is None:
        raise TypeError(f"{type(model).__name__} is not parallelized: call autotp.parallelize(model) first")
    return st


def attach_state(model: nn.Module, st: TPState) -> None:
    model.__dict__[_KEY] = st


def detach_state(model: nn.Module) -> None:
    model.__dict__.pop(_KEY, None)
