"""``autotp.parallelize``: the user-facing module that runs rewritten graphs on local shards.

The returned :class:`TPModule` owns the local shards under the original parameter names (ties kept: one
Parameter per original Parameter). Each distinct call signature (input structure, dtypes, train/eval) is
captured once, planned, rewritten, and cached; every cached graph reads the same Parameters.
This is the one place where the rank enters: weights are sliced here and collectives are bound here.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autotp.capture import capture, meta_skeleton, signature
from autotp.collectives import all_reduce, bind_collectives
from autotp.errors import ProcessGroupError, ShardingError
from autotp.passes import run_passes
from autotp.plan import ParamShard, Plan
from autotp.planner import make_plan
from autotp.rng import SEED_OFFSET, RegionRNG, bind_rng
from autotp.shard_spec import block_index
from autotp.vocab_ops import bind_vocab


def _default_example() -> tuple[tuple, dict]:
    # capture runs on meta tensors: only shape and dtype matter, a token batch fits GPT-style models
    return (torch.zeros(2, 8, dtype=torch.long),), {}


def _split_example(example_inputs) -> tuple[tuple, dict]:
    if example_inputs is None:
        return _default_example()
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, tuple) and len(example_inputs) == 2 and isinstance(example_inputs[1], Mapping) \
            and isinstance(example_inputs[0], (tuple, list)):
        return tuple(example_inputs[0]), dict(example_inputs[1])
    return tuple(example_inputs), {}


def _resolve_group(tp_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if tp_group is None:
        from autotp.launch import current_tp_group  # under `autotp run`/`autotp shard`: the layout's tp group

        tp_group = current_tp_group()
    if tp_group is not None:
        return tp_group
    if not (dist.is_available() and dist.is_initialized()):
        raise ProcessGroupError(
            "autotp.parallelize needs a process group, and none is initialised",
            hint="call torch.distributed.init_process_group('gloo' on CPU or 'nccl' on GPU) first, "
                 "e.g. under `torchrun --nproc-per-node 2 train.py`; a group of size 1 is valid and runs unsharded",
        )
    return dist.group.WORLD


def _container(original: nn.Module | None) -> nn.Module:
    # keep indexing (``model.h[0]``, ``model.layers["0"]``) working on the mirrored tree
    if isinstance(original, nn.ModuleList):
        return nn.ModuleList()
    if isinstance(original, nn.ModuleDict):
        return nn.ModuleDict()
    return nn.Module()


def _set(root: nn.Module, name: str, value: torch.Tensor, persistent: bool = True,
         like: dict[str, nn.Module] | None = None) -> None:
    """Register ``value`` at dotted ``name`` under ``root``, creating parent modules as needed."""
    *path, leaf = name.split(".")
    mod = root
    for i, p in enumerate(path):
        if p not in mod._modules:
            mod.add_module(p, _container((like or {}).get(".".join(path[: i + 1]))))
        mod = mod._modules[p]
    if isinstance(value, nn.Parameter):
        mod._buffers.pop(leaf, None)
        mod._parameters[leaf] = value
    else:
        mod._parameters.pop(leaf, None)
        mod.register_buffer(leaf, value, persistent=persistent)


class TPModule(nn.Module):
    """A tensor-parallel model: called exactly like the original, holding only this rank's shards."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, example: tuple[tuple, dict],
                 vocab_multiple: int = 1, compile: bool = False):
        super().__init__()
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        # plain attributes (not submodules): the skeleton and the graphs hold no real weights of their own
        self.__dict__["_autotp"] = {
            "skeleton": meta_skeleton(model), "graphs": {}, "shards": {}, "plans": {}, "group": group,
            "tp": tp, "rank": rank, "device": device, "model_name": type(model).__name__,
            "rng": RegionRNG(torch.initial_seed() + SEED_OFFSET + rank, device) if tp > 1 else None,
            "mesh": None,  # built when a plan first returns vocab-parallel logits
            "vocab_multiple": vocab_multiple,
            "warned": set(),
            "compile": compile,
        }
        self.training = model.training
        gm, plan = self._build(*example, training=model.training)
        self._make_parameters(model, plan)
        self._finish(gm, signature(*example, model.training), plan)

    # -- public --------------------------------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self._autotp["tp"]

    @property
    def tp_rank(self) -> int:
        return self._autotp["rank"]

    @property
    def plan(self) -> Plan:
        """The plan of the first captured call."""
        return next(iter(self._autotp["plans"].values()))

    def plans(self) -> dict:
        return dict(self._autotp["plans"])

    def graphs(self) -> dict:
        return dict(self._autotp["graphs"])

    def forward(self, *args, **kwargs):
        key = signature(args, kwargs, self.training)
        gm = self._autotp["graphs"].get(key)
        if gm is None:
            gm, plan = self._build(args, kwargs, training=self.training)
            self._finish(gm, key, plan)
        return gm(*args, **kwargs)

    # -- building ----------------------------------------------------------------------------------
    def _build(self, args: tuple, kwargs: dict, training: bool) -> tuple[fx.GraphModule, Plan]:
        st = self._autotp
        st["skeleton"].train(training)
        gm = capture(st["skeleton"], args, kwargs, st["device"])
        plan = make_plan(gm, st["tp"], st["vocab_multiple"])
        for module, reason in plan.replicated:
            if (module, reason) not in st["warned"]:
                st["warned"].add((module, reason))
                warnings.warn(f"autotp: {module or '<root>'} left replicated (exact, not sharded): {reason}",
                              stacklevel=3)
        for name, shard in plan.params:
            known = st["shards"].get(name)
            if known is not None and known != shard:
                raise ShardingError(f"parameter {name} is sharded as {known} by one call and {shard} by another")
        for name, _ in plan.params:
            if st["shards"] and name not in st["shards"]:
                raise ShardingError(f"parameter {name} is sharded by a later call signature but was replicated")
        return run_passes(gm, plan), plan

    def _make_parameters(self, model: nn.Module, plan: Plan) -> None:
        st = self._autotp
        st["shards"] = dict(plan.params)
        local: dict[int, torch.Tensor] = {}
        owners = dict(model.named_modules(remove_duplicate=False))
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in local:
                shard = st["shards"].get(name) or self._shard_of_alias(model, p)
                with torch.no_grad():
                    data = p.detach().clone() if shard is None else shard.shard(p.detach(), st["tp"], st["rank"])
                local[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
                if shard is not None and shard.replicated_blocks(st["tp"]) and p.requires_grad:
                    self._sum_replicated_grads(local[id(p)], shard)
            _set(self, name, local[id(p)], like=owners)
        for name, b in model.named_buffers(remove_duplicate=False):
            if id(b) not in local:
                local[id(b)] = b.detach().clone()
            mod_name, _, leaf = name.rpartition(".")
            persistent = leaf not in owners[mod_name]._non_persistent_buffers_set
            _set(self, name, local[id(b)], persistent=persistent, like=owners)

    def _shard_of_alias(self, model: nn.Module, p: torch.Tensor) -> ParamShard | None:
        for other, q in model.named_parameters(remove_duplicate=False):
            if q is p and other in self._autotp["shards"]:
                return self._autotp["shards"][other]
        return None

    def _sum_replicated_grads(self, param: nn.Parameter, shard: ParamShard) -> None:
        """Blocks held by several ranks (kv heads < tp) get partial gradients there: sum them."""
        st = self._autotp
        ranks = dist.get_process_group_ranks(st["group"])
        pieces, offset = [], 0
        for seg in shard.segments:
            if seg.parts < st["tp"]:
                members = [ranks[r] for r in range(st["tp"])
                           if block_index(seg.parts, st["tp"], r) == block_index(seg.parts, st["tp"], st["rank"])]
                sub = dist.new_group(members, use_local_synchronization=True)
                pieces.append((offset, seg.local(), sub))
            offset += seg.local()
        dim = shard.dim

        def hook(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            for start, length, sub in pieces:
                part = grad.narrow(dim, start, length)
                part.copy_(all_reduce(part.contiguous(), sub))
            return grad

        param.register_hook(hook)

    def _finish(self, gm: fx.GraphModule, key, plan: Plan) -> None:
        st = self._autotp
        tensors = {**dict(self.named_parameters(remove_duplicate=False)),
                   **dict(self.named_buffers(remove_duplicate=False))}
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            value = tensors.get(node.target)
            if value is not None:
                _set(gm, node.target, value)
        bind_collectives(gm, st["group"])
        bind_rng(gm, st["rng"])
        if plan.vocab.outputs and st["mesh"] is None:
            st["mesh"] = DeviceMesh.from_group(st["group"], st["device"].type)
        bind_vocab(gm, st["group"], st["rank"], st["mesh"])
        if st.get("compile"):
            from autotp.compile import compile_graph

            gm = compile_graph(gm)
        st["graphs"][key] = gm
        st["plans"][key] = plan


def parallelize(model: nn.Module, *, tp_group: dist.ProcessGroup | None = None,
                example_inputs: object = None, vocab_multiple: int = 1, compile: bool = False) -> TPModule:
    """Shard ``model`` Megatron-style over ``tp_group`` (default: the whole default process group).

    ``example_inputs``: positional args as a tuple, keyword args as a dict, or ``(args, kwargs)``; only
    shapes and dtypes matter (capture runs on meta tensors). Default: a (2, 8) batch of token ids.
    The returned module holds its local shards as soon as it returns; calls with another input structure
    are captured and rewritten on first use and share the same parameters.

    Vocab-parallel logits come back as a ``DTensor`` sharded on the vocab dim: ``logits.full_tensor()``
    gathers them; a step that only uses the loss never does. ``vocab_multiple`` rounds each rank's vocab
    rows up (e.g. 64 for tensor-core-friendly GEMMs on GPUs); the default pads only to ``ceil(V / tp)``.
    ``compile=True`` runs each rewritten graph under ``torch.compile`` (see :mod:`autotp.compile`).
    """
    group = _resolve_group(tp_group)
    return TPModule(model, group, _split_example(example_inputs), vocab_multiple, compile=compile)
