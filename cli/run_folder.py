"""What an ``--out`` folder holds, read by the launching process: the line an interrupted run ends with, and
the traces a run leaves before its first checkpoint (so a folder a run was interrupted in is never silently
taken for a fresh one)."""
from __future__ import annotations

import json
from pathlib import Path

from autotp.errors import LaunchInterrupted

TRACES = ("plan.json", "metrics.jsonl", "summary.json")  # what a run writes before (or without) a checkpoint


def traces(out: Path) -> list[str]:
    """The files of a run that trained or did not finish in ``out``, checkpoints aside: its metrics, or a plan
    with no summary ([] for a fresh folder, and for a finished run that trained nothing, ``--steps 0``)."""
    found = [name for name in TRACES if (out / name).is_file()]
    unfinished = "metrics.jsonl" in found or "plan.json" in found and "summary.json" not in found
    return found if unfinished else []


def interrupted_line(exc: LaunchInterrupted, out: Path, run: str | None) -> str:
    """The one line a run stopped by a signal ends with: the step it kept, and how to continue."""
    from autotp.io.ckpt_io import checkpoint_info, latest_checkpoint

    latest = latest_checkpoint(out)
    info = checkpoint_info(latest) if latest is not None else {}
    how = f"interrupted by {exc.name}" + (" twice (the ranks were killed)" if exc.forced else "")
    if latest is None:
        return f"{how} before the first checkpoint: nothing was saved in {out}"
    where = latest.relative_to(out) if latest.is_relative_to(out) else latest
    if info.get("run") != run:
        return (f"{how} before this run's first checkpoint: the newest is still {where} (step "
                f"{info.get('step', '?')}); continue with --resume")
    return f"{how} at step {info.get('step', '?')}: saved {where}; continue with --resume"


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the metrics of steps up to ``step`` (the one a resume starts from): the steps after it are
    trained again, and logged again."""
    try:
        lines = path.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short when the run was killed: its step is trained again
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


def checkpoint_step(path: Path) -> int | None:
    """The step a checkpoint's manifest records (None when it says none)."""
    from autotp.io.ckpt_io import checkpoint_info

    step = checkpoint_info(path).get("step")
    return step if isinstance(step, int) else None
