"""Atomic, resumable training checkpoints on top of torch.distributed.checkpoint (DCP).

Layout under a run folder ``DIR``::

    DIR/checkpoints/step-000006/      one complete DCP checkpoint per kept step
    DIR/checkpoints/.tmp-step-000009/ a save in progress (removed or replaced by the next save)
    DIR/checkpoints/latest            the name of the newest complete step folder (replaced atomically)
    DIR/checkpoint -> checkpoints/step-000006   a convenience symlink to the same folder

A save writes into the temporary folder on every rank; after a barrier (so every rank finished writing and
DCP's coordinator wrote ``.metadata``) rank 0 renames it into place, then points ``latest`` at it with
``os.replace`` and only then deletes older steps. A crash at any moment leaves ``latest`` naming a complete
checkpoint: the previous one until the rename of the pointer, the new one after.

What a training checkpoint holds (one DCP save):

* ``model``: the caller's (sharded, DTensor-valued) model state dict, reshardable by DCP;
* ``optim``: the optimizer's own ``state_dict()`` as one ``torch.save`` blob per tensor-parallel rank
  (key ``tp<r>``). TPModule parameters are plain local tensors, which
  ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` cannot place in global coordinates,
  so the optimizer state is not resharded: resuming needs the same tp size. Data-parallel replicas hold
  identical optimizer state and share the key, so DCP writes it once;
* ``train``: the step counter (a replicated tensor);
* ``rng``: each global rank's torch RNG state (``rank<r>``), restored when present.

Next to the DCP files rank 0 writes ``autotp.json`` (step, tp, world size), so a launcher can refuse a resume
with another tp before any rank starts (:func:`check_resumable`).
"""
from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from autotp.errors import CheckpointError

__all__ = ["CheckpointError", "checkpoint_info", "check_resumable", "latest_checkpoint", "load_training_state",
           "save_training_state", "step_dir_name"]

CHECKPOINTS, LATEST, LINK, TMP_PREFIX, INFO = "checkpoints", "latest", "checkpoint", ".tmp-", "autotp.json"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def latest_checkpoint(run_dir: Path | str) -> Path | None:
    """The newest complete checkpoint under ``run_dir`` (None when there is none)."""
    root = Path(run_dir) / CHECKPOINTS
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    path = root / name
    return path if name and (path / ".metadata").is_file() else None


def checkpoint_info(path: Path | str) -> dict:
    """What :func:`save_training_state` recorded next to the DCP files: step, tp, world size ({} if none)."""
    try:
        return json.loads((Path(path) / INFO).read_text())
    except (OSError, ValueError):
        return {}


def check_resumable(run_dir: Path | str, tp: int) -> Path | None:
    """The checkpoint a resume of ``run_dir`` at ``tp`` would load; CheckpointError when its tp differs."""
    found = latest_checkpoint(run_dir)
    saved_tp = checkpoint_info(found).get("tp") if found is not None else None
    if saved_tp is not None and saved_tp != tp:
        raise CheckpointError(f"checkpoint {found} was saved with --tp {saved_tp}, this job has --tp {tp}: the "
                              "optimizer state is kept per tensor-parallel rank and cannot be resharded",
                              hint=f"resume with --tp {saved_tp}, or start afresh in another --out")
    return found


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _publish(root: Path, tmp: Path, step: int) -> Path:
    """Rank 0: move the finished ``tmp`` into place and point ``latest`` (and the symlink) at it."""
    name, n = step_dir_name(step), 1
    while (root / name).exists():  # a same-numbered step of an earlier run: never touch what latest may name
        name, n = f"{step_dir_name(step)}-{n}", n + 1
    final = root / name
    os.rename(tmp, final)
    _fsync_dir(root)
    pointer = root / f"{LATEST}.tmp"
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)  # the commit point
    _fsync_dir(root)
    link = root.parent / LINK
    try:
        if link.is_dir() and not link.is_symlink():
            shutil.rmtree(link)  # a checkpoint folder of the older, non-atomic layout
        tmp_link = root.parent / f".{LINK}.tmp"
        if tmp_link.is_symlink() or tmp_link.exists():
            tmp_link.unlink()
        os.symlink(Path(CHECKPOINTS) / name, tmp_link, target_is_directory=True)
        os.replace(tmp_link, link)
    except OSError:
        pass  # the link is a convenience; `latest` is what resuming reads
    for old in root.iterdir():
        if old.is_dir() and old != final and (old.name.startswith("step-") or old.name.startswith(TMP_PREFIX)):
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_training_state(run_dir: Path | str, step: int, model_state: dict, optimizer: torch.optim.Optimizer | None,
                        tp_rank: int, group: dist.ProcessGroup | None = None, tp_size: int | None = None) -> Path:
    """Save atomically (see the module doc); collective over ``group`` (default: the whole job).

    Returns the published checkpoint folder (on every rank).
    """
    root = Path(run_dir) / CHECKPOINTS
    rank = dist.get_rank()
    tmp = root / f"{TMP_PREFIX}{step_dir_name(step)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a save that crashed
    dist.barrier(group=group)
    state: dict = {"model": model_state, "train": {"step": torch.tensor(step, dtype=torch.int64)},
                   "rng": {f"rank{rank}": _blob(torch.get_rng_state())}}
    if optimizer is not None:
        state["optim"] = {f"tp{tp_rank}": _blob(optimizer.state_dict())}
    dcp.save(state, checkpoint_id=str(tmp), process_group=group)
    if rank == 0:
        info = {"step": step, "tp": tp_size, "world_size": dist.get_world_size()}
        (tmp / INFO).write_text(json.dumps(info) + "\n")
    dist.barrier(group=group)  # every rank's files and the metadata are on disk
    final = [_publish(root, tmp, step) if rank == 0 else None]
    dist.broadcast_object_list(final, src=0, group=group)
    return Path(final[0])


def load_training_state(path: Path | str, model_state: dict, optimizer: torch.optim.Optimizer | None,
                        tp_rank: int, group: dist.ProcessGroup | None = None) -> int:
    """Load a :func:`save_training_state` checkpoint in place: model tensors, optimizer, RNG; the step."""
    rank = dist.get_rank()
    state: dict = {"model": model_state, "train": {"step": torch.tensor(0, dtype=torch.int64)},
                   "rng": {f"rank{rank}": b""}}
    if optimizer is not None:
        state["optim"] = {f"tp{tp_rank}": b""}
    try:
        # partial: the RNG of a rank that did not exist when it was saved is simply not restored
        dcp.load(state, checkpoint_id=str(path), process_group=group,
                 planner=DefaultLoadPlanner(allow_partial_load=True))
    except Exception as exc:  # noqa: BLE001 - DCP's errors name keys, not the cause a user can act on
        raise CheckpointError(f"cannot load checkpoint {path}: {type(exc).__name__}: {str(exc).splitlines()[0]}",
                              hint="resume with the same model file and --tp as the run that saved it") from exc
    if optimizer is not None:
        blob = state["optim"][f"tp{tp_rank}"]
        if not blob:
            raise CheckpointError(f"checkpoint {path} holds no optimizer state for tp rank {tp_rank}",
                                  hint="resume with the same --tp as the run that saved it")
        optimizer.load_state_dict(torch.load(io.BytesIO(blob), weights_only=False))
    rng = state["rng"][f"rank{rank}"]
    if rng:
        torch.set_rng_state(torch.load(io.BytesIO(rng), weights_only=False))
    return int(state["train"]["step"])


def _blob(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
