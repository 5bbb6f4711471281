"""Models too big for one device: built without their weights, then given only this rank's shards.

A model is built inside :func:`empty_weights`: its parameters are created on the meta device (no memory,
and the model's initialisers, running on meta, compute nothing), while its buffers and plain tensor
attributes (rotary tables, causal masks, ALiBi slopes) are computed for real, on the CPU, by the model's
own ``__init__``. Buffers are small next to the weights, they are never in a checkpoint when they are
non-persistent, and no rule outside the model's own code can rebuild them in general (a rotary table
depends on the model's config and scaling scheme), so the model's code computes them. This is what
Hugging Face's ``init_empty_weights(include_buffers=False)`` does for ``from_pretrained``.

:func:`autotp.parallelize` of such a model (or of one built entirely under ``torch.device("meta")``)
plans it on meta and allocates, uninitialised, only the local shard of each sharded parameter and the
full replicated ones (:func:`allocate_meta`); :func:`autotp.load_weights` then fills them from a
checkpoint, reading only this rank's slices. Until a load has given every tensor its values (and buffers a
model built wholly on meta left on meta came from the checkpoint), the model refuses to run rather than
compute with uninitialised memory (:func:`check_materialized`, :func:`mark_loaded`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Literal

import torch
import torch.nn as nn

from autotp.errors import ShardingError
from autotp.plan.plan import ParamShard
from autotp.state import find_tp_state

__all__ = ["allocate_meta", "check_materialized", "empty_shard", "empty_weights", "mark_loaded", "swap_tensors"]


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device; everything else is real.

    ``with autotp.empty_weights(): model = LlamaForCausalLM(config)`` costs the buffers' memory only.
    Parameters are moved to meta as they are registered (tied ones keep their identity), so any
    initialiser that runs after registration runs on meta. While the block runs,
    ``nn.Module.register_parameter`` is wrapped: build models in it from one thread at a time.
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def empty_shard(shard: ParamShard, dtype: torch.dtype, device: torch.device, rank: int) -> torch.Tensor:
    """This rank's shard of a parameter, allocated and not initialised; vocab padding rows are zero (as
    :func:`~autotp.shard_spec.vocab_shard` makes them), the owned rows are left for a loader to fill."""
    data = torch.empty(shard.local_shape, dtype=dtype, device=device)
    if shard.vocab is not None:
        owned = shard.vocab.owned(rank)
        data.narrow(shard.dim, owned, shard.local_shape[shard.dim] - owned).zero_()
    return data


def swap_tensors(model: nn.Module, kind: Literal["parameters", "buffers"],
                 make: Callable[[torch.Tensor], torch.Tensor | None]) -> int:
    """Replace tensors in every module that holds them, ties kept: ``make`` is called once per distinct
    parameter (or buffer) and its result, unless None, takes that tensor's place under all its names.
    Returns how many were replaced."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # id -> (old, kept alive so ids stay its own; new)
    for mod in model.modules():
        slots = mod._parameters if kind == "parameters" else mod._buffers
        for leaf, t in list(slots.items()):
            if t is None:
                continue
            if id(t) not in made:
                made[id(t)] = t, make(t)
            if (new := made[id(t)][1]) is not None:
                slots[leaf] = new
    return sum(new is not None for _, new in made.values())


def allocate_meta(model: nn.Module, device: torch.device, keep: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """Give every parameter still on meta (the replicated ones of a meta model) an uninitialised tensor
    of its full size on ``device``, ties kept; move such a model's real buffers to ``device``. Returns
    the names of buffers still on meta (a model built wholly on meta: they must come from a checkpoint).
    Parameters named in ``keep`` stay on meta (other pipeline stages' parameters)."""
    kept = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in keep}

    def allocate(p: torch.Tensor) -> torch.Tensor | None:
        if not p.is_meta or id(p) in kept:
            return None
        return nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)

    if swap_tensors(model, "parameters", allocate):
        swap_tensors(model, "buffers", lambda b: b.to(device) if not b.is_meta and b.device != device else None)
    return tuple(n for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta)


def mark_loaded(model: nn.Module, names: set[str] | None = None) -> None:
    """A load gave ``names`` (default: every tensor) of a model built on meta their values; buffers still on
    meta keep waiting."""
    st = find_tp_state(model)
    if st is None or not st.unloaded:
        return
    meta = {n for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta}
    st.unloaded = tuple(n for n in st.unloaded if n in meta or (names is not None and n not in names))


def check_materialized(names: tuple[str, ...]) -> None:
    """Refuse to run a model built on meta whose tensors have no values yet (not loaded, or buffers that
    are still on meta)."""
    if names:
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        raise ShardingError(
            f"{names[0]}{more} has no values yet: the model was built on the meta device and no checkpoint "
            "gave it values (a buffer still on the meta device is not in the checkpoint)",
            hint="load its weights with autotp.load_weights(model, path); build the model inside "
                 "`with autotp.empty_weights():` so that its own code computes its buffers (rotary tables, masks)")


MADV_POPULATE_WRITE = 23  # Linux 5.14+
PREFAULT_BYTES = 1 << 20


def prefault(t: torch.Tensor) -> None:
    """Map every page of a CPU tensor about to be written whole, in one ``madvise(MADV_POPULATE_WRITE)``.

    A shard :func:`allocate_meta` made is untouched memory: the copy that fills it takes a page fault per
    4 KiB, and faults of ranks sharing a host contend (2 GiB on each of two ranks: 2.5 s each, against 0.75 s
    populated first). Nothing changes but when the pages are mapped; where the call is unsupported (not
    Linux, an older kernel, not CPU memory) it does nothing."""
    if t.device.type != "cpu" or t.is_meta or t.nbytes < PREFAULT_BYTES or not t.is_contiguous():
        return
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = 4096
        start = t.data_ptr() & ~(page - 1)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(t.data_ptr() + t.nbytes - start),
                     ctypes.c_int(MADV_POPULATE_WRITE))  # an error (EINVAL: older kernel) leaves it as it was
    except (OSError, AttributeError):
        return


def trim_heap() -> None:
    """Hand the C heap's free memory back to the operating system (glibc's ``malloc_trim``).

    Capturing and planning a model frees many small objects (the export's graphs, fake tensors, meta runs)
    that glibc keeps for reuse: on a 14-layer Llama about 14 MB per rank, which a load that then fills the
    shards (allocated apart from the heap) would carry into its peak. Nothing else changes; where the call
    does not exist (another C library, not Linux) it does nothing."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):
        pass


MADV_RANDOM = 1


def confine(t: torch.Tensor) -> None:
    """Let page faults on a CPU tensor that views a file's mapping map only its own pages.

    A fault on a file mapping maps the neighbouring pages the page cache holds as well (fault-around, and
    a large folio mapped whole, 64 KiB to 2 MiB): for a shard viewing part of a checkpoint, other ranks'
    rows and other tensors, counted in this rank's RSS. ``madvise(MADV_RANDOM)`` on the tensor's own pages
    splits them into a mapping of their own, which faults never map beyond, and turns fault-around off
    there. Values do not change; where the call is unsupported it does nothing."""
    import ctypes
    import sys

    if t.device.type != "cpu" or t.nbytes == 0 or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = 4096
        start = t.data_ptr() & ~(page - 1)
        end = -(-(t.data_ptr() + t.nbytes) // page) * page
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(MADV_RANDOM))
    except (OSError, AttributeError):
        pass
