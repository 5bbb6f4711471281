"""Opening a torch.distributed.checkpoint folder without running anything it contains.

DCP (torch 2.13) reads a checkpoint through two doors that trust the files:

* ``FileSystemReader.read_metadata`` reads ``.metadata`` with a bare ``pickle.load``: a tampered file runs
  any code it names the moment it is read;
* ``DefaultLoadPlanner.load_bytes`` reads every entry the metadata calls "bytes" with
  ``torch.load(weights_only=False)``. Tensor entries are safe (``torch.load(weights_only=True)``).

The simplest approach that closes both, used by every autotp loader (:func:`safe_load`):

1. ``.metadata`` is unpickled by :class:`_MetadataUnpickler`, the "restricting globals" pattern of Python's
   pickle documentation: only the classes DCP's metadata is made of resolve (the dataclasses of
   ``torch.distributed.checkpoint.metadata``, ``_StorageInfo``, ``torch.Size``, dtypes, layouts, paths). Any
   other global (``os.system``, ``builtins.open``, ``eval``) fails at lookup, before it can be called, so
   nothing runs.
2. :func:`verify` checks the result against what the caller is about to load: every key present as a tensor
   (never bytes) of the expected global shape, stored in a plain file of this folder long enough to hold it.
   A metadata file from another model, a pickled entry or a truncated shard fails here, naming the file.
3. ``dcp.load`` gets a reader that hands back this verified metadata instead of reading the file again, and
   a planner that refuses bytes entries outright.

A JSON manifest of our own would not remove the pickle: DCP needs its ``Metadata`` object, so the file would
still be unpickled, or the object rebuilt by hand. Validating DCP's own file is less code and no second copy.
"""
from __future__ import annotations

import errno
import os
import pickle
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata

from autotp.errors import CheckpointError, own_bug

__all__ = ["METADATA", "read_metadata", "safe_load", "verify", "verify_files"]

METADATA = ".metadata"
_PATHS = frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"})
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # maps a layout's name to torch.strided & co
    "pathlib": _PATHS,  # StorageMeta.checkpoint_id
    "pathlib._local": _PATHS,  # where Python 3.13 defines them
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals a DCP metadata file is built from; anything else is an error, not a call."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), _TORCH_VALUES)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which checkpoint metadata never holds")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference, which checkpoint metadata never holds")


def read_metadata(path: Path | str) -> Metadata:
    """The checkpoint's DCP metadata, unpickled with :class:`_MetadataUnpickler` (never runs code)."""
    file = Path(path) / METADATA
    try:
        with open(file, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: {path} is not a complete checkpoint") from None
    except Exception as exc:  # noqa: BLE001 - any failure to parse is the same verdict for the user
        if own_bug(exc):  # autotp's own bug: shown, never a verdict
            raise
        raise CheckpointError(f"{file} is not checkpoint metadata: {_first_line(exc)}; it was not loaded and "
                              "nothing in it was run",
                              hint="the file is damaged or was tampered with: resume from another checkpoint") from None
    if not (isinstance(meta, Metadata) and isinstance(meta.state_dict_metadata, dict)
            and isinstance(meta.storage_data, dict)):
        raise CheckpointError(f"{file} is not checkpoint metadata: it holds a {type(meta).__name__}",
                              hint="the file is damaged or was tampered with: resume from another checkpoint")
    return meta


def flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(DCP key, leaf) of a nested state dict: keys joined with dots, as DCP flattens them."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def verify(path: Path | str, meta: Metadata, state: Mapping[str, Any]) -> None:
    """Check that ``meta`` describes what loading ``state`` will read; CheckpointError naming the file if not."""
    _checked(_verify, Path(path), meta, state)


def verify_files(path: Path | str, meta: Metadata, keys: set[str] | None = None) -> None:
    """Check that the entries of ``keys`` (default: all) lie in plain files of the folder, long enough to
    hold them: a missing or truncated shard file fails here, named, before any rank reads it."""
    _checked(_verify_files, Path(path), meta, keys)


def _checked(check, path: Path, *args: Any) -> None:
    try:
        check(path, *args)
    except (TypeError, AttributeError, ValueError) as exc:  # a field of the wrong type: hand-made metadata
        raise CheckpointError(f"{path / METADATA} is not checkpoint metadata: {type(exc).__name__}: {exc}",
                              hint="the file is damaged or was tampered with: resume from another checkpoint") from None


def _verify(path: Path, meta: Metadata, state: Mapping[str, Any]) -> None:
    file = path / METADATA
    expected = dict(flatten(state))
    have = meta.state_dict_metadata
    missing = [key for key in expected if key not in have]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{file} does not match this model: it has no {missing[0]}{more}",
                              hint="the checkpoint was written for another model; resume with the model file "
                                   "that saved it, or start afresh in another run folder")
    for key, value in expected.items():
        md = have[key]
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{file}: {key} is stored as a pickled object, not a tensor; autotp never "
                                  "unpickles checkpoint data",
                                  hint="the checkpoint was written by an older autotp or tampered with")
        if tuple(md.size) != tuple(value.shape):
            raise CheckpointError(f"{file} does not match this model: {key} is {tuple(md.size)} in the checkpoint, "
                                  f"{tuple(value.shape)} here",
                                  hint="the checkpoint was written for another model (or model config)")
    _verify_files(path, meta, set(expected))


def _verify_files(path: Path, meta: Metadata, keys: set[str] | None) -> None:
    file = path / METADATA
    sizes: dict[str, int] = {}
    for index, info in meta.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CheckpointError(f"{file} is not checkpoint metadata: its storage table holds "
                                  f"{type(index).__name__} -> {type(info).__name__}")
        if keys is not None and index.fqn not in keys:
            continue
        name = info.relative_path
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise CheckpointError(f"{file}: {index.fqn} is stored at {name!r}, outside the checkpoint folder",
                                  hint="the metadata was tampered with")
        if info.transform_descriptors:
            raise CheckpointError(f"{file}: {index.fqn} is stored through transforms {info.transform_descriptors}, "
                                  "which autotp does not write")
        shard = path / name
        if name not in sizes:
            try:
                sizes[name] = shard.stat().st_size if shard.is_file() else -1
            except OSError:
                sizes[name] = -1
        if sizes[name] < 0:
            raise CheckpointError(f"{shard} is missing: {file} stores {index.fqn} there")
        if not (isinstance(info.offset, int) and isinstance(info.length, int)) or info.offset < 0 or info.length < 0 \
                or info.offset + info.length > sizes[name]:
            raise CheckpointError(f"{shard} is truncated: {sizes[name]} bytes, but {index.fqn} is stored at bytes "
                                  f"{info.offset}..{info.offset + info.length}",
                                  hint="the file was cut short (a full disk, an interrupted copy): resume from "
                                       "another checkpoint")


class _VerifiedReader(FileSystemReader):
    """A FileSystemReader that hands DCP metadata already read and verified, instead of unpickling the file."""

    def __init__(self, path: Path | str, metadata: Metadata):
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner, except that a bytes entry (read with ``torch.load(weights_only=False)``) is refused."""

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"{read_item.dest_index.fqn} is a pickled object; autotp never unpickles checkpoint data")


def safe_load(state: dict[str, Any], path: Path | str, *, metadata: Metadata | None = None,
              group: dist.ProcessGroup | None = None, no_dist: bool = False) -> None:
    """``dcp.load(state, path)`` in place, after :func:`read_metadata` and :func:`verify` (see the module doc).

    Every rank reads and verifies the files itself before the first collective, so a bad checkpoint fails on
    all ranks alike, with the same CheckpointError.
    """
    meta = read_metadata(path) if metadata is None else metadata
    verify(path, meta, state)
    try:
        dcp.load(state, storage_reader=_VerifiedReader(path, meta), planner=_TensorsOnlyPlanner(),
                 process_group=group, no_dist=no_dist)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's errors name keys, not the cause
        if own_bug(exc):  # autotp's own bug: shown, never a verdict
            raise
        raise CheckpointError(f"cannot load checkpoint {path}: {cause(exc, path)}",
                              hint="the shard files are damaged, or were written for another model: resume "
                                   "from another checkpoint (--resume-from)") from None


def cause(exc: BaseException, within: Path | str | None = None) -> str:
    """The root cause of a checkpoint failure in one line: the first rank's exception inside DCP's
    ``CheckpointException`` (a ``BaseException``, whose text is every rank's traceback), an ``OSError`` by
    its errno's name (``No space left on device (ENOSPC): path``), else the first line of the message. A path
    in or equal to ``within`` (which the caller's message names) is shortened to its part below it."""
    while isinstance(exc, CheckpointException) and exc.failures:
        inner = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        exc = next((e for e in inner if isinstance(e, OSError)), inner[0])  # an errno says most
    if isinstance(exc, CheckpointError):
        return str(exc).splitlines()[0]
    if isinstance(exc, OSError) and exc.errno in errno.errorcode:
        where = f": {exc.filename}" if exc.filename else ""
        if exc.filename and within is not None:
            inside = os.path.relpath(exc.filename, within)
            where = "" if inside == "." else where if inside.startswith("..") else f": {inside}"
        return f"{exc.strerror or os.strerror(exc.errno)} ({errno.errorcode[exc.errno]}){where}"
    if isinstance(exc, pickle.UnpicklingError):  # torch.load's advice (weights_only=False) is wrong here
        return f"{type(exc).__name__}: a shard file does not hold the tensors torch wrote (damaged)"
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
