"""Where weights come from: one small interface over the checkpoint formats :func:`autotp.load_weights` reads.

A :class:`Source` lists its tensors (name -> shape, dtype) and copies index ranges of one tensor along one
dim into destination tensors (views into this rank's shards), so that a rank reads only its slices:

- :class:`SafetensorsSource`: a Hugging Face checkpoint folder (``model.safetensors``, or shards listed in
  ``model.safetensors.index.json``) or one ``.safetensors`` file. ``safe_open(...).get_slice(name)[...]``
  copies a range out of the memory-mapped file, :data:`CHUNK_BYTES` of the file's rows at a time, the file
  opened for each: the pages a read maps are let go as soon as it is done (a handle kept open keeps every
  page it touched in the process's RSS; a whole tensor's would add up to the largest tensor).
- :class:`TorchFileSource`: a ``torch.save``'d state dict, opened with ``torch.load(mmap=True,
  weights_only=True)``: nothing is unpickled but tensors, and nothing is read until a slice is copied. The
  mapping is renewed after every :data:`REMAP_BYTES` read, for the same reason.
- :class:`DcpSource`: a torch.distributed.checkpoint folder (autotp's, whose weights sit under ``model.``,
  or any other). Its metadata is read by :mod:`autotp.io.ckpt_safety` (nothing unpickled as arbitrary
  objects); the reads are queued and run by one ``dcp.load`` per rank (``no_dist``: no collective), whose
  planner asks for exactly the requested boxes, so DCP reads only the stored chunks that overlap them.

For ``load_weights(..., mmap=True)`` the safetensors and torch sources also hand out a range along dim 0 as
a *view* (:meth:`Source.view`): a tensor over the file's private, copy-on-write mapping (the one
``safe_open`` and ``torch.load(mmap=True)`` make), which copies nothing.

``bytes_read`` counts the bytes of the slices asked for, in the checkpoint's dtype.
"""
from __future__ import annotations

import json
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

from autotp.io.ckpt_safety import METADATA, _TensorsOnlyPlanner, _VerifiedReader, read_metadata, verify_files
from autotp.errors import CheckpointError, own_bug

__all__ = ["DcpSource", "CopyRange", "SafetensorsSource", "Source", "TensorInfo", "TorchFileSource", "open_source"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
REMAP_BYTES = 256 << 20
CHUNK_BYTES = 2 << 20  # what a read adds to the peak, at most: the rows being copied
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class CopyRange:
    """Copy ``[start, start + length)`` along the read's dim of a checkpoint tensor into ``out``."""

    start: int
    length: int
    out: torch.Tensor


class Source(ABC):
    """A checkpoint this rank reads slices of. ``read`` may only queue; ``finish`` completes every read."""

    kind: str = ""

    def __init__(self, path: Path):
        self.path = path
        self.bytes_read = 0

    @abstractmethod
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor of the checkpoint: name -> full shape and stored dtype."""

    @abstractmethod
    def read(self, name: str, dim: int, pieces: list[CopyRange]) -> None:
        """Copy each piece's range of tensor ``name`` along ``dim`` into the piece's ``out``."""

    def view(self, name: str, dim: int, piece: CopyRange) -> torch.Tensor | None:
        """The piece's range of tensor ``name`` as a tensor over a private (copy-on-write) mapping of the
        checkpoint's file, where the format stores that range as one run of bytes; else None."""
        return None

    def finish(self) -> None:
        """Complete the reads queued so far."""

    def _count(self, pieces: list[CopyRange], dtype: torch.dtype) -> None:
        self.bytes_read += sum(p.out.numel() for p in pieces) * dtype.itemsize


def _index(ndim: int, dim: int, piece: CopyRange) -> tuple[slice, ...]:
    index = [slice(None)] * ndim
    index[dim] = slice(piece.start, piece.start + piece.length)
    return tuple(index)


class SafetensorsSource(Source):
    kind = "safetensors"

    def __init__(self, path: Path):
        super().__init__(path)
        from safetensors import safe_open

        self._open = safe_open
        self._handles: dict = {}
        self._files = self._weight_map(path)
        self._info: dict[str, TensorInfo] = {}
        for file in sorted(set(self._files.values())):
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        sl = f.get_slice(name)
                        dtype = _ST_DTYPES.get(sl.get_dtype())
                        if dtype is None:
                            raise CheckpointError(f"{file}: {name} has dtype {sl.get_dtype()}, which autotp does not load")
                        self._info[name] = TensorInfo(tuple(sl.get_shape()), dtype)
            except CheckpointError:
                raise
            except Exception as exc:  # noqa: BLE001 - safetensors' errors do not name the file
                if own_bug(exc):  # autotp's own bug: shown, never a verdict
                    raise
                raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from None
        absent = sorted(n for n, f in self._files.items() if n not in self._info)
        if absent:
            raise CheckpointError(f"{path / INDEX} lists {absent[0]} (and {len(absent) - 1} more) in "
                                  f"{self._files[absent[0]].name}, which does not hold it")

    @staticmethod
    def _names(file: Path) -> list[str]:
        """The tensor names in one safetensors file; CheckpointError naming the file (and the reader's reason)
        when its header cannot be read (safetensors' own errors name no file)."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(file), framework="pt") as f:
                return list(f.keys())
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from None

    @classmethod
    def _weight_map(cls, path: Path) -> dict[str, Path]:
        if path.is_file():
            return {name: path for name in cls._names(path)}
        if (path / INDEX).is_file():
            try:
                weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{path / INDEX} is not a safetensors index: {exc}") from None
            files = {}
            for name, file in weight_map.items():
                if not isinstance(file, str) or Path(file).name != file:
                    raise CheckpointError(f"{path / INDEX}: {name} is stored at {file!r}, outside the folder")
                if not (path / file).is_file():
                    raise CheckpointError(f"{path / file} is missing: {path / INDEX} stores {name} there")
                files[name] = path / file
            return files
        files = {}
        for file in [path / SINGLE] if (path / SINGLE).is_file() else sorted(path.glob("*.safetensors")):
            files.update({name: file for name in cls._names(file)})
        return files

    def tensors(self) -> dict[str, TensorInfo]:
        return dict(self._info)

    def read(self, name: str, dim: int, pieces: list[CopyRange]) -> None:
        info = self._info[name]
        file = str(self._files[name])
        if not info.shape:
            with self._open(file, framework="pt") as f:
                pieces[0].out.copy_(f.get_tensor(name))
        # a few rows at a time, the file opened for each: closing it unmaps the pages that read touched (the
        # kernel maps whole pages and their neighbours, so a strided slice maps most of the rows it crosses)
        row = info.dtype.itemsize * torch.Size(info.shape[1:]).numel()
        step = max(1, CHUNK_BYTES // max(row, 1))
        for p in pieces if info.shape else ():
            lo, hi = (p.start, p.start + p.length) if dim == 0 else (0, info.shape[0])
            for a in range(lo, hi, step):
                b = min(a + step, hi)
                index = list(_index(len(info.shape), dim, p))
                index[0] = slice(a, b)
                with self._open(file, framework="pt") as f:
                    p.out.narrow(0, a - lo, b - a).copy_(f.get_slice(name)[tuple(index)])
        self._count(pieces, info.dtype)

    def view(self, name: str, dim: int, piece: CopyRange) -> torch.Tensor | None:
        info = self._info[name]
        if info.shape and dim != 0:
            return None
        file = str(self._files[name])
        if file not in self._handles:  # one mapping per file, kept alive by the views it gives
            self._handles[file] = self._open(file, framework="pt")
        f = self._handles[file]
        out = f.get_slice(name)[piece.start:piece.start + piece.length] if info.shape else f.get_tensor(name)
        self._count([piece], info.dtype)
        return out

    def finish(self) -> None:
        self._handles.clear()


class TorchFileSource(Source):
    kind = "torch"

    def __init__(self, path: Path):
        super().__init__(path)
        self._state = self._load()
        self._info = {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in self._state.items()}
        self._mapped = 0

    def _load(self) -> dict[str, torch.Tensor]:
        try:
            state = torch.load(self.path, mmap=True, weights_only=True, map_location="cpu")
        except Exception as exc:  # noqa: BLE001 - one verdict: not a state dict autotp can map
            if own_bug(exc):  # autotp's own bug: shown, never a verdict
                raise
            raise CheckpointError(f"{self.path} is not a torch state-dict file that loads with mmap=True and "
                                  f"weights_only=True: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc}",
                                  hint="save it with torch.save(model.state_dict(), path)") from None
        if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                  for k, v in state.items()):
            raise CheckpointError(f"{self.path} holds a {type(state).__name__}, not a state dict of tensors",
                                  hint="save it with torch.save(model.state_dict(), path)")
        return state

    def tensors(self) -> dict[str, TensorInfo]:
        return dict(self._info)

    def read(self, name: str, dim: int, pieces: list[CopyRange]) -> None:
        if self._state is None:
            self._state = self._load()
        t = self._state[name]
        for p in pieces:
            p.out.copy_(t[_index(t.dim(), dim, p)] if t.dim() else t)
        self._count(pieces, t.dtype)
        self._mapped += t.nbytes
        if self._mapped > REMAP_BYTES:  # let the pages mapped so far go
            self._state, self._mapped = None, 0

    def view(self, name: str, dim: int, piece: CopyRange) -> torch.Tensor | None:
        if self._state is None:
            self._state = self._load()
        t = self._state[name]
        if t.dim() and dim != 0:
            return None
        self._count([piece], t.dtype)
        return t.narrow(0, piece.start, piece.length) if t.dim() else t


class _Boxes:
    """The boxes of one checkpoint tensor this rank reads, in DCP's chunk protocol (``__create_chunk_list__``)."""

    def __init__(self) -> None:
        self.chunks: list[ChunkStorageMetadata] = []
        self.outs: list[torch.Tensor] = []

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self.chunks


class _BoxPlanner(_TensorsOnlyPlanner):
    """Reads land in the boxes' destination tensors (a read item's ``dest_index.index`` is its box)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # the boxes are flat already, and not tensors for DCP to allocate (its set-up drops other objects)
        self.original_state_dict = self.state_dict = state_dict
        self.mappings = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].outs[index.index]


_AUTOTP_SPACES = ("model.", "optim.", "train.", "rng.")


class DcpSource(Source):
    kind = "dcp"

    def __init__(self, path: Path):
        super().__init__(path)
        self._meta = read_metadata(path)
        entries = {k: md for k, md in self._meta.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
        # autotp's checkpoints hold the weights under "model." next to optimizer, step and RNG state
        autotp = any(k.startswith("model.") for k in entries) and all(k.startswith(_AUTOTP_SPACES) for k in entries)
        self._prefix = "model." if autotp else ""
        self._info = {k[len(self._prefix):]: TensorInfo(tuple(md.size), md.properties.dtype)
                      for k, md in entries.items() if k.startswith(self._prefix)}
        self._boxes: dict[str, _Boxes] = {}

    def tensors(self) -> dict[str, TensorInfo]:
        return dict(self._info)

    def read(self, name: str, dim: int, pieces: list[CopyRange]) -> None:
        boxes = self._boxes.setdefault(self._prefix + name, _Boxes())
        ndim = len(self._info[name].shape)
        for p in pieces:
            offsets = [0] * ndim
            if ndim:
                offsets[dim] = p.start
            boxes.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=p.out.shape))
            boxes.outs.append(p.out)
        self._count(pieces, self._info[name].dtype)

    def finish(self) -> None:
        if not self._boxes:
            return
        verify_files(self.path, self._meta, set(self._boxes))
        boxes, self._boxes = self._boxes, {}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
                dcp.load(boxes, storage_reader=_VerifiedReader(self.path, self._meta), planner=_BoxPlanner(),
                         no_dist=True)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - DCP's errors name keys, not the cause a user can act on
            if own_bug(exc):  # autotp's own bug: shown, never a verdict
                raise
            raise CheckpointError(f"cannot read checkpoint {self.path}: {type(exc).__name__}: {exc}",
                                  hint="the shard files are damaged, or were written for another model") from exc


def open_source(path: Path | str) -> Source:
    """The source a path names: a DCP folder (``.metadata``), a safetensors folder or file, or a torch file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"weights {path} do not exist",
                              hint="pass a Hugging Face checkpoint folder (safetensors), an autotp/DCP checkpoint "
                                   "folder, or a torch state-dict file")
    if path.is_dir():
        if (path / METADATA).is_file():
            return DcpSource(path)
        if (path / INDEX).is_file() or any(path.glob("*.safetensors")):
            return SafetensorsSource(path)
        raise CheckpointError(f"{path} holds no weights autotp reads: no {METADATA} (torch.distributed.checkpoint), "
                              f"no {INDEX} and no *.safetensors file",
                              hint="a Hugging Face checkpoint folder needs its safetensors files; .bin files are "
                                   "read as torch files, one at a time")
    with open(path, "rb") as f:
        head = f.read(9)
    # a safetensors file opens with its header's length (8 bytes) and the header's JSON; torch.save's is a zip
    safetensors = path.suffix == ".safetensors" or (len(head) == 9 and head[8:] == b"{")
    return SafetensorsSource(path) if safetensors else TorchFileSource(path)
