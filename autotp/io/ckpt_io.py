"""Atomic, resumable training checkpoints on top of torch.distributed.checkpoint (DCP).

Layout under a run folder ``DIR``::

    DIR/checkpoints/step-000006/      one complete DCP checkpoint per kept step
    DIR/checkpoints/.tmp-step-000009/ a save in progress (removed or replaced by the next save)
    DIR/checkpoints/latest            the name of the newest complete step folder (replaced atomically)
    DIR/checkpoint -> checkpoints/step-000006   a convenience symlink to the same folder

A save writes into the temporary folder on every rank; after a barrier (so every rank finished writing and
DCP's coordinator wrote ``.metadata``) rank 0 renames it into place, then points ``latest`` at it with
``os.replace``. A crash at any moment leaves ``latest`` naming a complete checkpoint: the previous one until
the rename of the pointer, the new one after. Nothing complete is deleted unless asked: ``keep=N`` removes
this run's own checkpoints beyond its newest N (the manifest names the run that wrote each), never another
run's. Resuming reads ``latest`` strictly (:func:`resume_target`): a pointer that is missing beside step
folders, dangling, or names anything but a complete checkpoint is an error listing the complete ones, never
a silent start from step 0.

What a training checkpoint holds (one DCP save, every entry a tensor), all in the unsharded model's
coordinates, so it resumes at any tp and dp the model's sizes allow (weights and optimizer state resharded):

* ``model``: the model's state dict, sharded parameters as DTensor views (:func:`autotp.io.checkpoint.sharded_state_dict`);
* ``optim``: the optimizer's per-parameter tensors laid out like their parameters (:mod:`autotp.io.optim_state`);
* ``train``: the step counter;
* ``rng``: the default generator's state per data-parallel replica (the ranks of a TP group keep it in step),
  and each rank's sharded-region stream, and with cp its chunk's stream (:mod:`autotp.operators.rng`), restored
  where the layout allows.

Next to the DCP files rank 0 writes the manifest ``autotp.json``: format, step, tp, dp, world size, the
optimizer's plain data (class, hyper-parameters) and each file's CRC-32, taken while it was written and checked
before a load reads any value (:mod:`autotp.io.ckpt_digest`). Loading unpickles nothing from the files as arbitrary
objects: JSON for the manifest, a verified, restricted read of DCP's metadata and ``weights_only`` tensors
for the rest (:mod:`autotp.io.ckpt_safety`). A launcher checks a checkpoint before any rank starts
(:func:`check_resumable`).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from autotp.io.checkpoint import WriteBack, sharded_state_dict
from autotp.io.ckpt_digest import SELF, DigestingWriter, checked_digests, digest_mismatch, manifest_digest, verify_share
from autotp.io.ckpt_safety import cause, read_metadata, safe_load, verify_files
from autotp.io.empty import mark_loaded
from autotp.errors import CheckpointError
from autotp.distributed.launch import RankContext
from autotp.io.optim_state import merge_plain_data, optimizer_state, plain_data, restore
from autotp.state import tp_state

__all__ = ["CheckpointError", "Resumed", "checkpoint_info", "check_resumable", "complete_checkpoints",
           "latest_checkpoint", "load_training_state", "read_manifest", "resume_target", "save_training_state",
           "step_dir_name"]

CHECKPOINTS, LATEST, LINK, TMP_PREFIX, INFO = "checkpoints", "latest", "checkpoint", ".tmp-", "autotp.json"
_SHARD = re.compile(r"__(\d+)_\d+\.distcp")  # DCP's file of rank r
_MANIFEST_KEYS = {"format", "step", "tp", "dp", "pp", "world_size", "optimizer", "run", "files", "cp", SELF}
FORMAT = 2  # 1: optimizer state and RNG as pickled blobs, per tp rank (never loaded: unpickling runs code)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def latest_checkpoint(run_dir: Path | str) -> Path | None:
    """The checkpoint ``latest`` names under ``run_dir`` when it is there (None otherwise); resuming reads the
    pointer strictly instead (:func:`resume_target`)."""
    root = Path(run_dir) / CHECKPOINTS
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    path = root / name
    return path if name and (path / ".metadata").is_file() else None


def complete_checkpoints(run_dir: Path | str) -> list[Path]:
    """The complete checkpoints under ``run_dir``: step folders holding DCP's ``.metadata`` and autotp's
    manifest, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.name.startswith("step-") and p.is_dir() and not p.is_symlink()
                   and (p / ".metadata").is_file() and (p / INFO).is_file()), key=lambda p: p.name)


def resume_target(run_dir: Path | str, choice: str | None = None) -> Path | None:
    """The checkpoint a resume of ``run_dir`` loads: ``choice`` (a step folder's name under ``checkpoints/``,
    or a path) or the one ``latest`` names; None when the run folder holds no checkpoint at all (a fresh
    start). A missing, unreadable or dangling ``latest`` beside step folders, a pointer outside
    ``checkpoints/``, or a chosen folder that is not complete: CheckpointError naming the folder and the
    complete checkpoints in it, so a damaged pointer never turns a resume into a fresh run."""
    root = Path(run_dir) / CHECKPOINTS
    complete = complete_checkpoints(run_dir)
    names = ", ".join(p.name for p in complete) or "none"
    hint = (f"pick one with --resume-from NAME ({names})" if complete else
            f"nothing in {root} can be resumed: start afresh with another --out")
    if choice is not None:
        path = Path(choice) if os.sep in choice else root / choice
        if not path.exists():
            raise CheckpointError(f"checkpoint {path} does not exist (complete ones in {root}: {names})",
                                  hint=hint)
        if not ((path / ".metadata").is_file() and (path / INFO).is_file()):
            raise CheckpointError(f"{path} is not a complete checkpoint (complete ones in {root}: {names})",
                                  hint=hint)
        return path
    pointer = root / LATEST
    try:
        name = pointer.read_text().strip()
    except FileNotFoundError:
        name = None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{pointer} cannot be read ({exc}); complete checkpoints in {root}: {names}",
                              hint=hint) from None
    if name is None:
        steps = sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) if root.is_dir() else []
        if not steps:
            return None
        raise CheckpointError(f"{root} has no `latest` pointer but holds {', '.join(steps)} "
                              f"(complete: {names})", hint=hint)
    target = root / name
    if not name or os.sep in name or name in (".", "..") or target not in complete:
        raise CheckpointError(f"{pointer} names {name!r}, which is not a complete checkpoint in {root} "
                              f"(complete: {names})", hint=hint)
    return target


def checkpoint_info(path: Path | str) -> dict:
    """The manifest :func:`save_training_state` wrote next to the DCP files, unchecked ({} if none)."""
    try:
        return json.loads((Path(path) / INFO).read_text())
    except (OSError, ValueError):
        return {}


def read_manifest(path: Path | str) -> dict:
    """The checkpoint's manifest, checked to be one this autotp writes; CheckpointError naming it if not."""
    file = Path(path) / INFO
    try:
        info = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: {path} was not written by autotp shard") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file} is not a checkpoint manifest: {exc}",
                              hint="the file is damaged or was tampered with: resume from another checkpoint") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        found = info.get("format") if isinstance(info, dict) else None
        raise CheckpointError(f"{file}: checkpoint format {found!r}, this autotp reads format {FORMAT}",
                              hint="a checkpoint of an older autotp keeps its optimizer state pickled, which is "
                                   "never loaded: start afresh in another run folder")
    tampered = "the file is damaged or was tampered with: resume from another checkpoint"
    if unknown := sorted(set(info) - _MANIFEST_KEYS):  # a flipped byte in a key's name lands here
        raise CheckpointError(f"{file} has entries no autotp writes: {', '.join(map(repr, unknown))}", hint=tampered)
    if SELF in info and info[SELF] != manifest_digest(info):
        raise CheckpointError(f"{file} does not match its own checksum: it changed after the save", hint=tampered)
    for key in ("step", "tp", "dp"):
        if isinstance(info.get(key), bool) or not isinstance(info.get(key), int) or info[key] < 0:
            raise CheckpointError(f"{file}: {key} is {info.get(key)!r}, not a count", hint=tampered)
    opt = info.get("optimizer")
    if opt is not None and not (isinstance(opt, dict) and isinstance(opt.get("class"), str)
                                and isinstance(opt.get("param_groups"), list)):
        raise CheckpointError(f"{file}: its optimizer entry is {type(opt).__name__} {str(opt)[:80]!r}, not an "
                              "optimizer's class and parameter groups", hint=tampered)
    layout = (info["tp"], info["dp"], info.get("pp", 1), info.get("cp", 1))
    world = info.get("world_size", math.prod(layout))
    ranks = {int(m.group(1)) for name in os.listdir(path) if (m := _SHARD.fullmatch(name))}
    if math.prod(layout) != world or not ranks or max(ranks) >= world:
        cp = f" × cp {layout[3]}" if layout[3] > 1 else ""
        raise CheckpointError(f"{file} says tp {layout[0]}{cp} × dp {layout[1]} × pp {layout[2]} on {world} ranks, "
                              f"but the folder holds the files of ranks {sorted(ranks)}", hint=tampered)
    return info


def check_resumable(run_dir: Path | str, choice: str | None = None) -> Path | None:
    """The checkpoint a resume of ``run_dir`` would load (:func:`resume_target`; None when there is none),
    after checking its manifest and metadata without unpickling anything (CheckpointError naming the file
    if they are bad). Any tp and dp may resume it; whether the model's sizes allow them is the planner's."""
    found = resume_target(run_dir, choice)
    if found is not None:
        info = read_manifest(found)
        if "files" in info and ".metadata" in (files := checked_digests(found, info["files"])):
            if (bad := digest_mismatch(found, ".metadata", files[".metadata"])) is not None:
                raise CheckpointError(f"checkpoint {found} is damaged: {bad}",
                                      hint="resume from another checkpoint (--resume-from)")
        verify_files(found, read_metadata(found))
    return found


@dataclass(frozen=True)
class Resumed:
    """What :func:`load_training_state` loaded: the checkpoint, its step, and the layout that saved it."""

    path: Path
    step: int
    saved_tp: int
    saved_dp: int
    tp: int
    dp: int
    optimizer: bool = True  # the optimizer's state was loaded too
    saved_pp: int = 1
    pp: int = 1

    @property
    def resharded(self) -> bool:
        return (self.saved_tp, self.saved_dp, self.saved_pp) != (self.tp, self.dp, self.pp)

    def describe(self) -> str:
        """One line for the run summary: which layout the state came from, and what was resharded."""
        what = "weights and optimizer state" if self.optimizer else "weights"
        if self.saved_pp != self.pp:
            saved = f"tp {self.saved_tp} × dp {self.saved_dp} × pp {self.saved_pp}"
            return f"resumed from {saved} → tp {self.tp} × dp {self.dp} × pp {self.pp}: {what} resharded"
        if not self.resharded:
            return f"tp {self.tp} × dp {self.dp}, as saved: nothing resharded"
        if self.saved_dp == self.dp:
            return f"resumed from tp {self.saved_tp} → tp {self.tp}: {what} resharded"
        if self.saved_tp == self.tp:
            return f"resumed from dp {self.saved_dp} → dp {self.dp} at tp {self.tp}: {what} in every replica"
        saved, now = f"tp {self.saved_tp} × dp {self.saved_dp}", f"tp {self.tp} × dp {self.dp}"
        return f"resumed from {saved} → {now}: {what} resharded"


_NEARLY_FULL = 1 << 20  # bytes free below which a failed write is taken for a full disk


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


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


def _publish(root: Path, tmp: Path, step: int, run: str | None = None, keep: int | None = None) -> Path:
    """Rank 0: move the finished ``tmp`` into place and point ``latest`` (and the symlink) at it; with
    ``keep``, remove run ``run``'s checkpoints beyond its newest ``keep``; leftover temporary folders of
    crashed saves go."""
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
        if link.exists() and not link.is_symlink():
            raise FileExistsError(link)  # a checkpoint folder of the older layout, or the user's: left as it is
        tmp_link = root.parent / f".{LINK}.tmp"
        if tmp_link.is_symlink() or tmp_link.exists():
            tmp_link.unlink()
        os.symlink(Path(CHECKPOINTS) / name, tmp_link, target_is_directory=True)
        os.replace(tmp_link, link)
    except OSError:
        pass  # the link is a convenience; `latest` is what resuming reads
    for old in root.iterdir():
        if old.is_dir() and old.name.startswith(TMP_PREFIX):
            shutil.rmtree(old, ignore_errors=True)  # a save that crashed: never a complete checkpoint
    if keep is not None and run is not None:
        mine = [p for p in complete_checkpoints(root.parent) if checkpoint_info(p).get("run") == run]
        for old in mine[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def _replica(ctx: RankContext) -> str:
    """The generators' key prefix: the dp replica, and with pipeline stages the pipeline rank (each stage draws
    its own stream)."""
    return f"pp{ctx.coords['pp']}.dp{ctx.coords['dp']}" if ctx.grid.pp > 1 else f"dp{ctx.coords['dp']}"


def _rng_state(tpm: torch.nn.Module, ctx: RankContext) -> dict[str, torch.Tensor]:
    """This rank's generators as tensors: the default ones (CPU, and the rank's GPU) under its dp replica (and
    pipeline rank), the sharded-region stream under its (dp, cp, tp) coordinates and the context stream under
    its (dp, cp) ones."""
    d, t = _replica(ctx), ctx.coords["tp"]
    c = f".cp{ctx.coords['cp']}" if "cp" in ctx.coords else ""
    out = {f"{d}.cpu": torch.get_rng_state()}
    if ctx.device.type == "cuda":
        out[f"{d}.cuda"] = torch.cuda.get_rng_state(ctx.device)
    st = tp_state(tpm)
    if st.rng is not None:
        out[f"{d}{c}.tp{t}.region"] = st.rng.get_state()
    if st.context_rng is not None:
        out[f"{d}{c}.context.region"] = st.context_rng.get_state()
    return out


def _set_rng_state(tpm: torch.nn.Module, ctx: RankContext, loaded: dict[str, torch.Tensor]) -> None:
    d, t = _replica(ctx), ctx.coords["tp"]
    c = f".cp{ctx.coords['cp']}" if "cp" in ctx.coords else ""
    if f"{d}.cpu" in loaded:
        torch.set_rng_state(loaded[f"{d}.cpu"])
    if f"{d}.cuda" in loaded:
        torch.cuda.set_rng_state(loaded[f"{d}.cuda"], ctx.device)
    st = tp_state(tpm)
    if f"{d}{c}.tp{t}.region" in loaded:
        st.rng.set_state(loaded[f"{d}{c}.tp{t}.region"])
    if f"{d}{c}.context.region" in loaded:
        st.context_rng.set_state(loaded[f"{d}{c}.context.region"])


def save_training_state(run_dir: Path | str, step: int, tpm: torch.nn.Module,
                        optimizer: torch.optim.Optimizer | None, ctx: RankContext, *, run: str | None = None,
                        keep: int | None = None) -> Path:
    """Save ``tpm`` (parallelized), ``optimizer`` and the RNG atomically (see the module doc); collective over
    the whole job. Returns the published checkpoint folder (on every rank). ``run``: an id of the training
    run, kept in the manifest; ``keep``: how many of that run's checkpoints to keep (default: all)."""
    if keep is not None and (run is None or keep < 1):
        raise ValueError(f"keep={keep!r} needs run= (whose checkpoints to thin) and keep >= 1")
    root = Path(run_dir) / CHECKPOINTS
    rank = dist.get_rank()
    tmp = root / f"{TMP_PREFIX}{step_dir_name(step)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a save that crashed
    dist.barrier()
    state: dict = {"model": sharded_state_dict(tpm, ctx), "train": {"step": torch.tensor(step, dtype=torch.int64)},
                   "rng": _rng_state(tpm, ctx)}
    info = {"format": FORMAT, "step": step, "tp": ctx.grid.tp, "dp": ctx.grid.dp, "pp": ctx.grid.pp,
            "world_size": ctx.grid.world_size, "optimizer": None, "run": run}
    if ctx.grid.cp > 1:  # context-parallel ranks hold the same parameters: a layout like dp's
        info["cp"] = ctx.grid.cp
    if optimizer is not None:
        ostate = optimizer_state(tpm, optimizer, ctx)
        state["optim"] = {"state": ostate.tensors}
        info["optimizer"] = plain_data(ostate)
        if ctx.grid.pp > 1:  # each stage's optimizer holds its own parameters: the manifest names them all
            parts: list = [None] * dist.get_world_size(ctx.pp_group())
            dist.all_gather_object(parts, info["optimizer"], group=ctx.pp_group())
            info["optimizer"] = merge_plain_data(parts)
    try:
        writer = DigestingWriter(tmp)  # each file's CRC-32, taken as it is written
        dcp.save(state, storage_writer=writer)
        digests: list = [None] * dist.get_world_size()
        dist.all_gather_object(digests, writer.digests)
        if rank == 0:
            info["files"] = {name: d for part in digests for name, d in sorted(part.items())}
            info[SELF] = manifest_digest(info)
            (tmp / INFO).write_text(json.dumps(info, indent=1) + "\n")
        dist.barrier()  # every rank's files and the metadata are on disk
        final = [_publish(root, tmp, step, run, keep) if rank == 0 else None]
    except (OSError, CheckpointException) as exc:  # a full disk, a read-only folder: one line, not tracebacks
        before = latest_checkpoint(run_dir)
        why = cause(exc, tmp)
        if "(ENOSPC)" not in why and (free := _free_bytes(root)) is not None and free < _NEARLY_FULL:
            # torch's writer reports a short write on a full disk as "unexpected pos ...", not as ENOSPC
            why = f"No space left on device (ENOSPC: {free:,} bytes free; the writer said {why})"
        raise CheckpointError(f"cannot save step {step} to {tmp}: {why}",
                              hint=f"the checkpoint published before ({before.name if before else 'none'}) is "
                                   "untouched: free space or fix permissions, then --resume") from None
    dist.broadcast_object_list(final, src=0)
    return Path(final[0])


def load_training_state(path: Path | str, tpm: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                        ctx: RankContext) -> Resumed:
    """Load a :func:`save_training_state` checkpoint in place, at this job's tp and dp whatever the saving
    job's were: weights, optimizer state (resharded), RNG where the layout allows; collective.

    The manifest and DCP's metadata are read and checked on every rank before anything is loaded: a
    tampered or damaged checkpoint raises CheckpointError naming the file, and nothing in it runs.
    """
    path = Path(path)
    info = read_manifest(path)
    if "files" in info:  # every rank checks its share of the files against their checksums, before any read
        bad = verify_share(path, checked_digests(path, info["files"]), dist.get_rank(), dist.get_world_size())
        found: list = [None] * dist.get_world_size()
        dist.all_gather_object(found, bad)
        if (first := next((b for b in found if b is not None), None)) is not None:
            raise CheckpointError(f"checkpoint {path} is damaged: {first}",
                                  hint="nothing was loaded from it: resume from another checkpoint (--resume-from)")
    meta = read_metadata(path)
    copies = WriteBack()  # under FSDP: gathered TP shards, written back into FSDP's shards after the load
    state: dict = {"model": sharded_state_dict(tpm, ctx, copies),
                   "train": {"step": torch.tensor(0, dtype=torch.int64)}}
    ostate = None
    if optimizer is not None:
        if not isinstance(info.get("optimizer"), dict):
            raise CheckpointError(f"{path / INFO}: the checkpoint holds no optimizer state",
                                  hint="it was saved without an optimizer; resume without one, or start afresh")
        ostate = optimizer_state(tpm, optimizer, ctx, copies)
        state["optim"] = {"state": ostate.tensors}
    # generators the saving layout had for this rank's coordinates; the others keep their own streams
    rng = {key: value for key, value in _rng_state(tpm, ctx).items()
           if f"rng.{key}" in meta.state_dict_metadata and (".region" not in key or
                                                            (info["tp"], info["dp"], info.get("pp", 1),
                                                             info.get("cp", 1)) ==
                                                            (ctx.grid.tp, ctx.grid.dp, ctx.grid.pp,
                                                             ctx.grid.cp))}
    if rng:
        state["rng"] = rng
    safe_load(state, path, metadata=meta)
    if int(state["train"]["step"]) != info["step"]:  # the data's step (checksummed) is the one to believe
        raise CheckpointError(f"{path / INFO} says step {info['step']}, its data holds step "
                              f"{int(state['train']['step'])}", hint="the manifest is damaged or was edited: resume "
                              "from another checkpoint (--resume-from)")
    copies.apply()
    mark_loaded(tpm)
    if ostate is not None:
        restore(tpm, optimizer, ostate, info["optimizer"], str(path / INFO), stage=ctx.grid.pp > 1)
    _set_rng_state(tpm, ctx, rng)
    return Resumed(path, int(state["train"]["step"]), info["tp"], info["dp"], ctx.grid.tp, ctx.grid.dp,
                   optimizer is not None, int(info.get("pp", 1)), ctx.grid.pp)
