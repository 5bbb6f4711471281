"""The plan cache: a second `autotp plan` of the same model, shapes and options reads the plan instead of
capturing; any change to them misses; a changed file is refused; a restarted job's ``parallelize`` shards
from it and captures on the first call."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import autotp.capture.tracer as tracer
from autotp.capture.modelfile import load_model_file
from autotp.capture.tracer import meta_call
from autotp.cli.main import app
from autotp.errors import PlanCacheError
from autotp.plan import cache
from autotp.plan.planner import make_plan

runner = CliRunner()


def _net_and_call(batch=None):
    mf = load_model_file("examples/nanogpt.py")
    with torch.device("meta"):
        net = mf.build()
    args, kwargs = mf.example_batch()
    if batch is not None:
        args = tuple(a[:batch] for a in args)
    return net, meta_call(net.forward, args, kwargs)


def test_the_key_follows_code_shapes_and_options():
    net, call = _net_and_call()
    base = cache.plan_key(net, call, {"tp": 2})
    assert base == cache.plan_key(net, call, {"tp": 2})  # stable
    assert base != cache.plan_key(net, call, {"tp": 4})  # tp
    assert base != cache.plan_key(net, call, {"tp": 2, "sequence_parallel": True})  # an option
    net2, call2 = _net_and_call(batch=2)
    assert base != cache.plan_key(net2, call2, {"tp": 2})  # the input's shape
    block = net.transformer.h[0].mlp
    old = type(block).forward

    def changed(self, x):  # the same module, other code: a different program
        return old(self, x) * 2
    type(block).forward = changed
    try:
        assert base != cache.plan_key(net, call, {"tp": 2})
    finally:
        type(block).forward = old
    assert base == cache.plan_key(net, call, {"tp": 2})


def test_round_trip_and_a_changed_file_is_refused(tmp_path):
    net, call = _net_and_call()
    gm = tracer.capture(net, *load_model_file("examples/nanogpt.py").example_batch(), device=torch.device("cpu"))[0]
    plan = make_plan(gm, 2)
    key = cache.plan_key(net, call, {"tp": 2})
    path = cache.store(key, plan, {"ranges": {"s0": [2, 64]}}, tmp_path)
    hit = cache.load(key, tmp_path)
    assert hit.plan == plan and hit.extra == {"ranges": {"s0": [2, 64]}}
    assert cache.load("0" * 64, tmp_path) is None
    data = json.loads(path.read_text())
    data["body"]["plan"]["tp"] = 4  # edited by hand
    path.write_text(json.dumps(data))
    with pytest.raises(PlanCacheError, match="changed after autotp wrote it"):
        cache.load(key, tmp_path)
    path.write_text("{not json")
    with pytest.raises(PlanCacheError, match="unreadable"):
        cache.load(key, tmp_path)


def test_autotp_plan_reads_the_cache_the_second_time(monkeypatch):
    first = runner.invoke(app, ["plan", "examples/nanogpt.py", "--tp", "2"])
    assert first.exit_code == 0, first.output

    def no_capture(*a, **k):
        raise AssertionError("captured although the plan is cached")

    monkeypatch.setattr("autotp.parallel.planning.capture", no_capture)
    second = runner.invoke(app, ["plan", "examples/nanogpt.py", "--tp", "2"])
    assert second.exit_code == 0, second.output
    assert second.output.split("plan cache:")[0] == first.output.split("plan cache:")[0]  # the same tables
    # another tp, another option, or --no-cache: planned again
    for argv in (["--tp", "4"], ["--tp", "2", "--sequence-parallel"], ["--tp", "2", "--no-cache"]):
        r = runner.invoke(app, ["plan", "examples/nanogpt.py", *argv])
        assert r.exit_code == 1 and "captured although" in str(r.exception), argv


def test_autotp_plan_refuses_a_changed_cache_file():
    assert runner.invoke(app, ["plan", "examples/nanogpt.py", "--tp", "2"]).exit_code == 0
    [entry] = list(cache.cache_dir().glob("*.json"))
    entry.write_text(entry.read_text().replace('"tp": 2', '"tp": 3', 1))
    r = runner.invoke(app, ["plan", "examples/nanogpt.py", "--tp", "2"])
    assert r.exit_code == 2
    assert "was changed after autotp wrote it" in " ".join(r.output.split()) and entry.name in r.output


def test_the_key_follows_one_block_among_identical_ones():
    """The key's meta run files a block's ops under the block and reuses the first block's meta outputs for
    the rest: a Python value read by one block alone still changes the key."""
    from nanogpt import GPT, GPTConfig

    with torch.device("meta"):
        net = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=4, n_head=2, n_embd=32))
    call = meta_call(net.forward, (torch.zeros(2, 8, dtype=torch.long),), {})
    base = cache.plan_key(net, call, {"tp": 2})
    attn = net.transformer.h[2].attn
    attn.n_head = 4  # block 2 alone splits into more heads: the same weights, another graph
    assert base != cache.plan_key(net, call, {"tp": 2})
    attn.n_head = 2
    assert base == cache.plan_key(net, call, {"tp": 2})


@pytest.mark.slow
def test_a_restarted_job_shards_from_the_cached_plan_and_captures_on_the_first_call(tmp_path):
    from ranks import launch
    from reuse_workers import restart

    for rank, r in launch(restart, 2, str(tmp_path)).items():
        assert r["first"] == {"cached": False, "graphs": 1}, r["first"]  # a miss captures at parallelize
        # the restart: sharded as the first job was, from the cache, nothing captured until the first call
        assert r["restart"] == {"cached": True, "graphs": 0, "from": str(tmp_path / "plans"),
                                "same_shards": True}, r["restart"]
        assert r["mapped"] > 0
        assert r["graphs_after"] == 2  # an eval call (logits only), then the training call
        assert r["eval_logits"] <= 1e-5 and r["loss"] <= 1e-5 and r["logits"] <= 1e-5, r
        assert r["grads"] <= 1e-5, r["grads"]
        assert r["same_collectives"]  # exactly the first job's collectives, forward and backward
        assert not r["other_option_cached"]  # another vocab multiple: another key
        assert "was changed after autotp wrote it" in r["tampered"] and str(tmp_path / "plans") in r["tampered"]


def test_one_meta_run_serves_the_key_and_the_capture(monkeypatch):
    """The key's meta run of the whole model is the one the capture finds the repeated blocks with: a cold
    plan runs the model on meta twice (the whole model, then the one cut to the blocks it exports), not
    three times, and captures the same graph."""
    import autotp.capture.meta_run as meta_run
    from autotp.capture.repeats import record_whole
    from nanogpt import GPT, GPTConfig

    with torch.device("meta"):
        net = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=4, n_head=2, n_embd=32))
    idx = torch.zeros(2, 8, dtype=torch.long)
    call = meta_call(net.forward, (idx,), {})
    runs = []
    real = meta_run.run_once
    monkeypatch.setattr(meta_run, "run_once", lambda *a, **k: runs.append(len(a[1])) or real(*a, **k))
    rec = record_whole(net, call)
    key = cache.plan_key(net, call, {"tp": 2}, rec)
    gm = tracer.capture(net, (idx,), {}, recorded=rec)[0]
    assert runs == [4, 2], runs  # all blocks, then the two kept
    assert key == cache.plan_key(net, call, {"tp": 2})  # the same key as its own meta run gives
    again = tracer.capture(net, (idx,), {})[0]
    assert [str(n.target) for n in gm.graph.nodes] == [str(n.target) for n in again.graph.nodes]


def test_the_shard_check_stores_the_plan_the_ranks_look_up(tmp_path, monkeypatch):
    """``autotp shard`` plans once per job: its check (meta model) stores the plan in the job's own folder,
    under the key a rank's ``parallelize`` (the model built on the CPU, its own capture) looks up, whatever
    AUTOTP_PLAN_CACHE says (the tests' default is off); a job the ranks do not reuse (tp 1) has no cache."""
    from autotp.cli.shard import preflight
    from autotp.options import Options
    from autotp.parallel import planning
    from autotp.parallel.reuse import plan_cache_for

    mf = load_model_file("examples/nanogpt.py")
    assert preflight(mf, 2, plans=tmp_path / "plans") > 0  # the FLOPs, counted from the same capture
    [entry] = list((tmp_path / "plans").glob("*.json"))
    assert plan_cache_for(planning.job_of(1, Options()), tmp_path / "plans") is None  # tp 1: the ranks plan

    torch.manual_seed(0)
    net = mf.build()  # as a rank builds it: real weights on the CPU
    job = planning.job_of(2, Options().validate())  # the job parallelize makes of its options
    assert plan_cache_for(job) is None  # the user's cache is off in tests; the job's own folder is not
    monkeypatch.setattr(planning, "capture", lambda *a, **k: pytest.fail("captured although the check planned"))
    planned = planning.capture_and_plan(net, *mf.example_batch(), job, plan_cache_for(job, tmp_path / "plans"),
                                        how=planning.How(net.forward, device=torch.device("cpu"), writes=True))
    assert planned.cached and planned.path == entry and planned.plan.tp == 2 and planned.plan.params
