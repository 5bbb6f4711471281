"""How a command line names a model file (``path.py`` or ``path.py:factory``), read without importing torch.

The commands check that the file exists before they import torch and the capture stack (seconds), so a
mistyped path is said at once; :mod:`autotp.capture.modelfile` imports the file with the same two functions.
"""
from __future__ import annotations

import re
from pathlib import Path

from autotp.errors import ModelFileError

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_spec(spec: str | Path) -> tuple[Path, str | None]:
    """``"model.py:factory"`` -> (path, "factory"); a bare path -> (path, None)."""
    text = str(spec)
    head, sep, tail = text.rpartition(":")
    # only an identifier after the colon names a factory; "C:\\models\\m.py" is a path
    if sep and head and _IDENTIFIER.fullmatch(tail):
        return Path(head), tail
    return Path(text), None


def model_path(spec: str | Path) -> tuple[Path, str | None]:
    """:func:`parse_spec`, with a ModelFileError when the path is not a file."""
    path, factory = parse_spec(spec)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ModelFileError(f"model file {path} {what}", hint="pass the path of a .py file that defines build_model()")
    return path, factory
