"""One options value, validated once: the pipeline's schedule, micro-batches and stages per rank beside the
other dimensions, refused in one place with every number in the message (fast tier, no torch needed)."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from autotp.errors import PipelineError, ShardingError
from autotp.options import Options, PipelineOptions
from autotp.plan.stages import StageRequest


def test_pipeline_options_fill_in_the_schedule_s_defaults() -> None:
    assert PipelineOptions(2).validate() == PipelineOptions(2, "1F1B", 2, 1)
    assert PipelineOptions(2, "interleaved1f1b").validate() == PipelineOptions(2, "Interleaved1F1B", 2, 2)
    assert PipelineOptions(4, "zbvzerobubble", 8).validate().count == 8  # a V: 2 stages per rank
    assert PipelineOptions(4, "GPipe", 2).validate().microbatches == 2  # GPipe fills and drains: any m


@pytest.mark.parametrize("asked, batch, message", [
    (PipelineOptions(2, "Zigzag"), None, "unknown pipeline schedule 'Zigzag'"),
    (PipelineOptions(2, "1F1B", virtual_stages=2), None, "runs one stage per rank, and virtual_stages is 2"),
    (PipelineOptions(2, "LoopedBFS", virtual_stages=1), None, "interleaves several stages per rank"),
    (PipelineOptions(2, "ZBVZeroBubble", virtual_stages=3), None, "exactly 2 stages per rank (a V), and virtual_stages is 3"),
    (PipelineOptions(4, "1F1B", 2), None, "microbatches 2 < pp 4"),
    (PipelineOptions(2, "1F1B", 3), 8, "3 micro-batches do not divide the batch of 8"),
    (PipelineOptions(0), None, "pp must be an integer >= 1, got 0"),
])
def test_pipeline_options_refuse_with_the_numbers(asked: PipelineOptions, batch: int | None, message: str) -> None:
    with pytest.raises(PipelineError, match=message.replace("(", r"\(").replace(")", r"\)")):
        asked.validate(batch)


def test_options_validate_the_schedule_with_the_other_dimensions() -> None:
    got = Options(pipeline=StageRequest(4), schedule=PipelineOptions(2, "interleaved1f1b")).validate()
    assert got.schedule == PipelineOptions(2, "Interleaved1F1B", 2, 2)  # the validated value is what is kept
    with pytest.raises(PipelineError, match="4 stages asked for, and the schedule 1F1B places pp 2 × virtual stages 1"):
        Options(pipeline=StageRequest(4), schedule=PipelineOptions(2)).validate()
    # FSDP over the stages with a split-backward schedule: refused in the same place, as a pipeline error
    with pytest.raises(PipelineError, match="fsdp with the InterleavedZeroBubble schedule is not supported"):
        Options(pipeline=StageRequest(4), schedule=PipelineOptions(2, "InterleavedZeroBubble", 2),
                stage_fsdp=True).validate()
    with pytest.raises(ShardingError, match="vocab_multiple must be a positive integer, got 0"):
        Options(vocab_multiple=0).validate()


def test_context_parallelism_runs_with_pipeline_stages_and_expert_parallelism() -> None:
    """cp with pipeline stages and with expert parallelism is one rule's answer, the same for every caller: they
    run (exact at cp 2 × pp 2, tests/runtime/test_pipeline.py; cp 2 × tp 2 with whole experts per rank,
    tests/runtime/test_context_parallel.py); FSDP over the stages with cp stays refused, naming it."""
    from autotp.options import refused

    assert refused(pipeline=2, context_parallel=2) is None
    assert refused(pipeline=4, schedule="Interleaved1F1B", context_parallel=2, sequence_parallel=True) is None
    assert Options(pipeline=StageRequest(2), schedule=PipelineOptions(2), context_parallel=2).validate()
    assert refused(expert_parallel=True, context_parallel=2) is None  # routing is per token (test_context_parallel)
    with pytest.raises(PipelineError, match=r"context parallelism \(cp 2\) with pipeline stages does not run with "
                                            "fsdp over the stages yet"):
        Options(pipeline=StageRequest(2), schedule=PipelineOptions(2), context_parallel=2, stage_fsdp=True).validate()


@pytest.mark.slow  # a fresh interpreter (about 0.2 s)
def test_the_rules_load_without_torch() -> None:
    """The command line and the layout search validate before torch is imported."""
    code = ("import sys; from autotp.options import Options, PipelineOptions, refused; "
            "PipelineOptions(2, 'interleaved1f1b').validate(); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the one rule of combinations (autotp.combinations.refused): one case per rule, every number named ---------

@pytest.mark.parametrize("asked, says, numbers", [
    (dict(staged=("schedule", "microbatches")), "schedule, microbatches apply to pipeline stages, and pp is 1", (1,)),
    (dict(pipeline=4, schedule="1F1B", placed=(2, 1)), "4 stages asked for, and the schedule 1F1B places pp 2 × "
                                                      "virtual stages 1 = 2", (4, 2, 1)),
    (dict(hsdp=2), "hsdp 2 shards within replica groups: it needs fsdp", (2,)),
    (dict(fsdp_param_dtype="bf16"), "fsdp_param_dtype bf16 sets FSDP's mixed precision: it goes with fsdp", ()),
    (dict(fsdp=True, ddp_options=True), "data_parallel options (DistributedDataParallel's) were given with fsdp", ()),
    (dict(fsdp=True, dp=1), "there is one: dp 1 × cp 1 = 1", (1,)),
    (dict(fsdp=True, dp=4, hsdp=3), "hsdp 3 replica groups do not divide the dp 4 data-parallel ranks", (3, 4)),
    (dict(fsdp=True, dp=4, hsdp=3, context_parallel=2), "(the cp 2 ranks shard within each group)", (3, 4, 2)),
    (dict(fsdp=True, pipeline=4, context_parallel=2), "context parallelism (cp 2) with pipeline stages does not "
                                                      "run with fsdp over the stages yet (4 stages)", (2, 4)),
    (dict(fsdp=True, pipeline=4, schedule="ZBVZeroBubble"), "fsdp with the ZBVZeroBubble schedule", ()),
    (dict(pipeline=2, trainer=True), "the Trainer integration runs no pipeline stages; this job has pp 2", (2,)),
    (dict(fsdp=True, dp=2, fsdp_param_dtype="bf16", parity_check=True), "the parity check against the unsharded "
                                                                        "model in its own dtype cannot hold", ()),
])
def test_each_rule_refuses_naming_every_number(asked: dict, says: str, numbers: tuple[int, ...]) -> None:
    from autotp.combinations import refused

    reason = refused(**asked)
    assert reason is not None and says in reason.message, reason
    assert all(str(n) in reason.message for n in numbers), reason.message
    assert reason.hint and all(f in reason.message + reason.hint for f in reason.fields), reason


@pytest.mark.parametrize("asked", [
    dict(fsdp=True, dp=1, context_parallel=2),  # FSDP over the cp ranks (tests/runtime/test_context_parallel.py fsdp_tp2)
    dict(fsdp=True, dp=2), dict(fsdp=True),  # dp not known (the library before its mesh): not judged
    dict(fsdp=True, dp=4, hsdp=2, context_parallel=2), dict(hsdp=1),
    dict(pipeline=2, staged=("schedule",), schedule="GPipe", fsdp=True, dp=2),
    dict(pipeline=1, trainer=True), dict(fsdp=True, dp=2, fsdp_param_dtype="bf16"),
])
def test_what_runs_is_not_refused(asked: dict) -> None:
    from autotp.combinations import refused

    assert refused(**asked) is None


def test_options_reexport_the_one_rule() -> None:
    import autotp.combinations as one
    import autotp.options as options

    assert (options.refused, options.Refusal, options.PipelineOptions) == (one.refused, one.Refusal,
                                                                           one.PipelineOptions)
    with pytest.raises(ShardingError, match="data_parallel options"):
        Options(fsdp=SimpleNamespace(replicas=1), data_parallel={"bucket_cap_mb": 1}).validate()


@pytest.mark.parametrize("dp, cp", [(1, 1), (1, 2), (2, 1)])
def test_fsdp_over_dp_times_cp_is_one_answer_for_every_caller(tmp_path, monkeypatch, dp: int, cp: int) -> None:
    """FSDP shards over the dp × cp ranks (the runtime's mesh): refused at dp · cp = 1 and run at cp 2 × dp 1 by
    the rule, the launcher, `autotp plan`, `autotp shard` (before any rank or capture) and the layout search
    alike, each saying the rule's message."""
    from typer.testing import CliRunner

    import autotp.distributed.launch as launch_module
    from autotp.cli import shard as shard_cli
    from autotp.cli.common import as_flags
    from autotp.cli.main import app
    from autotp.combinations import refused
    from autotp.distributed.launch import LaunchSpec
    from autotp.errors import LaunchError
    from autotp.search.auto import supported
    from autotp.search.cost import Candidate
    from autotp.parallel import planning

    reason = refused(fsdp=True, dp=dp, context_parallel=cp)
    runs = reason is None
    assert runs == (dp * cp > 1)
    said = None if runs else " ".join(as_flags(f"{reason.message}; {reason.hint}", reason.fields).split())
    # the launcher
    try:
        LaunchSpec(tp=1, dp=dp, cp=cp, fsdp=True, device="cpu")
        launched = True
    except LaunchError as exc:
        launched = False
        assert reason is not None and str(exc).startswith(reason.message), exc
    assert launched == runs
    # the layout search
    assert supported(Candidate(1, dp, 1, 1, 1, fsdp=True, cp=cp)) == runs
    # autotp plan: past every check of the options, the capture is where it would go next
    class Reached(Exception):
        pass

    def reached(*a, **k):
        raise Reached

    monkeypatch.setattr(planning, "plan_file", reached)
    model = tmp_path / "tiny.py"
    model.write_text("import torch.nn as nn\n\ndef build_model():\n    return nn.Linear(4, 4)\n")
    runner = CliRunner()
    flags = ["--tp", "1", "--dp", str(dp), "--cp", str(cp), "--fsdp"]
    planned = runner.invoke(app, ["plan", str(model), *flags], env={"COLUMNS": "500"})
    if runs:
        assert isinstance(planned.exception, Reached), planned.output
    else:
        assert planned.exit_code == 2 and said in " ".join(planned.output.split()), planned.output
    # autotp shard: refused before the check that captures, and before any rank starts
    started = []
    monkeypatch.setattr(shard_cli, "preflight", reached)
    monkeypatch.setattr(launch_module, "launch", lambda *a, **k: started.append(a))
    sharded = runner.invoke(app, ["shard", str(model), *flags, "--device", "cpu", "--out", str(tmp_path / "o")],
                            env={"COLUMNS": "500"})
    assert not started
    if runs:
        assert isinstance(sharded.exception, Reached), sharded.output
    else:
        assert sharded.exit_code == 2 and said in " ".join(sharded.output.split()), sharded.output


def test_pipeline_flags_without_pp_are_refused_alike_by_plan_and_shard(tmp_path, monkeypatch) -> None:
    """--schedule, --microbatches, --virtual-stages at pp 1 would be dropped without a word: both commands
    refuse them with the rule's one message, before anything is captured or launched."""
    from typer.testing import CliRunner

    from autotp.cli import shard as shard_cli
    from autotp.cli.main import app

    def never(*a, **k):
        raise AssertionError("went past the options")

    monkeypatch.setattr(shard_cli, "preflight", never)
    monkeypatch.setattr("autotp.parallel.planning.plan_file", never)
    model = tmp_path / "tiny.py"
    model.write_text("import torch.nn as nn\n\ndef build_model():\n    return nn.Linear(4, 4)\n")
    flags = ["--tp", "1", "--schedule", "GPipe", "--microbatches", "2"]
    said = "--schedule, --microbatches apply to pipeline stages, and --pp is 1; give --pp 2 or more"
    for command in (["plan", str(model)], ["shard", str(model), "--out", str(tmp_path / "o")]):
        result = CliRunner().invoke(app, [*command, *flags], env={"COLUMNS": "500"})
        assert result.exit_code == 2 and said in " ".join(result.output.split()), result.output
