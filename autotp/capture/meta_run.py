"""One eager run of a forward on meta tensors, recorded op by op, for :mod:`autotp.capture.repeats` and the
plan cache's key (:mod:`autotp.plan.cache`).

The run costs a fraction of an export: no symbolic shapes, no graph. Each op is filed under the block of
the model's module list that runs it (None: the code around the blocks), with its arguments as plain data:
parameters and buffers by name (inside a block, relative to it), other tensors by shape, stride and dtype,
Python values as themselves. Blocks after the first of a kind repeat its ops exactly, so a memo turns them
into empty tensors of the recorded shapes instead of running meta kernels again. It also notes which
block's op made each tensor, so the tensors the forward returns can be told apart by block.

Where the meta run fails (a value read into Python), it runs again on fake tensors over the meta ones, as
torch.export's non-strict trace sees the model: code that skips a check on values while tracing
(Hugging Face's ``is_tracing(x)``) skips it here too.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode

from autotp.capture.cached import helpers_uncached
from autotp.capture.preserve import preserved, unique_names
from autotp.capture.structure import Spec, flatten
from autotp.errors import own_bug


@dataclass(frozen=True)
class Outputs:
    """What the forward returned in a meta run: its structure, and for each flat tensor the block whose op
    made it (None: the code around the blocks), e.g. each block's key and value in a KV cache."""

    spec: Spec
    made_in: tuple[int | None, ...]
    shapes: tuple[tuple, ...] = ()  # each flat tensor's (shape, dtype)


def _describe(x: object, names: dict[int, str], prefix: str) -> object:
    """An op argument as plain data: a parameter or buffer by its name (inside a block, relative to it), another
    tensor by shape and dtype, a Python value as itself."""
    if isinstance(x, torch.Tensor):
        name = names.get(id(x))
        if name is not None:
            return ("P", name[len(prefix):] if prefix and name.startswith(prefix) else name)
        return ("T", tuple(int(s) for s in x.shape), tuple(int(s) for s in x.stride()), x.dtype, x.device.type,
                x.requires_grad)
    if isinstance(x, (list, tuple)):
        return tuple(_describe(y, names, prefix) for y in x)
    if isinstance(x, dict):
        return tuple((k, _describe(v, names, prefix)) for k, v in sorted(x.items(), key=lambda kv: str(kv[0])))
    if isinstance(x, torch.device):
        return ("device",)  # meta here, the capture's device there: the same program
    if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.memory_format, torch.layout)):
        return x
    return type(x).__name__


@dataclass(frozen=True)
class _Out:  # not a NamedTuple: pytree would open it
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _all_meta(out: object) -> bool:
    leaves = pytree.tree_leaves(out)
    return all(isinstance(x, torch.Tensor) and x.is_meta and not x.requires_grad for x in leaves) and bool(leaves)


class Recorder(TorchDispatchMode):
    """Every op's record, filed under the block running it (None: the code around the blocks)."""

    def __init__(self, path: str = "") -> None:
        super().__init__()
        self.path = path
        self.names: dict[int, str] = {}
        self.block: int | None = None
        self.calls: list[int] = []
        self.segments: list[tuple[int | None, list]] = [(None, [])]
        # an op's meta outputs by its record: the blocks after the first of a kind repeat its ops exactly,
        # and meta kernels cost far more than making empty tensors of the recorded shapes
        self.memo: dict[tuple, object] = {}
        self.made: dict[int, int | None] = {}  # a tensor's id -> the block whose op last returned it
        self.output: object = None

    def enter(self, i: int) -> None:
        self.block = i
        self.calls.append(i)
        self.segments.append((i, []))

    def leave(self) -> None:
        self.block = None
        self.segments.append((None, []))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        prefix = f"{self.path}.{self.block}." if self.block is not None else ""
        record = (func, _describe(args, self.names, prefix), _describe(kwargs or {}, self.names, prefix))
        self.segments[-1][1].append(record)
        made = self.memo.get(record)
        if made is not None:
            out = pytree.tree_map(lambda t: torch.empty_strided(t.shape, t.stride, dtype=t.dtype, device="meta")
                                  if isinstance(t, _Out) else t, made)
        else:
            out = func(*args, **(kwargs or {}))
            if not func.is_view and not func._schema.is_mutable and _all_meta(out):
                self.memo[record] = pytree.tree_map(
                    lambda t: _Out(tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor) else t,
                    out)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made[id(t)] = self.block
        return out


@contextlib.contextmanager
def _on_meta(model: nn.Module, names: dict[int, str], params: dict[str, torch.Tensor] | None = None) -> Iterator[None]:
    """The model's parameters, buffers and plain tensor attributes (``inv_freq`` set in ``__init__``) as meta
    tensors for the duration (``params``' shapes where it names them: full-size stand-ins for shards);
    ``names`` gets each parameter's and buffer's name (a tied weight's first) by the meta tensor's id. The
    caller puts the model back (:func:`~autotp.capture.preserve.preserved`): the swap of a module registered
    under several paths is undone in the wrong order by ``torch.nn.utils.stateless`` alone."""
    state = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    state.update({n: t for n, t in (params or {}).items() if n in state})  # not those of blocks cut off
    made: dict[int, torch.Tensor] = {}

    def meta_of(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            m = torch.empty(t.shape, dtype=t.dtype, device="meta")
            made[id(t)] = nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else m
        return made[id(t)]

    meta = {}
    for name, t in state.items():
        meta[name] = meta_of(t)
        names.setdefault(id(meta[name]), name)
    for m in model.modules():
        for key, value in list(m.__dict__.items()):
            if isinstance(value, torch.Tensor) and not value.is_meta:
                m.__dict__[key] = meta_of(value)
    with _reparametrize_module(model, unique_names(model, meta)):
        yield


def record(model: nn.Module, blocks: nn.Module | None, run: Callable[[], object], path: str = "",
           params: dict[str, torch.Tensor] | None = None) -> Recorder | None:
    """The meta run's record, or None where it cannot run on meta (a value read into Python).

    It runs on meta tensors; where that fails, on fake tensors over them, as torch.export's non-strict trace
    sees them (Hugging Face's masks skip a check on values only for a fake tensor: ``is_tracing(x)``).
    Fake tensors cost about 6× more per op, so they are the second try."""
    return run_once(model, blocks, run, path, False, params) or run_once(model, blocks, run, path, True, params)


def run_once(model: nn.Module, blocks: nn.Module | None, run: Callable[[], object], path: str,
             fake: bool, params: dict[str, torch.Tensor] | None = None) -> Recorder | None:
    """One run of ``run`` on meta tensors (``fake``: fake tensors over them), each op filed under the block
    of ``blocks`` running it; None where it fails."""
    rec = Recorder(path)
    handles = []
    for i, block in enumerate(blocks if blocks is not None else ()):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=i: rec.enter(i)))
        handles.append(block.register_forward_hook(lambda m, a, o: rec.leave()))
    tensors = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    quiet = logging.getLogger("torch")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # fake tensor mode logs an op that fails; here failing is an answer
    try:
        with preserved(model), helpers_uncached(model), torch.no_grad(), tensors, \
                _on_meta(model, rec.names, params), rec:
            rec.output = run()
    except Exception as exc:  # noqa: BLE001 - anything the meta run cannot do: capture the whole model instead
        if own_bug(exc):  # autotp's own bug: shown, never a verdict
            raise
        return None
    finally:
        quiet.setLevel(level)
        for h in handles:
            h.remove()
    return rec


def outputs(rec: Recorder) -> Outputs:
    """What the recorded run returned, each tensor with the block that made it."""
    tensors, spec = flatten(rec.output)
    return Outputs(spec, tuple(rec.made.get(id(t)) for t in tensors),
                   tuple((tuple(t.shape), t.dtype) for t in tensors))


def text(rec: Recorder) -> str:
    """What the recorded forward computes, as text: every op it ran on meta, in order, with its arguments
    (parameters and buffers by name, other tensors by shape and dtype, Python values as themselves). Two
    calls with the same text capture to the same graph. Inside a block, parameters are named relative to
    the block and each op is filed under its block's index, so the blocks after the first of a kind ran
    from the memo."""
    return repr([(b, [(str(f), a, k) for f, a, k in ops]) for b, ops in rec.segments if ops or b is not None])
