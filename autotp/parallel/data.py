"""Every rank of a tensor-parallel group must see the same micro-batch.

Megatron has tensor-parallel rank 0 read the batch and broadcast it to its group
(``get_batch_on_this_tp_rank``). A data loader that hands different batches to the ranks of one TP group
(a ``DistributedSampler`` over the whole world does exactly that) trains silently wrong. So:

- :func:`check_same_inputs` compares a fingerprint of each input over the group (one all-gather of a
  few integers per input, never the data) and names the input and the ranks that differ; a parallelized
  model runs it on the first call of every call signature (every call with ``check_inputs=True``);
- :func:`broadcast_batch` is Megatron's way: TP rank 0's batch, sent to the group;
- :func:`dp_rank`, :func:`dp_size` and :func:`dp_sampler` shard a dataset over the data-parallel group
  only, so both ranks of a TP group draw the same samples.
"""
from __future__ import annotations

import warnings
import zlib

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from autotp.errors import InputMismatchError
from autotp.operators.gathered import GatheredOnUse, all_gather_flat
from autotp.capture.structure import flatten, unflatten

_FIELDS = 4  # per input: exact sum of its bytes, position-weighted sum, byte count, crc of dtype/shape/values


def _fingerprint(leaf: object) -> list[int]:
    tensors, _ = flatten(leaf)
    described = [type(leaf).__qualname__]
    total = weighted = count = 0
    for t in tensors:
        described.append(f"{t.dtype}{tuple(t.shape)}")
        if isinstance(t, GatheredOnUse):  # this model's own sharded output (a KV cache): reading it would gather
            continue
        b = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)  # bit-exact, any dtype
        w = torch.arange(b.numel(), device=b.device, dtype=torch.int64) % 65521 + 1  # order matters
        total += int(b.sum())
        weighted += int((b * w).sum())
        count += b.numel()
    if not tensors:
        described.append(repr(leaf))
    return [total, weighted, count, zlib.crc32("|".join(described).encode())]


def check_same_inputs(args: tuple, kwargs: dict, group: dist.ProcessGroup) -> None:
    """Raise :class:`~autotp.errors.InputMismatchError` unless every rank of ``group`` got these inputs."""
    tp = dist.get_world_size(group)
    if tp == 1:
        return
    leaves, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    rows = [_fingerprint(leaf) for _, leaf in leaves]
    device = next((t.device for t in flatten((args, kwargs))[0]), torch.device("cpu"))
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(rows or [[0] * _FIELDS], dtype=torch.int64, device=device)
    everyone = mine.new_empty((tp, *mine.shape))
    all_gather_flat(everyone.view(-1), mine.view(-1), group=group)
    same = (everyone == everyone[0]).all(dim=2)  # (tp, inputs)
    if bool(same.all()):
        return
    i = int((~same).any(dim=0).nonzero()[0])
    path = _name(leaves[i][0])
    odd = [r for r in range(tp) if not bool(same[r, i])]
    ranks = dist.get_process_group_ranks(group)
    raise InputMismatchError(
        f"the ranks of one tensor-parallel group got different inputs: {path} on group ranks {odd} "
        f"(global {[ranks[r] for r in odd]}) differs from group rank 0 (global {ranks[0]}); "
        f"tensor parallelism needs the same micro-batch on all {tp} ranks of the group",
        hint="send tp rank 0's batch to the group with autotp.broadcast_batch(batch), or sample over the "
             "data-parallel group only (autotp.dp_sampler(dataset))",
    )


def _name(path: tuple) -> str:
    # (args, kwargs): the first key says which, the rest is the path inside
    head, *rest = path
    base = "args" if getattr(head, "idx", None) == 0 else "kwargs"
    if base == "kwargs" and rest:
        return f"kwargs[{rest[0].key!r}]" + pytree.keystr(tuple(rest[1:]))
    return base + pytree.keystr(tuple(rest))


def _tp_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if group is not None:
        return group
    from autotp.distributed.launch import current_tp_group

    return current_tp_group() or dist.group.WORLD


def broadcast_batch(batch: object, group: dist.ProcessGroup | None = None, src: int = 0) -> object:
    """Group rank ``src``'s ``batch`` (any nesting of tensors) on every rank of ``group`` (default: this
    process's tensor-parallel group under ``autotp run``, else the whole job). Other ranks may pass None."""
    group = _tp_group(group)
    root = dist.get_global_rank(group, src)
    is_src = dist.get_rank() == root
    tensors, spec = flatten(batch) if is_src else ([], None)
    meta = [(spec, [(tuple(t.shape), t.dtype) for t in tensors])] if is_src else [None]
    with warnings.catch_warnings():
        # torch 2.13's own unpickling of a pytree LeafSpec (inside the batch's structure) warns that
        # isinstance(treespec, LeafSpec) is deprecated: nothing the caller can act on
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        dist.broadcast_object_list(meta, src=root, group=group)
    spec, shapes = meta[0]
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    out = []
    for i, (shape, dtype) in enumerate(shapes):
        t = tensors[i].to(device).contiguous() if is_src else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=root, group=group)
        out.append(t)
    return unflatten(out, spec)


def _grid():
    from autotp.distributed.launch import current_job

    job = current_job()  # None: not under `autotp run`: parallelize's default group is the whole job
    return None if job is None else job.grid


def dp_size() -> int:
    """The data-parallel size of this job (1 outside ``autotp run``: the whole job is one TP group)."""
    grid = _grid()
    return 1 if grid is None else grid.dp


def dp_rank() -> int:
    """This process's data-parallel rank: the same on every rank of its tensor-parallel group."""
    grid = _grid()
    return 0 if grid is None else grid.coords(dist.get_rank())["dp"]


def dp_sampler(dataset, shuffle: bool = True, seed: int = 0, drop_last: bool = False):
    """A ``DistributedSampler`` over the data-parallel group: the ranks of a TP group get the same indices."""
    from torch.utils.data import DistributedSampler

    return DistributedSampler(dataset, num_replicas=dp_size(), rank=dp_rank(), shuffle=shuffle, seed=seed,
                              drop_last=drop_last)
