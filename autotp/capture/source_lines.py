"""Capture reads source files for its stack traces; the process does not keep them.

``torch.export`` records each node's stack trace (the model's line that made it, shown in autotp's reasons
and errors), and formatting a frame reads its source line through :mod:`linecache`, which then holds the
whole file for the life of the process: every frame's file, torch's own and the model's. For a Hugging Face
Llama that is about 4.6 MB per process, kept after ``parallelize`` returns beside a big model's shards.
:func:`source_lines_released` drops, on exit, the entries read from a file during
the block: ``linecache`` reads a file again when a traceback next needs it (no slower here: the files are
in the page cache). Entries that were there before stay, as do those no file backs (generated code such as
fx's graphs and notebook cells, whose lines could not be read again).
"""
from __future__ import annotations

import contextlib
import linecache
from collections.abc import Iterator

__all__ = ["source_lines_released"]


@contextlib.contextmanager
def source_lines_released() -> Iterator[None]:
    before = set(linecache.cache)
    try:
        yield
    finally:
        for name in [n for n in list(linecache.cache) if n not in before]:
            entry = linecache.cache.get(name)
            # (size, mtime, lines, fullname) read from a file; a lazy entry is a 1-tuple, and an mtime of
            # None marks lines registered by their owner, which no file holds
            if isinstance(entry, tuple) and len(entry) == 4 and entry[1] is not None:
                linecache.cache.pop(name, None)
