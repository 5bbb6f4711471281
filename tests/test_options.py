"""One options value, validated once: the pipeline's schedule, micro-batches and stages per rank beside the
other dimensions, refused in one place with every number in the message (unit tests, no torch needed)."""
from __future__ import annotations

import subprocess
import sys

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
    run (exact at cp 2 × pp 2, tests/test_pipeline.py; cp 2 × tp 2 with whole experts per rank,
    tests/test_context_parallel.py); FSDP over the stages with cp stays refused, naming it."""
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
