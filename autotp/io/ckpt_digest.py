"""Checksums of a checkpoint's files: computed while DCP writes them, kept in the manifest, checked before a
load uses any value.

A flipped byte inside a tensor's data (a bad disk, a copy cut short and patched, a stray write) leaves DCP's
metadata and every size as they were: the load would succeed and training go on from wrong values. Each
file's XXH3-64 digest (``xxhash``, about 20 GB/s on one core, against zlib's CRC-32 at about 4) is taken on the
bytes as they pass to the file, so saving reads nothing twice: :class:`DigestingWriter` is DCP's
``FileSystemWriter`` whose streams add every write to a running digest. The ranks' digests go to the manifest
(``files``: name -> xxh3_64 and bytes; manifests written with ``crc32`` instead are checked with it), and the
manifest carries the CRC-32 of its own content (:func:`manifest_digest`). Before a load each rank reads a share of the files and compares;
any mismatch fails every rank with the file's name.
"""
from __future__ import annotations

import contextlib
import json
import os
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from autotp.errors import CheckpointError

CHUNK = 1 << 22  # bytes read at a time when checking


KIND = "xxh3_64"  # the digest new checkpoints carry; "crc32" is still checked where a manifest has it


class _Digesting:
    """A write stream that keeps the digest and length of what passes through it. A seek (never made by
    DCP's writer) makes the digest unknown rather than wrong."""

    def __init__(self, stream: Any) -> None:
        self._stream, self.hash, self.size, self.known = stream, xxhash.xxh3_64(), 0, True

    def write(self, data: Any) -> int:
        n = self._stream.write(data)
        view = memoryview(data).cast("B")
        self.hash.update(view if n is None or n == len(view) else view[:n])
        self.size += len(view) if n is None else n
        return n

    def seek(self, *args: Any) -> int:
        self.known = False
        return self._stream.seek(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _DigestingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, dict[str, int]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            digesting = _Digesting(stream)
            yield digesting
            if digesting.known:
                self.digests[Path(path).name] = {KIND: digesting.hash.intdigest(), "bytes": digesting.size}

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        if (d := self.digests.pop(Path(path).name, None)) is not None:
            self.digests[Path(new_path).name] = d


class DigestingWriter(FileSystemWriter):
    """DCP's file-system writer, keeping the digest of every file it writes (``digests``)."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _DigestingFileSystem()

    @property
    def digests(self) -> dict[str, dict[str, int]]:
        return self.fs.digests


SELF = "manifest_crc32"  # the manifest's checksum of its own content (every other key, canonical JSON)


def manifest_digest(info: Mapping[str, Any]) -> int:
    """CRC-32 of the manifest without its own checksum, over canonical JSON (sorted keys): a flipped byte
    that still parses (a digit of a count, a letter of a name) changes it; reformatting does not."""
    body = {k: v for k, v in info.items() if k != SELF}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def checked_digests(path: Path, files: object) -> dict[str, dict[str, int]]:
    """The manifest's ``files`` entry, checked to be name -> {xxh3_64 or crc32, bytes} of plain names."""
    manifest = path / "autotp.json"
    if not isinstance(files, Mapping):
        raise CheckpointError(f"{manifest}: files is {type(files).__name__}, not a table of digests",
                              hint="the file is damaged or was tampered with: resume from another checkpoint")
    for name, d in files.items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..") or \
                not isinstance(d, Mapping) or not _int(d.get("bytes")) or not any(_int(d.get(k)) for k in _DIGESTS):
            raise CheckpointError(f"{manifest}: the digest of {name!r} is {d!r}",
                                  hint="the file is damaged or was tampered with: resume from another checkpoint")
    return dict(files)


class _Crc32:  # the digest of manifests written before XXH3, as xxhash's interface
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


_DIGESTS = {KIND: xxhash.xxh3_64, "crc32": _Crc32}


def digest_mismatch(path: Path, name: str, want: Mapping[str, int]) -> str | None:
    """Read ``path/name`` and compare it with its digest: None when it matches, else what differs."""
    file = path / name
    kind = next(k for k in _DIGESTS if k in want)
    digest, size = _DIGESTS[kind](), 0
    try:
        with open(file, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
    except OSError as exc:
        return f"{file} cannot be read ({exc.strerror or exc})"
    if size != want["bytes"]:
        return f"{file} holds {size} bytes, the checkpoint wrote {want['bytes']}"
    if (got := digest.intdigest()) != want[kind]:
        return f"{file} does not match its checksum ({kind} {got:016x}, written {want[kind]:016x}): it changed " \
               "after the save"
    return None


def verify_share(path: Path, files: Mapping[str, Mapping[str, int]], rank: int, world: int) -> str | None:
    """Check this rank's share of the files (every ``world``-th, by name): the first mismatch, or None."""
    for i, name in enumerate(sorted(files)):
        if i % world == rank and (bad := digest_mismatch(path, name, files[name])) is not None:
            return bad
    return None
