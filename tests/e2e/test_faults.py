"""Fault injection on ``autotp shard``'s checkpoints: kill a rank, the launcher, or rank 0/1 at each point of a
save; corrupt one byte of each kind of file; break the pointer; fill the disk; make the output read-only.

For each fault: the exit code, the one line that says what happened, and the proof that nothing was lost:
every checkpoint that was complete before the fault is still there, ``latest`` names a complete one, and each
loads bit-identically to the same step of an uninterrupted run.

The faults come from a model file (:data:`FAULTY`) that wraps nanoGPT and, in the first attempt only, kills a
rank with SIGKILL where ``FAULT=KIND@STEP`` says, by wrapping the functions a save goes through.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autotp.io.ckpt_io import complete_checkpoints, latest_checkpoint
from test_reliability import EXAMPLES, NANOGPT, _params, _shard

pytestmark = pytest.mark.slow

STEPS = ("--steps", "3", "--save-every", "1", "--no-verify")

FAULTY = f"""
import os, signal, subprocess, sys
sys.path.insert(0, {EXAMPLES!r})
from nanogpt import build_model, example_batch

FAULT = os.environ.get("FAULT", "")
if FAULT and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and "RANK" in os.environ:
    import torch.distributed as dist
    import autotp.cli.shard_worker as worker
    import autotp.io.ckpt_io as ckpt_io
    from autotp.io.ckpt_digest import DigestingWriter

    kind, _, at = FAULT.partition("@")
    at, saving, fsyncs = int(at), [None], [0]

    def die(rank):
        if dist.get_rank() == rank:
            os.kill(os.getpid(), signal.SIGKILL)

    note = worker.note_progress

    def launcher():  # the `autotp` process: a rank's parent, or its fork server's (warm ranks)
        pid = os.getppid()
        while "multiprocessing.forkserver" in open(f"/proc/{{pid}}/cmdline").read():
            pid = int(open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[1])
        return pid

    def noting(step, where):  # the worker says where it is: before each step, before each save
        note(step, where)
        saving[0] = step if where.startswith("while saving") else None
        if step != at or saving[0] is not None:
            return
        if kind == "rank":
            die(1)
        elif kind == "launcher" and dist.get_rank() == 0:
            os.kill(launcher(), signal.SIGKILL)
        elif kind == "readonly" and dist.get_rank() == 0:
            subprocess.run(["mount", "-o", "remount,ro", os.environ["FAULT_MOUNT"]], check=True)

    worker.note_progress = noting
    write = DigestingWriter.write_data

    def writing(self, plan, planner):  # rank 1's data files written, DCP's metadata not yet
        fut = write(self, plan, planner)
        fut.wait()
        if kind == "write" and saving[0] == at:
            die(1)
        return fut

    DigestingWriter.write_data = writing
    save = ckpt_io.dcp.save

    def saving_dcp(*args, **kwargs):  # every file and DCP's metadata written, the manifest not yet
        out = save(*args, **kwargs)
        if kind == "metadata" and saving[0] == at:
            die(0)
        return out

    ckpt_io.dcp.save = saving_dcp
    publish = ckpt_io._publish

    def publishing(*args, **kwargs):  # the manifest written, the folder not yet renamed into place
        if kind == "publish" and saving[0] == at:
            die(0)
        fsyncs[0] = 0
        return publish(*args, **kwargs)

    ckpt_io._publish = publishing
    fsync = ckpt_io._fsync_dir

    def fsyncing(path):  # 1: after the rename into place, 2: after `latest` was replaced
        fsync(path)
        fsyncs[0] += 1
        if saving[0] == at and (kind, fsyncs[0]) in (("rename", 1), ("pointer", 2)):
            die(0)

    ckpt_io._fsync_dir = fsyncing
"""


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict:
    """An uninterrupted run (steps 1-3, a checkpoint after each), the faulty model file, and each checkpoint's
    parameters."""
    tmp = tmp_path_factory.mktemp("faults")
    faulty = tmp / "faulty.py"
    faulty.write_text(FAULTY)
    out = tmp / "ref"
    code, text = _shard(faulty, out, *STEPS)
    assert code == 0, text
    params = {p.name: _params(out, p) for p in complete_checkpoints(out)}
    assert sorted(params) == ["step-000001", "step-000002", "step-000003"]
    return {"tmp": tmp, "faulty": faulty, "out": out, "params": params}


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def _nothing_lost(ref: dict, out: Path, complete: list[str], latest: str) -> None:
    """The complete checkpoints are these, `latest` names ``latest``, and each loads bit-identically to the
    uninterrupted run's."""
    assert [p.name for p in complete_checkpoints(out)] == complete
    assert latest_checkpoint(out).name == latest
    for name in complete:
        got, want = _params(out, out / "checkpoints" / name), ref["params"][name]
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), f"{name} differs from the uninterrupted run's"


# (fault, the rank that dies, where it was, complete checkpoints after, what `latest` names)
KILLS = {
    "rank": (1, "at step 2", ["step-000001"], "step-000001"),
    "write": (1, "while saving step 2", ["step-000001"], "step-000001"),
    "metadata": (0, "while saving step 2", ["step-000001"], "step-000001"),
    "publish": (0, "while saving step 2", ["step-000001"], "step-000001"),
    "rename": (0, "while saving step 2", ["step-000001", "step-000002"], "step-000001"),
    "pointer": (0, "while saving step 2", ["step-000001", "step-000002"], "step-000002"),
}


# by default a rank's death before a save (then resumed to the bit); one after the rename (the checkpoint it
# finished is kept), during the writes, after the pointer, while rank 0 writes the metadata or publishes: in the
# extended run (each is a launch of its own)
CORE_KILLS = ("rank",)


@pytest.mark.parametrize("fault", [k if k in CORE_KILLS else pytest.param(k, marks=pytest.mark.extended)
                                   for k in KILLS])
def test_a_rank_killed_loses_nothing(ref, fault: str) -> None:
    rank, where, complete, latest = KILLS[fault]
    out = ref["tmp"] / f"kill-{fault}"
    code, text = _shard(ref["faulty"], out, *STEPS, env={"FAULT": f"{fault}@2"})
    assert code == 1, text
    assert re.fullmatch(rf"error: rank {rank} \(pid \d+\) was killed by SIGKILL {where}", _last_line(text)), text
    assert "Traceback" not in text
    _nothing_lost(ref, out, complete, latest)
    if fault in ("rank", "rename"):  # resumed, the run ends where the uninterrupted one did, to the bit
        code, text = _shard(NANOGPT, out, *STEPS, "--resume")
        assert code == 0, text
        final = latest_checkpoint(out)
        got, want = _params(out, final), ref["params"]["step-000003"]
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert {p.name for p in complete_checkpoints(out)} >= set(complete)  # the resume removed nothing


@pytest.mark.extended
def test_the_launcher_killed_loses_nothing(ref) -> None:
    """The launcher dies (SIGKILL): its ranks go with it (children of its fork server, which ends with it),
    and the checkpoint published before stays the latest."""
    out = ref["tmp"] / "kill-launcher"
    code, text = _shard(ref["faulty"], out, *STEPS, env={"FAULT": "launcher@2"})
    assert code == -signal.SIGKILL, text
    _nothing_lost(ref, out, ["step-000001"], "step-000001")


@pytest.mark.extended  # a third launch of this module: the killed rank above is the default run's
def test_a_restart_is_said(ref) -> None:
    """--max-restarts 1: which rank died, its pid, how, where; which restart; from where; what is redone."""
    out = ref["tmp"] / "restart"
    code, text = _shard(ref["faulty"], out, *STEPS, "--max-restarts", "1", env={"FAULT": "write@3"})
    assert code == 0, text
    line = r"rank 1 \(pid \d+\) was killed by SIGKILL while saving step 3; restart 1 of 1"
    assert re.search(rf"restart: {line}\n", text), text  # said when it happened
    summary = __import__("json").loads((out / "summary.json").read_text())
    assert re.fullmatch(rf"{line} from step 2 \(1 step redone\)", summary["restarted"]), summary
    _nothing_lost(ref, out, ["step-000001", "step-000002", "step-000003"], "step-000003")
    assert not list((out / "checkpoints").glob(".tmp-*")), "the dead attempt's unfinished save is cleaned up"


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


# file flipped in step 3 (or the pointer), exit code, what the one line says
CORRUPT = {
    "__0_0.distcp": (1, r"error: rank \d: checkpoint \S+step-000003 is damaged: \S+__0_0\.distcp does not match its "
                        r"checksum"),
    "__1_0.distcp": (1, r"error: rank \d: checkpoint \S+step-000003 is damaged: \S+__1_0\.distcp does not match its "
                        r"checksum"),
    ".metadata": (2, r"error: checkpoint \S+step-000003 is damaged: \S+\.metadata does not match its checksum"),
    "autotp.json": (2, r"error: \S+step-000003/autotp\.json (does not match its own checksum|is not a checkpoint "
                       r"manifest)"),
    "latest": (2, r"error: \S+/latest names 'step-0000\d\d', which is not a complete checkpoint"),
}


# by default the metadata's refusal (before any rank starts); a shard's (then resumed from an older step), the
# pointer's, the other shard's and the manifest's in the extended run
CORE_CORRUPT = (".metadata",)


@pytest.mark.parametrize("kind", [k if k in CORE_CORRUPT else pytest.param(k, marks=pytest.mark.extended)
                                  for k in CORRUPT])
def test_one_flipped_byte_is_refused_by_name(ref, kind: str) -> None:
    code, says = CORRUPT[kind]
    out = ref["tmp"] / f"flip-{kind}"
    shutil.copytree(ref["out"], out, symlinks=True)
    target = out / "checkpoints" / ("latest" if kind == "latest" else f"step-000003/{kind}")
    if kind == "latest":  # "step-000003": the middle byte is a digit; flipped, it names no checkpoint
        target.write_text("step-000013\n")
    else:
        _flip(target)
    code_, text = _shard(NANOGPT, out, "--steps", "4", "--no-verify", "--resume")
    assert code_ == code, text
    assert re.match(says, _last_line(text)), text
    assert "Traceback" not in text
    assert [p.name for p in complete_checkpoints(out)] == ["step-000001", "step-000002", "step-000003"]
    for name in ("step-000001", "step-000002"):
        got, want = _params(out, out / "checkpoints" / name), ref["params"][name]
        assert all(torch.equal(got[k], want[k]) for k in want)
    if kind == "__1_0.distcp":  # the user picks an older one, and the run ends as the uninterrupted one did
        code_, text = _shard(NANOGPT, out, *STEPS, "--resume-from", "step-000002")
        assert code_ == 0, text
        got, want = _params(out, latest_checkpoint(out)), ref["params"]["step-000003"]
        assert all(torch.equal(got[k], want[k]) for k in want)


def _in_small_tmpfs(ref: dict, name: str, megabytes: float, script: str) -> subprocess.CompletedProcess:
    """Run ``script`` (sh) with $MNT a fresh tmpfs of ``megabytes`` in a private mount namespace (root can
    make one), then copy what it left to ref's folder; skip where no namespace can be made."""
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode().strip()}")
    mnt, keep = ref["tmp"] / f"{name}-mnt", ref["tmp"] / name
    mnt.mkdir()
    cmd = (f"mount -t tmpfs -o size={int(megabytes * 1024)}k tmpfs {mnt} && MNT={mnt}; export MNT; "
           f"( {script} ); rc=$?; mount -o remount,rw {mnt} 2>/dev/null; cp -a {mnt} {keep}; exit $rc")
    env = {**os.environ, "COLUMNS": "200", "FAULT_MOUNT": str(mnt)}
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", cmd], text=True, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)


def _shard_cmd(model: Path | str, *args: str) -> str:
    return " ".join([sys.executable, "-m", "autotp.cli", "shard", str(model), "--tp", "2", "--out", "$MNT/run",
                     *args])


def test_a_full_disk_is_one_line_and_loses_nothing(ref) -> None:
    """3 MB: the first checkpoint (1.9 MB) fits, the second does not."""
    proc = _in_small_tmpfs(ref, "full-disk", 3, _shard_cmd(NANOGPT, *STEPS))
    text = proc.stdout
    assert proc.returncode == 1, text
    assert re.match(r"error: rank \d: cannot save step 2 to \S+: No space left on device \(ENOSPC",
                    _last_line(text)), text
    assert "Traceback" not in text
    _nothing_lost(ref, ref["tmp"] / "full-disk" / "run", ["step-000001"], "step-000001")


@pytest.mark.extended
def test_a_read_only_output_is_one_line_and_loses_nothing(ref) -> None:
    """The output turns read-only during step 2 (its save fails); a resume into it is refused before any
    rank starts."""
    script = (_shard_cmd(ref["faulty"], *STEPS) + "; echo \"rc=$?\"; " +
              _shard_cmd(NANOGPT, *STEPS, "--resume"))
    proc = _in_small_tmpfs(ref, "read-only", 16, f"FAULT=readonly@2 {script}")
    text = proc.stdout
    first, second = text.split("rc=1\n") if "rc=1\n" in text else (text, "")
    assert re.fullmatch(r"error: rank \d: cannot save step 2 to \S+: Read-only file system \(EROFS\) hint: .*",
                        _last_line(first)), text
    assert proc.returncode == 2, text
    assert re.match(r"error: --out \S+ cannot be written: Read-only file system \(EROFS\)", _last_line(second)), text
    assert "Traceback" not in text
    _nothing_lost(ref, ref["tmp"] / "read-only" / "run", ["step-000001"], "step-000001")
