"""Checksums of a checkpoint's files: computed while DCP writes them, kept in the manifest, checked before a
load uses any value.

A flipped byte inside a tensor's data (a bad disk, a copy cut short and patched, a stray write) leaves DCP's
metadata and every size as they were: the load would succeed and training go on from wrong values. Each
file's CRC-32 (``zlib.crc32``) is taken on the bytes as they pass to the file, so saving reads nothing twice:
:class:`DigestingWriter` is DCP's ``FileSystemWriter`` whose streams add every write to a running CRC. The
ranks' digests go to the manifest (``files``: name -> crc32 and bytes), and the manifest carries the CRC-32 of
its own content (:func:`manifest_digest`). Before a load each rank reads a share of the files and compares;
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

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from autotp.errors import CheckpointError

CHUNK = 1 << 22  # bytes read at a time when checking


class _Digesting:
    """A write stream that keeps the CRC-32 and length of what passes through it. A seek (never made by
    DCP's writer) makes the digest unknown rather than wrong."""

    def __init__(self, stream: Any) -> None:
        self._stream, self.crc, self.size, self.known = stream, 0, 0, True

    def write(self, data: Any) -> int:
        n = self._stream.write(data)
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view if n is None or n == len(view) else view[:n], self.crc)
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
                self.digests[Path(path).name] = {"crc32": digesting.crc, "bytes": digesting.size}

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


def checked_digests(path: Path, files: object) -> dict[str, dict[str, int]]:
    """The manifest's ``files`` entry, checked to be name -> {crc32, bytes} of plain names."""
    manifest = path / "autotp.json"
    if not isinstance(files, Mapping):
        raise CheckpointError(f"{manifest}: files is {type(files).__name__}, not a table of digests",
                              hint="the file is damaged or was tampered with: resume from another checkpoint")
    for name, d in files.items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..") or \
                not isinstance(d, Mapping) or not all(isinstance(d.get(k), int) and not isinstance(d.get(k), bool)
                                                      for k in ("crc32", "bytes")):
            raise CheckpointError(f"{manifest}: the digest of {name!r} is {d!r}",
                                  hint="the file is damaged or was tampered with: resume from another checkpoint")
    return dict(files)


def digest_mismatch(path: Path, name: str, want: Mapping[str, int]) -> str | None:
    """Read ``path/name`` and compare it with its digest: None when it matches, else what differs."""
    file = path / name
    crc, size = 0, 0
    try:
        with open(file, "rb") as f:
            while chunk := f.read(CHUNK):
                crc = zlib.crc32(chunk, crc)
                size += len(chunk)
    except OSError as exc:
        return f"{file} cannot be read ({exc.strerror or exc})"
    if size != want["bytes"]:
        return f"{file} holds {size} bytes, the checkpoint wrote {want['bytes']}"
    if crc != want["crc32"]:
        return f"{file} does not match its checksum (crc32 {crc:08x}, written {want['crc32']:08x}): it changed " \
               "after the save"
    return None


def verify_share(path: Path, files: Mapping[str, Mapping[str, int]], rank: int, world: int) -> str | None:
    """Check this rank's share of the files (every ``world``-th, by name): the first mismatch, or None."""
    for i, name in enumerate(sorted(files)):
        if i % world == rank and (bad := digest_mismatch(path, name, files[name])) is not None:
            return bad
    return None
