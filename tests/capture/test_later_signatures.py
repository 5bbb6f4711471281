"""A later call signature of a parallelized model (eval, a training call with targets, a KV cache) is planned and
rewritten on the blocks capture exported, and the rewritten blocks are copied for the rest
(autotp.parallel.rewrite): the same numbers, bit for bit, and the same collectives as rewriting the whole graph,
and the unsharded model's numbers; a dense first block is a kind of its own, with its own template."""
from __future__ import annotations

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense_first_dropout", pytest.param("llama", marks=pytest.mark.extended)])
def test_later_signatures_rewrite_the_exported_blocks_and_copy_them(name: str):
    """A GPT whose first block differs (and whose dropout draws on both region streams) by default; Hugging
    Face's Llama with its KV cache in the extended run (its cache calls at tp 2 run by default in
    tests/capture/test_call_matrix.py, llama:dict:hf_cache). Alternating kinds are compared with the whole
    rewrite structurally (tests/capture/test_rewrite_copies.py)."""
    from ranks import launch, run_jobs
    from later_workers import later_signatures

    jobs = {name: (later_signatures, name)}
    for rank, by_name in launch(run_jobs, 2, jobs).items():
        for name, r in by_name.items():
            assert r["copied"] == [True, True], (name, rank, r)
            assert r["whole_copied"] == [False, False], (name, rank, r)  # the reference took the whole path
            assert r["same_ops"] and r["same_collectives"] and r["bitwise"], (name, rank, r)
            # the cut plan names the exported blocks' parameters only; the first plan names every one
            assert all(n < r["first_params"] for n in r["planned_params"]), (name, rank, r)
            assert all(c > 0 for c in r["collectives"]), (name, rank, r)
            if "logits_diff" in r:
                assert r["logits_diff"] < 1e-5 and r["loss_diff"] < 1e-5, (name, rank, r)
