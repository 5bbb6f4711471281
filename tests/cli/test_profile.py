"""``autotp profile``: the collective fit, the profile file it writes, and one run on 2 CPU ranks."""
from __future__ import annotations

import json
import math
import os

import pytest
from typer.testing import CliRunner

from autotp.cli.main import app
from autotp.cli.profile import model_shapes
from autotp.search.profile import MAX_BANDWIDTH, ProfileJob, fit_link, message_sizes, wire_bytes
from autotp.search.hardware import PROFILE_VERSION, Hardware, Link, Measured, load, save
from ranks import ROOT

runner = CliRunner()
NANOGPT = os.path.join(ROOT, "examples", "nanogpt.py")
SIZES = message_sizes("cpu")


def _exact(kind: str, ranks: int, link: Link) -> list[tuple[int, float]]:
    return [(s, link.latency + wire_bytes(kind, s, ranks) / link.bandwidth) for s in SIZES]


@pytest.mark.parametrize("kind,ranks", [("all_reduce", 2), ("all_reduce", 4), ("all_gather", 4),
                                        ("reduce_scatter", 8), ("send", 2)])
def test_fit_recovers_latency_and_bandwidth(kind: str, ranks: int) -> None:
    truth = Link(latency=35e-6, bandwidth=12e9)
    fitted = fit_link(kind, ranks, _exact(kind, ranks, truth))
    assert fitted.latency == pytest.approx(truth.latency, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6)


def test_fit_uses_the_planners_wire_convention() -> None:
    """Hardware.collective with the fitted link gives back the times the fit was made from."""
    points = _exact("all_gather", 4, Link(20e-6, 3e9))
    hw = Hardware("t", 1.0, 1.0, 1.0, 1, 4, Link(1.0, 1.0), Link(1.0, 1.0),
                  measured=(Measured("all_gather", 4, fit_link("all_gather", 4, points), tuple(points)),))
    for nbytes, seconds in points:
        assert hw.collective("all_gather", nbytes, 4) == pytest.approx(seconds, rel=1e-6)


def test_fit_with_noise_is_close() -> None:
    truth = Link(100e-6, 2e9)
    noise = [1.04, 0.97, 1.02, 0.99, 1.03, 0.98, 1.01]
    points = [(b, s * f) for (b, s), f in zip(_exact("all_reduce", 2, truth), noise)]
    fitted = fit_link("all_reduce", 2, points)
    assert fitted.latency == pytest.approx(truth.latency, rel=0.1)
    assert fitted.bandwidth == pytest.approx(truth.bandwidth, rel=0.1)


def test_fit_clamps_latency_and_bandwidth() -> None:
    # times proportional to size but a little lower at the small end: the free fit's latency is negative
    points = [(b, b / 1e9 * (0.9 if b == SIZES[0] else 1.0)) for b in SIZES]
    fitted = fit_link("send", 2, points)
    assert fitted.latency == 0.0 and fitted.bandwidth == pytest.approx(1e9, rel=0.05)
    # times that fall with size (noise): no negative bandwidth, the flat fit bounded by MAX_BANDWIDTH
    points = [(b, 1e-3 - i * 1e-5) for i, b in enumerate(SIZES)]
    fitted = fit_link("all_reduce", 2, points)
    assert fitted.latency > 0 and 0 < fitted.bandwidth <= MAX_BANDWIDTH
    with pytest.raises(ValueError, match="positive"):
        fit_link("all_reduce", 2, [(4096, 0.0)])
    with pytest.raises(ValueError, match="positive"):
        fit_link("all_reduce", 2, [])


def _profile() -> Hardware:
    points = _exact("all_reduce", 2, Link(50e-6, 5e9))
    measured = (Measured("all_reduce", 2, fit_link("all_reduce", 2, points), tuple(points)),)
    return Hardware("cpu-test", 5e10, 9e10, 2e10, 8 * 2**30, 2, measured[0].link, measured[0].link,
                    measured=measured, matmuls=((512, 512, 512, 9e10), (512, 1024, 1024, 4e10)),
                    source="synthetic", extra={"nproc": 2, "device": "cpu"})


def test_profile_round_trip(tmp_path) -> None:
    hw = _profile()
    save(hw, tmp_path / "p.json")
    back = load(tmp_path / "p.json")
    assert back == hw and back.extra == hw.extra
    assert back.collective("all_reduce", 2**20, 2) == hw.collective("all_reduce", 2**20, 2)


@pytest.mark.parametrize("change,problem", [
    (lambda d: d.update(version=PROFILE_VERSION + 1), "version"),
    (lambda d: d.pop("version"), "version"),
    (lambda d: d.pop("matmul_flops"), "matmul_flops"),
    (lambda d: d.update(memory_bandwidth=-1.0), "memory_bandwidth"),
    (lambda d: d.update(peak_flops=float("nan")), "peak_flops"),
    (lambda d: d["intra"].pop("bandwidth"), "bandwidth"),
    (lambda d: d.update(gpus_per_node=0), "gpus_per_node"),
])
def test_tampered_profile_is_refused(tmp_path, change, problem) -> None:
    data = _profile().to_dict()
    change(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=problem):
        load(path)


def test_unreadable_profile_is_refused(tmp_path) -> None:
    (tmp_path / "p.json").write_text('{"version": 1, "name": ')
    with pytest.raises(ValueError, match="cannot read"):
        load(tmp_path / "p.json")
    (tmp_path / "q.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        load(tmp_path / "q.json")


def test_model_shapes_are_the_largest_matmuls() -> None:
    shapes = model_shapes(NANOGPT)
    assert 0 < len(shapes) <= 8 and len(set(shapes)) == len(shapes)
    flops = [math.prod(s) for s in shapes]
    assert flops == sorted(flops, reverse=True)
    # nanogpt's example batch is (b, s) = (2, 64) tokens, n_embd 64, vocab 256: the LM head is the largest
    assert shapes[0] in {(128, 64, 256), (128, 256, 64)} and (128, 64, 256) in shapes


def test_buffer_copies_count_every_byte_read_and_written() -> None:
    """The copy micro-benchmark: a block's parameters into one flat buffer and back out, 2 × 2 × bytes per
    call (timed here by a stand-in for the ranks' clock: no processes)."""
    import torch

    from autotp.search.profile import _buffer_copies, block_sizes

    class Clock:
        job = ProfileJob.make("cpu", "fp32")
        device = torch.device("cpu")

        def time(self, fn) -> float:
            fn()
            return 0.5

    h = Clock.job.buffer_hidden
    assert sum(block_sizes(h)) == 12 * h * h + 13 * h  # a GPT block: 12h² weights, 13h biases and norms
    assert _buffer_copies(Clock()) == 2 * 2 * 4 * sum(block_sizes(h)) / 0.5
    assert ProfileJob.make("cuda", "bf16").buffer_hidden == 4096


def test_job_defaults() -> None:
    quick, full = ProfileJob.make("cpu", "fp32", quick=True), ProfileJob.make("cpu", "fp32")
    assert full.sizes[0] == 4096 and full.sizes[-1] == 16 * 2**20
    assert len(quick.sizes) < len(full.sizes) and quick.repeats < full.repeats
    assert ProfileJob.make("cpu", "fp32", [(8, 8, 8)]).shapes == ((8, 8, 8),)


@pytest.mark.parametrize("args,message", [
    (["--nproc", "1"], "--nproc must be >= 2"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--device", "cpu", "--dtype", "fp8"], "--dtype must be one of fp32, bf16"),
    (["--out", "/nonexistent-dir/p.json"], "does not exist"),
])
def test_bad_options_exit_2(args, message, tmp_path) -> None:
    result = runner.invoke(app, ["profile", *args], env={"COLUMNS": "240"})
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_out_folder_is_refused(tmp_path) -> None:
    result = runner.invoke(app, ["profile", "--device", "cpu", "--out", str(tmp_path)], env={"COLUMNS": "240"})
    assert result.exit_code == 2 and "is a folder" in result.output


@pytest.mark.slow
def test_profile_two_cpu_ranks(tmp_path) -> None:
    out = tmp_path / "profile.json"
    result = runner.invoke(app, ["profile", "--nproc", "2", "--device", "cpu", "--quick", "--out", str(out)],
                           env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output and "all-reduce" in result.output
    hw = load(out)
    assert hw.gpus_per_node == 2 and hw.extra["nproc"] == 2 and hw.extra["device"] == "cpu"
    assert hw.extra["dtype"] == "fp32" and hw.extra["threads_per_rank"] >= 1
    assert hw.matmul_flops > 0 and hw.peak_flops >= hw.matmul_flops and hw.memory_bandwidth > 0
    assert hw.overhead > 0 and hw.optimizer > 0 and not hw.overlap and hw.share >= 1  # gloo shares the cores
    assert hw.copy_bandwidth > 0 and hw.copy_rate == hw.copy_bandwidth and "buffer copies" in result.output
    assert len(hw.matmuls) == len(ProfileJob.make("cpu", "fp32", quick=True).shapes)
    assert all(rate > 0 for *_, rate in hw.matmuls)
    kinds = {(m.kind, m.ranks): m for m in hw.measured}
    reduce = kinds[("all_reduce", 2)]
    assert reduce.link == hw.intra == hw.inter
    assert reduce.link.latency >= 0 and reduce.link.bandwidth > 0
    assert len(reduce.points) == len(message_sizes("cpu", quick=True))
    assert all(b > 0 and s > 0 for b, s in reduce.points)
    assert ("send", 2) in kinds and ("all_gather", 2) in kinds
    # reduce-scatter is measured, or the profile says why not
    assert ("reduce_scatter", 2) in kinds or "reduce_scatter" in hw.extra["collective_notes"]
    assert Hardware.from_dict(hw.to_dict()) == hw


def test_the_dtypes_checked_before_torch_are_the_profilers() -> None:
    """``autotp profile --dtype`` is checked before torch is imported, against names kept beside the command."""
    from autotp.cli.profile import DTYPE_NAMES
    from autotp.search.profile import DTYPES

    assert DTYPE_NAMES == tuple(DTYPES)
