"""Every way a training script calls its model reaches the right graph, exactly: ``example_inputs`` in each
documented form, train → eval → generate → train, generate first, batch and length changes, inference mode,
Hugging Face ``generate`` with and without its cache; eager, ``parallelize(compile=True)`` and the user's own
``torch.compile(model)`` (tests/call_workers.py). tp 2, against the unsharded model: losses within 1e-5 (fp32),
parameters after the steps within 1e-5, generated tokens identical."""
from __future__ import annotations

import pytest

from call_workers import call_matrix
from distributed import Launches

CASES = [
    # example_inputs in every documented form, then the calls of nanoGPT's train.py and sample.py
    "nanogpt:none:train_eval_generate_train:eager",
    "nanogpt:tuple:train_eval_generate_train:eager",
    "nanogpt:argskw:train_eval_generate_train:eager",
    "nanogpt:dict:train_eval_generate_train:eager",
    "nanogpt:tuple:generate_first:eager",
    "nanogpt:tuple:shapes:eager",
    "llama:dict:hf_cache:eager",
    "llama:none:generate_first:eager",
    "llama:argskw:shapes:eager",
    # compiled: autotp's own compile, and the user's torch.compile(model) after parallelize
    "nanogpt:argskw:train_eval_generate_train:compile",
    "nanogpt:argskw:train_eval_generate_train:user",
    "nanogpt:tuple:generate_first:user",
]


@pytest.fixture(scope="module")
def runs() -> Launches:
    return Launches({2: {"matrix": (call_matrix, CASES)}})


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_script_calls_are_exact(runs, case: str):
    for rank, by_case in runs(2, "matrix").items():
        r = by_case[case]
        assert r["losses"] >= 2 and r["loss_diff"] <= 1e-5, (rank, r)
        assert r["param_diff"] <= 1e-5, (rank, r)
        assert r["same_tokens"] and r["generated"], (rank, r)
        assert r["warnings"] == [], (rank, r["warnings"])
        if not case.endswith(":eager"):  # the rewritten graph is what dynamo compiled
            assert r["compiled_graphs"] >= 1, (rank, r)
