"""Load a user's model file by path, and read the conventions the CLI relies on.

A model file defines ``build_model()`` (or a module-level ``model``) and optionally ``example_batch()``;
``path.py:factory`` names another callable (or module instance). A batch is a tuple of positional args, a
dict of keyword args, or ``(args, kwargs)``; a file without ``example_batch()`` gets :func:`default_example`,
the batch ``autotp.parallelize`` captures when given no ``example_inputs``. The loss is ``out.loss``,
``out["loss"]``, or the last element of a tuple output when that element is a 0-dim tensor.

Models too big for one device use the same file: with ``autotp shard --weights PATH`` the ranks call the
factory inside :func:`autotp.empty_weights` (parameters on meta, buffers computed by the model's own code),
so a factory builds the model from its config and leaves the weights to ``--weights``.
"""
from __future__ import annotations

import __future__
import importlib.util
import inspect
import re
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from autotp.capture.model_spec import model_path, parse_spec
from autotp.errors import ModelFileError, own_bug

__all__ = [
    "DEFAULT_BATCH_SHAPE",
    "DEFAULT_FACTORIES",
    "ModelFile",
    "ModelFileError",
    "default_example",
    "find_loss",
    "load_model_file",
    "output_tensors",
    "parse_spec",
    "replica_batch",
    "split_batch",
    "to_device",
]

DEFAULT_FACTORIES: tuple[str, ...] = ("build_model", "model")
DEFAULT_BATCH_SHAPE: tuple[int, int] = (2, 8)


@dataclass(frozen=True)
class ModelFile:
    """A loaded model file: how to build the model and, if the file says, an example batch."""

    path: Path
    factory_name: str
    factory: Callable[[], nn.Module] | nn.Module
    batch_fn: Callable[[], object] | None
    public_names: tuple[str, ...]
    # ``log_metrics(metrics: dict)``: called on rank 0 with each logged training step's metrics (autotp shard)
    log_metrics: Callable[[dict], object] | None = None

    def build(self) -> nn.Module:
        """The model: the factory's result, or the module-level instance itself."""
        if isinstance(self.factory, nn.Module):
            return self.factory
        try:
            model = self.factory()
        except Exception as exc:
            if own_bug(exc):  # autotp's own bug: shown, never a verdict
                raise
            raise ModelFileError(f"{self.factory_name}() in {self.path} raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(model, nn.Module):
            raise ModelFileError(
                f"{self.factory_name}() in {self.path} returned {type(model).__name__}, expected a torch.nn.Module"
            )
        return model

    def example_batch(self) -> tuple[tuple, dict]:
        """``example_batch()`` split into (args, kwargs)."""
        if self.batch_fn is None:
            raise ModelFileError(
                f"{self.path} defines no example_batch(); public names it defines: {_names(self.public_names)}",
                hint="add `def example_batch(): return (inputs, targets)` returning what the model's forward takes",
            )
        try:
            batch = self.batch_fn()
        except Exception as exc:
            if own_bug(exc):  # autotp's own bug: shown, never a verdict
                raise
            raise ModelFileError(f"example_batch() in {self.path} raised {type(exc).__name__}: {exc}") from exc
        return split_batch(batch)


def load_model_file(spec: str | Path) -> ModelFile:
    """Import the file named by ``spec`` and find its factory and ``example_batch``."""
    path, factory_name = model_path(spec)
    module = _import(path.resolve())
    public = _public_names(module)
    names = (factory_name,) if factory_name else DEFAULT_FACTORIES
    found = next((n for n in names if hasattr(module, n)), None)
    if found is None:
        wanted = f"`{factory_name}`" if factory_name else "build_model() nor a module-level `model`"
        raise ModelFileError(
            f"{path} defines {'no ' if factory_name else 'neither '}{wanted}; "
            f"public names it defines: {_names(public)}",
            hint=f"add `def build_model(): return MyModel(...)`, or name a factory as {path}:NAME",
        )
    factory = getattr(module, found)
    if not isinstance(factory, nn.Module) and not callable(factory):
        raise ModelFileError(f"`{found}` in {path} is a {type(factory).__name__}, "
                             "expected a callable returning a torch.nn.Module or an nn.Module instance")
    batch_fn = getattr(module, "example_batch", None)
    if batch_fn is not None and not callable(batch_fn):
        raise ModelFileError(f"`example_batch` in {path} is a {type(batch_fn).__name__}, expected a function")
    log = getattr(module, "log_metrics", None)
    if log is not None and not callable(log):
        raise ModelFileError(f"`log_metrics` in {path} is a {type(log).__name__}, expected a function taking a "
                             "dict of a training step's metrics")
    return ModelFile(path=path, factory_name=found, factory=factory, batch_fn=batch_fn, public_names=public,
                     log_metrics=log)


def _import(path: Path) -> types.ModuleType:
    name = f"_autotp_model_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"cannot import {path}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    # dataclasses and pickling look the defining module up in sys.modules while the file executes
    sys.modules[name] = module
    # sibling imports work as they would under `python path.py`
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        if own_bug(exc):  # autotp's own bug: shown, never a verdict
            raise
        sys.modules.pop(name, None)
        where = _user_line(exc, path)
        raise ModelFileError(f"importing {path} failed{where}: {type(exc).__name__}: {exc}") from exc
    return module


def _user_line(exc: BaseException, path: Path) -> str:
    frames = [f for f in inspect.getinnerframes(exc.__traceback__, context=0) if Path(f.filename) == path] \
        if exc.__traceback__ else []
    return f" at line {frames[-1].lineno}" if frames else ""


def _public_names(module: types.ModuleType) -> tuple[str, ...]:
    """Names a user wrote in the file: no underscores, no imported modules or imported functions/classes."""
    out = []
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, (types.ModuleType, __future__._Feature)):
            continue
        if (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__ != module.__name__:
            continue
        out.append(name)
    return tuple(sorted(out))


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(names) if names else "(none)"


def default_example(forward: Callable, vocab: int | None = None,
                    shape: tuple[int, int] = DEFAULT_BATCH_SHAPE) -> tuple[tuple, dict]:
    """The inputs used where none are given (``autotp.parallelize`` without ``example_inputs``, a model file
    without ``example_batch()``): a (2, 8) batch of token ids, as (args, kwargs).

    A token batch fits GPT-style models. A forward that can return a KV cache is asked not to
    (``use_cache=False``): training and planning do not use one. Capture computes nothing, so zeros serve it;
    a batch that is run (``autotp shard``'s parity check) passes ``vocab`` and gets ids drawn below it from a
    fixed seed instead, so that every rank's rows of a vocab-parallel embedding are looked up and every rank
    and every run gets the same batch.
    """
    params = inspect.signature(forward).parameters
    kwargs = {"use_cache": False} if "use_cache" in params else {}
    if vocab is None:
        return (torch.zeros(shape, dtype=torch.long),), kwargs
    return (torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0)),), kwargs


def split_batch(batch: object) -> tuple[tuple, dict]:
    """A batch as (args, kwargs): a dict is kwargs, ``(tuple_or_list, dict)`` is both, else positional."""
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, (tuple, list)):
        if len(batch) == 2 and isinstance(batch[0], (tuple, list)) and isinstance(batch[1], Mapping):
            return tuple(batch[0]), dict(batch[1])
        return tuple(batch), {}
    raise ModelFileError(f"example_batch() returned {type(batch).__name__}; expected a tuple of positional "
                         "args, a dict of keyword args, or (args, kwargs)")


def find_loss(out: object) -> torch.Tensor | None:
    """The loss in a model output, or None when the output carries none."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, Mapping) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    if isinstance(out, (tuple, list)) and out and isinstance(out[-1], torch.Tensor) and out[-1].dim() == 0:
        return out[-1]
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    return None


def output_tensors(out: object, prefix: str = "out") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a (nested) model output, with a path naming where it sits."""
    if isinstance(out, torch.Tensor):
        return [(prefix, out)]
    if isinstance(out, Mapping):
        items = out.items()
    elif isinstance(out, (tuple, list)):
        items = enumerate(out)
    else:
        return []
    return [t for key, value in items for t in output_tensors(value, f"{prefix}[{key!r}]")]


def to_device(value, device: torch.device):
    """Every tensor in a (nested) batch moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    return value


def replica_batch(args: tuple, kwargs: dict, dp_rank: int, step: int) -> tuple[tuple, dict]:
    """The example batch's rows resampled (with replacement), seeded by (step, dp rank).

    Dim 0 is taken as the batch for every tensor whose leading size equals the first input tensor's.
    """
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not tensors:
        return args, kwargs
    size = tensors[0].shape[0]
    rows = torch.randint(0, size, (size,), generator=torch.Generator().manual_seed(1_000_003 * step + dp_rank))

    def pick(t):
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == size:
            return t.index_select(0, rows.to(t.device))
        return t

    return tuple(pick(a) for a in args), {k: pick(v) for k, v in kwargs.items()}


def planning_batch(mf: ModelFile, net: torch.nn.Module, batch: int | None,
           seq: int | None) -> tuple[tuple, dict, int, int, str]:
    """The inputs ``autotp plan`` captures on, the (b, s) its numbers are for (``batch``/``seq`` when given),
    and a note when the default batch stands in for a missing example_batch()."""
    if mf.batch_fn is None:
        # autotp.parallelize's own default (use_cache=False included), at --batch / --seq when given; real (tiny)
        # ids, not meta: capture turns them into meta itself, and may need real ones
        b = batch if batch is not None else DEFAULT_BATCH_SHAPE[0]
        s = seq if seq is not None else DEFAULT_BATCH_SHAPE[1]
        args, kwargs = default_example(net.forward, shape=(b, s))
        sizes = " (sizes from --batch/--seq)" if batch is not None or seq is not None else ""
        return args, kwargs, b, s, (f"{mf.path} defines no example_batch(): planned on the default batch, "
                                    f"({b}, {s}) token ids{sizes}, as autotp.parallelize without example_inputs")
    args, kwargs = mf.example_batch()
    first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.dim() >= 2), None)
    if first is None and (batch is None or seq is None):
        raise ModelFileError(f"example_batch() in {mf.path} has no tensor of at least 2 dims (batch, sequence)",
                             hint="pass --batch B --seq S")
    b = batch if batch is not None else first.shape[0]
    s = seq if seq is not None else first.shape[1]
    if first is not None and first.shape[0] == 1 and b > 1:
        # export specialises a size of 1: an example of one row would fix the batch dim at 1 in the graph, and
        # the numbers for --batch would not follow it; two rows keep it symbolic
        args, kwargs = tuple(_rows(a, 2) for a in args), {k: _rows(v, 2) for k, v in kwargs.items()}
    return args, kwargs, int(b), int(s), ""


def _rows(x: object, n: int) -> object:
    """``x`` with ``n`` rows where it is a tensor of one row (at least 2 dims: batch, sequence)."""
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == 1:
        return x.expand(n, *x.shape[1:]).contiguous()
    return x
