"""Sharded results handed back to the user as ordinary-looking full tensors, gathered on first use.

A vocab-parallel LM head leaves each rank with its slice of the logits, (b, s, V/t). The user's code reads
them as the full (b, s, V) tensor (``logits[:, -1, :]``, ``torch.cat``, sampling), but a training step
usually only calls ``loss.backward()`` and never looks at them. :class:`GatheredOnUse` reports the full
shape and gathers the slices (one all-gather over the tensor-parallel group) the first time any op reads
its values, then behaves as the plain full tensor; a step that never reads it moves no b·s·V data.

Gathering is a collective: every rank of the group must read the tensor, as every rank runs the same
script. Gradients flow back through the gather: the gradient of the full tensor is the same on every rank
(everything after the gather is replicated), so each rank keeps the slice of it that matches its shard.
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_map

from autotp.operators.amp import amp_bwd, amp_fwd
from autotp.shard_spec import shard_tensor

# local shards of every rank, in rank order -> the full tensor
Unshard = Callable[[list[torch.Tensor]], torch.Tensor]
# the full tensor's gradient -> this rank's slice of it
Reslice = Callable[[torch.Tensor], torch.Tensor]

# torch >= 2.10 names it all_gather_single; older releases only have all_gather_into_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GatheredOnUse(torch.Tensor):
    """A full-shape tensor whose values are this rank's shard until something reads them."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape: torch.Size, group: dist.ProcessGroup, unshard: Unshard):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device,
                                                   requires_grad=False)

    def __init__(self, local: torch.Tensor, shape: torch.Size, group: dist.ProcessGroup, unshard: Unshard):
        self._local = local
        self._group = group
        self._unshard = unshard
        self._full: torch.Tensor | None = None

    def to_local(self) -> torch.Tensor:
        """This rank's shard (padded as the graph computed it), without communication."""
        return self._local

    def full_tensor(self) -> torch.Tensor:
        """The full tensor, as a plain tensor (gathered once, then cached). Differentiable, as DTensor's
        ``full_tensor()`` is: a loss computed from it sends its gradient back through the gather."""
        if torch.is_grad_enabled() and self.requires_grad:
            return _Unwrap.apply(self)
        return self._gathered()

    def _gathered(self) -> torch.Tensor:
        if self._full is None:
            local = self._local.detach().contiguous()
            tp = dist.get_world_size(self._group)
            buf = local.new_empty(tp * local.numel())
            all_gather_flat(buf, local.flatten(), group=self._group)
            self._full = self._unshard(list(buf.view(tp, *local.shape).unbind(0)))  # t × (b, s, V/t)
        return self._full

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def full(x):
            return x._gathered() if isinstance(x, GatheredOnUse) else x

        return func(*tree_map(full, args), **tree_map(full, kwargs or {}))

    def __repr__(self) -> str:  # printing reads the values: gathered like any other use
        return repr(self._gathered())

    def __reduce_ex__(self, protocol):  # pickled (torch.save, returned from a worker) as the full tensor
        return self._gathered().__reduce_ex__(protocol)


class _Unwrap(torch.autograd.Function):
    """The gathered values as a plain tensor; its gradient is the gradient of the full-shape wrapper."""

    @staticmethod
    @amp_fwd
    def forward(ctx, x: GatheredOnUse) -> torch.Tensor:
        return x._gathered().view_as(x._gathered())

    @staticmethod
    @amp_bwd
    def backward(ctx, grad: torch.Tensor):
        return grad


class _Gather(torch.autograd.Function):
    @staticmethod
    @amp_fwd
    def forward(ctx, local: torch.Tensor, shape: torch.Size, group: dist.ProcessGroup, unshard: Unshard,
                reslice: Reslice) -> torch.Tensor:
        ctx.reslice = reslice
        # a value gathered on use over another group (vocab-parallel logits, also cut by the sequence over the
        # cp group) is kept as it is: reading this one gathers that one first
        return GatheredOnUse(local if isinstance(local, GatheredOnUse) else local.detach(), shape, group, unshard)

    @staticmethod
    @amp_bwd
    def backward(ctx, grad: torch.Tensor):
        if isinstance(grad, GatheredOnUse):
            grad = grad._gathered()
        return ctx.reslice(grad), None, None, None, None


def gathered_on_use(local: torch.Tensor, shape: torch.Size, group: dist.ProcessGroup, unshard: Unshard,
                    reslice: Reslice) -> torch.Tensor:
    return _Gather.apply(local, shape, group, unshard, reslice)


class GatherOutput(nn.Module):
    """Graph module wrapping a sharded graph output; unbound (no group, or a group of one) the identity.

    ``dim``: the sharded dim; ``size``: its full length; ``unshard``/``reslice`` cut and join it (vocab
    rows with padding, or per-segment head blocks). Bound by the runtime with the group and this rank.
    """

    axis = "tp"  # the group it gathers over (context parallelism's sequence: "cp")

    def __init__(self, dim: int, size: int, unshard: Callable[[list[torch.Tensor], int], torch.Tensor],
                 reslice: Callable[[torch.Tensor, int], torch.Tensor]):
        super().__init__()
        self.dim, self.size = dim, size
        self._unshard, self._reslice = unshard, reslice
        self.group: dist.ProcessGroup | None = None
        self.rank = 0

    def bind(self, group: dist.ProcessGroup | None, rank: int) -> None:
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return x
        shape = list(x.shape)
        shape[self.dim] = self.size
        tp, rank = dist.get_world_size(self.group), self.rank
        return gathered_on_use(x, torch.Size(shape), self.group, lambda shards: self._unshard(shards, tp),
                               lambda grad: self._reslice(grad, rank))


def bind_outputs(module: nn.Module, group: dist.ProcessGroup | None, rank: int, axis: str = "tp") -> None:
    """Bind the output gathers and local slices over ``axis`` ("tp", or "cp": context parallelism's)."""
    for m in module.modules():
        if isinstance(m, (GatherOutput, LocalSliceOp)) and getattr(m, "axis", "tp") == axis:
            m.bind(group, rank)


class LocalSliceOp(nn.Module):
    """This rank's slice of a replicated tensor along ``dim`` (per segment); unbound, the identity."""

    def __init__(self, dim: int, segments: tuple, outer: bool = False):
        super().__init__()
        self.dim, self.segments, self.outer = dim, segments, outer
        self.tp, self.rank = 1, 0

    def bind(self, group: dist.ProcessGroup | None, rank: int) -> None:
        self.tp = dist.get_world_size(group) if group is not None else 1
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return x
        return shard_tensor(x, self.dim, self.segments, self.tp, self.rank, self.outer)


def local_outputs(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[int, nn.Module]]:
    """A copy of ``gm`` (sharing its submodules and tensors) whose GatherOutput results that are graph
    outputs are returned unwrapped, and {flat output index: the GatherOutput module to apply outside}.

    A compiler traces the copy: a tensor subclass made inside a traced region breaks the graph (dynamo cannot
    trace ``_make_wrapper_subclass``) or makes AOTAutograd expect a subclass tangent; wrapping the plain
    local result outside moves no data."""
    graph = _copy(gm.graph)
    out = graph.output_node()
    flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    wrap: dict[int, nn.Module] = {}
    for i, node in enumerate(flat):
        if isinstance(node, fx.Node) and node.op == "call_module" \
                and isinstance(gm.get_submodule(node.target), GatherOutput) and len(node.users) == 1:
            wrap[i] = gm.get_submodule(node.target)
    if not wrap:
        return gm, {}
    new_flat = [node.args[0] if i in wrap else node for i, node in enumerate(flat)]
    removed = [flat[i] for i in wrap]
    out.args = (type(out.args[0])(new_flat) if isinstance(out.args[0], (tuple, list)) else new_flat[0],)
    for node in removed:
        graph.erase_node(node)
    inner = fx.GraphModule(gm, graph)
    inner.graph._codegen = _copy(gm.graph._codegen)
    inner.recompile()
    return inner, wrap


def _copy(obj: object) -> object:
    with warnings.catch_warnings():
        # torch 2.13's own copy of a pytree LeafSpec (the graph's codegen holds one) warns that
        # isinstance(treespec, LeafSpec) is deprecated: nothing the caller can act on
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        return copy.deepcopy(obj)
