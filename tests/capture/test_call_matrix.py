"""Every way a training script calls its model reaches the right graph, exactly: ``example_inputs`` in each
documented form, train → eval → generate → train, generate first, batch and length changes, inference mode,
Hugging Face ``generate`` with and without its cache; eager, ``parallelize(compile=...)`` and the user's own
``torch.compile(model)``, both with aot_eager (tests/support/call_workers.py). tp 2, against the unsharded model: losses within 1e-5 (fp32),
parameters after the steps within 1e-5, generated tokens identical."""
from __future__ import annotations

import pytest
import torch

from call_workers import call_matrix
from ranks import Launches

CASES = [
    # example_inputs in every documented form, then the calls of nanoGPT's train.py and sample.py; ``(args,
    # kwargs)`` is the tuple's example once split (test_tuple_and_args_kwargs_examples_are_one_example), so it
    # runs the sequence compiled only, both ways, below
    "nanogpt:none:train_eval_generate_train:eager",
    "nanogpt:tuple:train_eval_generate_train:eager",
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
# a second spelling of a sequence another case runs, the example forms and call shapes beyond one each, and the
# compiled sequences (CI compiles in tests/runtime/test_compile.py): in the extended run only
EXTENDED = ["nanogpt:argskw:train_eval_generate_train:compile", "nanogpt:tuple:train_eval_generate_train:eager",
            "llama:none:generate_first:eager", "nanogpt:tuple:generate_first:user", "nanogpt:dict:train_eval_generate_train:eager",
            "nanogpt:tuple:shapes:eager", "nanogpt:argskw:train_eval_generate_train:user"]


@pytest.fixture(scope="module")
def runs() -> Launches:
    return Launches({2: {"matrix": (call_matrix, [c for c in CASES if c not in EXTENDED])}},
                    extended={2: {"rest": (call_matrix, EXTENDED)}})


@pytest.mark.slow
@pytest.mark.parametrize("case", [c if c not in EXTENDED else pytest.param(c, marks=pytest.mark.extended)
                                  for c in CASES])
def test_script_calls_are_exact(runs, case: str):
    for rank, by_case in runs(2, "rest" if case in EXTENDED else "matrix").items():
        r = by_case[case]
        assert r["losses"] >= 2 and r["loss_diff"] <= 1e-5, (rank, r)
        assert r["param_diff"] <= 1e-5, (rank, r)
        assert r["same_tokens"] and r["generated"], (rank, r)
        assert r["warnings"] == [], (rank, r["warnings"])
        if not case.endswith(":eager"):  # the rewritten graph is what dynamo compiled
            assert r["compiled_graphs"] >= 1, (rank, r)


def test_tuple_and_args_kwargs_examples_are_one_example():
    """``example_inputs=(x, y)`` and ``example_inputs=((x, y), {})`` reach parallelize as the same positional
    tensors and no keywords: what a rank does after that cannot tell them apart."""
    from autotp.parallel.parallelize import _split_example
    from call_workers import _example

    def forward(idx, targets=None):
        raise AssertionError("an example given is not made from the forward's signature")

    tuple_args, tuple_kwargs = _split_example(_example("tuple", False), forward)
    args, kwargs = _split_example(_example("argskw", False), forward)
    assert tuple_kwargs == kwargs == {} and len(tuple_args) == len(args) == 2
    assert all(torch.equal(a, b) for a, b in zip(tuple_args, args))
