"""Data parallelism by default: the gradients of a parallelized model averaged over its data-parallel group.

A rank grid with dp > 1 holds dp replicas of every tensor-parallel shard, each training on its own batches.
Where FSDP shards over those ranks (its reduce-scatter averages) or pipeline stages run under their own DDP,
that is done already; everywhere else :func:`autotp.parallelize` gives the model a :class:`Replicas` running
torch's ``DistributedDataParallel`` over the data-parallel group alone. It is driven from the model's own
forward the way torch's composable ``replicate`` drives it (``_pre_forward`` before the graph runs,
``_post_forward`` on its output), so the model keeps its class and stays the object the user holds.

- What crosses: DDP's reducer packs the gradients into buckets (the first of 1 MiB, then 25 MiB, in the
  order the backward makes them after the first step) and all-reduces each bucket over the dp group as soon
  as its last gradient is ready, while the backward goes on: a rank's gradient bytes, once per step, over dp
  only. A tensor-parallel shard is averaged with the replicas holding the same shard, a parameter every tp
  rank holds whole likewise; nothing crosses the tp group for it. Gradients summed inside the backward
  first (sequence-parallel norms over tp, every gradient over cp) reach DDP summed.
- When: the engine is made at the first call with gradients. Its constructor checks that the replicas hold
  the same shapes and broadcasts dp rank 0's parameters, as a ``DistributedDataParallel`` of the user's
  would, so the replicas start identical.
- A script that wraps the model in its own ``DistributedDataParallel`` keeps working: DDP marks itself
  active around its module's forward (``DistributedDataParallel._get_active_ddp_module``), so a call that
  DDP drives is found here, and autotp's engine stays out from then on (dropped if it was made): every
  gradient averaged once. A DDP whose group holds two ranks of one tensor-parallel group is refused at that
  first call: it averages different shards of a parameter together (its constructor has already broadcast
  one rank's shards over the others').
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from autotp.errors import ProcessGroupError

# which data parallelism a parallelized model runs (Replicas.kind)
NONE = "none"  # no data-parallel ranks (dp 1), or none known (a tp_group given without a mesh)
AUTOTP_DDP = "ddp"  # autotp's DDP over the dp group (the default)
SCRIPT_DDP = "script ddp"  # the script's own DistributedDataParallel, found driving the model
FSDP = "fsdp"  # FSDP2 shards over the dp ranks: its reduce-scatter averages
PIPELINE = "pipeline"  # pipeline stages, each under DDP (or FSDP) over dp, made by autotp.pipeline
OFF = "off"  # data_parallel=False: the script averages the gradients itself

@dataclass
class Replicas:
    """This rank's data parallelism: which kind runs (:data:`kind`, for reports) and, for autotp's own, the
    DDP engine over ``group``. ``shards``: this rank's tensor-parallel group, whose ranks hold the other
    shards of the same parameters, which no data-parallel average may mix."""

    kind: str
    group: dist.ProcessGroup | None = None
    shards: dist.ProcessGroup | None = None
    options: dict = field(default_factory=dict)  # DistributedDataParallel's keyword arguments
    device: torch.device | None = None
    engine: DistributedDataParallel | None = None  # autotp's, made at the first call with gradients
    script: weakref.ref | None = None  # the script's own DDP, once found driving the model

    @property
    def size(self) -> int:
        """Data-parallel replicas averaged (1 where none are known)."""
        return dist.get_world_size(self.group) if self.group is not None else 1

    def before(self, model: nn.Module, params: Callable[[], list[nn.Parameter]]) -> DistributedDataParallel | None:
        """At the start of every call of ``model``: the engine whose ``_post_forward`` the call's output must
        reach (None: nothing to average, or another DDP does). ``params``: the parameters it averages."""
        outer = DistributedDataParallel._get_active_ddp_module()
        if outer is not None and self._wraps(outer, model):
            return None
        if self.kind != AUTOTP_DDP or not torch.is_grad_enabled():
            return None
        if self.engine is None:
            trained = [p for p in params() if p.requires_grad]
            if not trained:  # a frozen model called with gradients on: nothing to average (DDP refuses it)
                return None
            self.engine = self._make(trained)
        if not self.engine.require_backward_grad_sync:
            return None
        self.engine._pre_forward()  # torch's replicate does the same before its module's forward
        return self.engine

    @staticmethod
    def after(engine: DistributedDataParallel | None, output: object) -> object:
        """The call's output through the engine's ``_post_forward`` (its reducer then expects this backward)."""
        return output if engine is None else engine._post_forward(output)

    def _make(self, trained: list[nn.Parameter]) -> DistributedDataParallel:
        """DDP over the parameters alone (a ParameterList, as torch's replicate builds it): the model's buffers
        are not broadcast on every call, and the model is not a submodule of anything autotp holds."""
        ids = [self.device.index] if self.device is not None and self.device.type == "cuda" else None
        return DistributedDataParallel(nn.ParameterList(trained), process_group=self.group, device_ids=ids,
                                       **self.options)

    def _wraps(self, outer: DistributedDataParallel, model: nn.Module) -> bool:
        """Whether ``outer`` (a DDP running its module's forward) averages ``model``'s gradients; the first time,
        its group is checked and autotp's engine leaves the model to it."""
        if self.script is not None and self.script() is outer:
            return True
        if outer is self.engine:
            return False
        mine = {id(p) for p in model.parameters()}
        if not any(id(p) in mine for p in outer.module.parameters()):
            return False  # a DDP around other modules: model's gradients are still autotp's to average
        ranks = dist.get_process_group_ranks(outer.process_group)
        mixed = sorted(set(ranks) & set(dist.get_process_group_ranks(self.shards) if self.shards is not None else ()))
        if len(mixed) > 1:
            raise ProcessGroupError(
                f"{type(model).__name__} is wrapped in a DistributedDataParallel over ranks {ranks}, which hold "
                f"different tensor-parallel shards of its parameters (ranks {mixed} are one tensor-parallel "
                "group): it averages them together, and its construction copied one rank's shards over the "
                "others'",
                hint="drop the wrap: under `autotp run --dp D` (or with a mesh that has a 'dp' dim) parallelize "
                     "averages over the data-parallel ranks itself; or wrap over the data-parallel group only, "
                     "DistributedDataParallel(model, process_group=init_from_env().dp_group())")
        self.script = weakref.ref(outer)
        self.engine = None  # never made, or made and now unused: its reducer's hooks go with it
        self.kind = SCRIPT_DDP
        return True
