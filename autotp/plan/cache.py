"""An on-disk cache of plans, so that a restarted job or a second ``autotp plan`` skips capture and analysis.

A plan depends on the graph, and the graph on what the forward computes for these inputs. The key is a
hash of exactly that: the ops the forward runs on meta (:func:`autotp.capture.repeats.program`: every op,
parameters by name, other tensors by shape and dtype, Python values as themselves: a change to any code
the forward runs, a helper in another file included, changes it), every parameter's and buffer's name,
shape and dtype, the planning options (tp, vocab multiple, sequence and expert parallelism, stages), and
the versions of torch and of autotp's own sources (a digest of them, so an edited checkout misses too).

An entry is JSON (never unpickled): the plan, what else the caller stored with it, and a SHA-256 digest of
both; an entry whose digest does not match is refused with :class:`~autotp.errors.PlanCacheError`
naming the file. Entries are written to a temporary file and renamed, so a crash leaves none half-written.
The folder is ``$AUTOTP_CACHE_DIR``, else ``$XDG_CACHE_HOME/autotp/plans``, else ``~/.cache/autotp/plans``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from autotp.capture.meta_run import Recorder
from autotp.capture.repeats import program
from autotp.errors import PlanCacheError
from autotp.plan.plan import PLAN_VERSION, Plan

CACHE_VERSION = 1


@dataclass(frozen=True)
class Cached:
    plan: Plan
    extra: dict  # what the caller stored with the plan (sizes, names)
    path: Path


def cache_dir() -> Path:
    if os.environ.get("AUTOTP_CACHE_DIR"):
        return Path(os.environ["AUTOTP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "autotp" / "plans"


def _sources_digest() -> str:
    """autotp's own code, every .py file of the package (the passes and the CLI are inside it)."""
    roots = [Path(__file__).resolve().parents[1]]  # autotp/
    for sub in ("autotp.passes", "autotp.cli"):
        spec = importlib.util.find_spec(sub)
        if spec is not None and spec.submodule_search_locations:
            roots += [Path(p) for p in spec.submodule_search_locations]
    h = hashlib.sha256()
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def plan_key(model: nn.Module, run: Callable[[], object], options: dict, rec: Recorder | None = None) -> str | None:
    """The cache key of planning ``model`` for the call ``run`` makes (on meta inputs) with ``options``;
    None where the forward cannot run on meta (then nothing is cached). ``rec``: that call's meta run, made
    already (:func:`~autotp.capture.repeats.record_whole`)."""
    ops = program(model, run, rec)
    if ops is None:
        return None
    state = [(n, tuple(t.shape), str(t.dtype), t.requires_grad)
             for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]]
    material = json.dumps({"cache": CACHE_VERSION, "plan": PLAN_VERSION, "torch": torch.__version__,
                           "autotp": _sources_digest(), "state": state, "options": options,
                           "ops": hashlib.sha256(ops.encode()).hexdigest()}, sort_keys=True, default=str)
    return hashlib.sha256(material.encode()).hexdigest()


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def load(key: str, folder: Path | None = None) -> Cached | None:
    """The entry for ``key``, None when there is none; PlanCacheError when the file is not what was written."""
    path = (folder or cache_dir()) / f"{key}.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        body, digest = data["body"], data["digest"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PlanCacheError(f"plan cache file {path} is unreadable ({exc})",
                             hint="delete it (or the folder); the plan is made again") from None
    if _digest(body) != digest or body.get("key") != key:
        raise PlanCacheError(f"plan cache file {path} was changed after autotp wrote it (its digest does not "
                             "match its contents)", hint="delete it (or the folder); the plan is made again")
    try:
        plan = Plan.from_dict(body["plan"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanCacheError(f"plan cache file {path} holds no plan autotp can read ({exc})",
                             hint="delete it; the plan is made again") from None
    return Cached(plan, dict(body.get("extra", {})), path)


def store(key: str, plan: Plan, extra: dict | None = None, folder: Path | None = None) -> Path:
    folder = folder or cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    body = {"key": key, "plan": plan.to_dict(), "extra": extra or {}}
    path = folder / f"{key}.json"
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"body": body, "digest": _digest(body)}, f)
    os.replace(tmp, path)
    return path
