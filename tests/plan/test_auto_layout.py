"""The layout search: hardware profiles, each cost term against a hand computation, the enumeration's
divisibility and memory rules, the facts read from a captured graph, and ``autotp plan --auto``."""
from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
from typer.testing import CliRunner

from autotp.cli.main import app
from autotp.search.auto import Space, candidates, explain, runnable, search, supported, tp_sizes
from autotp.search.cost import STATE_BYTES, Candidate, Training, estimate
from autotp.search.model_costs import BLOCKS, FIRST, LAST, Comm, ModelCosts, TpCosts
from autotp.search.hardware import A100, H100, Hardware, Link, Measured, load, resolve, save
from autotp.reports.pipeline import layer_activation_bytes
from ranks import ROOT

GB = 10**9


def hw(**kw) -> Hardware:
    base = dict(name="test", matmul_flops=1e12, peak_flops=2e12, memory_bandwidth=1e11, memory_bytes=100 * GB,
                gpus_per_node=8, intra=Link(1e-5, 1e10), inter=Link(1e-4, 1e9), overhead=0.0)
    return Hardware(**{**base, **kw})


def facts(layers=4, h=64, s=32, heads=4, vocab=256, comm=True, fused=True, per_layer=1000) -> ModelCosts:
    """A made-up GPT: per sample 1e9 FLOPs in the blocks, 1e8 after them; 1000 block parameters per layer."""
    def tpf(t):
        blocks = () if t == 1 or not comm else (Comm("all_reduce", "forward", 2 * layers, 2 * layers * s * h),
                                                Comm("all_reduce", "backward", 2 * layers, 2 * layers * s * h))
        return TpCosts(t, {FIRST: 500 // t, BLOCKS: per_layer * layers // t, LAST: 300 // t},
                       {FIRST: (), BLOCKS: blocks, LAST: ()}, 1.0)
    return ModelCosts(layers, s, h, heads, vocab, {FIRST: 0.0, BLOCKS: 1e9, LAST: 1e8},
                      {FIRST: 5, BLOCKS: 10 * layers, LAST: 6}, per_layer * layers + 800, 4,
                      fused, False, {t: tpf(t) for t in (1, 2, 4)})


# -- hardware ---------------------------------------------------------------------------------------------
def test_collective_times_follow_the_ring():
    h = hw()
    S = 8e6
    assert h.collective("all_reduce", S, 4) == pytest.approx(1e-5 + 2 * 3 / 4 * S / 1e10)
    assert h.collective("all_gather", S, 4) == pytest.approx(1e-5 + 3 / 4 * S / 1e10)
    assert h.collective("reduce_scatter", S, 2, count=3) == pytest.approx(3 * (1e-5 + S / 2 / 1e10))
    assert h.collective("send", S, 2) == pytest.approx(1e-5 + S / 1e10)
    assert h.collective("all_reduce", S, 1) == 0.0


def test_groups_across_nodes_use_one_card_per_member_on_each_node():
    h = hw()
    # 16 ranks, 2 per node: two network cards' worth, the slower latency
    assert h.link("all_reduce", 16, 2) == Link(1e-4, 2e9)
    assert h.link("all_reduce", 16, 64) == Link(1e-4, 1e10) or h.link("all_reduce", 16, 16) == h.intra
    assert h.link("all_reduce", 4, 8) == h.intra


def test_measured_collectives_override_the_links():
    m = Measured("all_reduce", 2, Link(1e-3, 5e8), ((1000, 0.001),))
    h = hw(measured=(m,))
    assert h.collective("all_reduce", 1e6, 2) == pytest.approx(1e-3 + 1e6 / 5e8)
    assert h.collective("all_reduce", 1e6, 4) == pytest.approx(1e-5 + 1.5e6 / 1e10)


def test_profile_round_trip_and_refusals(tmp_path):
    path = tmp_path / "p.json"
    save(hw(measured=(Measured("send", 2, Link(1e-4, 1e9), ((4096, 1e-4),)),)), path)
    assert load(path) == hw(measured=(Measured("send", 2, Link(1e-4, 1e9), ((4096, 1e-4),)),))
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        load(path)
    path.write_text(json.dumps({k: v for k, v in data.items() if k != "matmul_flops"}))
    with pytest.raises(ValueError, match="matmul_flops"):
        load(path)
    path.write_text(json.dumps({**data, "memory_bytes": -1}))
    with pytest.raises(ValueError, match="memory_bytes"):
        load(path)
    with pytest.raises(ValueError, match="neither a preset"):
        resolve(str(tmp_path / "missing.json"))
    assert resolve("A100") is A100 and resolve("h100") is H100


# -- cost terms, each against a hand computation ------------------------------------------------------------
def test_compute_term():
    f, h = facts(), hw(overhead=1e-4)
    e = estimate(f, h, Candidate(1, 1, 1, 2, 3), Training(act_bytes=2))
    layer = layer_activation_bytes(2, 32, 64, 4, 1, 2, False, True)
    ops = 5 + 4 * 10 + 6  # every op of the forward, launched again (about twice) in the backward
    # 4 layers' kept activations written and read (2 bytes moved per byte) in each of 3 passes
    per_mb = 3 * (1e9 + 1e8) * 2 / 1e12 + 4 * 3 * 2 * layer / 1e11 + 3 * ops * 1e-4
    assert e.compute == pytest.approx(3 * per_mb)
    rc = estimate(f, h, Candidate(1, 1, 1, 2, 3, recompute=True), Training(act_bytes=2))
    # the checkpointed blocks run their forward again; the ends (embeddings, head and loss) do not
    assert rc.compute == pytest.approx(3 * (4 * 1e9 * 2 / 1e12 + 3 * 1e8 * 2 / 1e12 + 4 * 4 * 2 * layer / 1e11
                                            + (4 * 4 * 10 + 3 * (5 + 6)) * 1e-4))


def test_tp_comm_term():
    f, h = facts(), hw()
    e = estimate(f, h, Candidate(2, 1, 1, 2, 1), Training(act_bytes=2))
    each = 32 * 64 * 2 * 2  # (b·s·h) bf16 elements of one all-reduce
    one = 1e-5 + 2 * (1 / 2) * each / 1e10
    assert e.tp_comm == pytest.approx(16 * one)  # 8 forward + 8 backward
    rc = estimate(f, h, Candidate(2, 1, 1, 2, 1, recompute=True), Training(act_bytes=2))
    assert rc.tp_comm == pytest.approx(24 * one)  # the forward's again while recomputing


def test_pipeline_terms():
    f, h = facts(comm=False), hw()
    e = estimate(f, h, Candidate(1, 1, 2, 1, 4), Training(act_bytes=2))
    send = 1e-5 + 32 * 64 * 2 / 1e10
    assert e.pp_comm == pytest.approx(4 * 2 * send)
    assert e.pp_bubble == pytest.approx((2 - 1) / 4 * (e.compute + e.tp_comm + e.pp_comm))
    v2 = estimate(f, h, Candidate(1, 1, 2, 1, 4, v=2), Training(act_bytes=2))
    assert v2.pp_comm == pytest.approx(2 * e.pp_comm)
    assert v2.pp_bubble == pytest.approx((2 - 1) / (2 * 4) * (v2.compute + v2.tp_comm + v2.pp_comm))
    # the busier end: the last stage's 2 blocks and LM head (1e8 > 0 FLOPs of the first)
    assert e.compute == pytest.approx(4 * 3 * (0.5e9 + 1e8) / 1e12 + 4 * 2 * 3 * 2 * layer_activation_bytes(
        1, 32, 64, 4, 1, 2, False, True) / 1e11)


def test_pipeline_sends_with_sequence_parallelism_and_megatrons_scatter_gather():
    f, h = facts(comm=False), hw()
    full = estimate(f, h, Candidate(2, 1, 2, 1, 4), Training(act_bytes=2))
    hidden = 32 * 64 * 2  # (b, s, h) in bf16
    assert full.pp_comm == pytest.approx(4 * 2 * (1e-5 + hidden / 1e10))  # each tp rank its whole copy
    sp = estimate(f, h, Candidate(2, 1, 2, 1, 4, sp=True), Training(act_bytes=2))
    assert sp.pp_comm == pytest.approx(4 * 2 * (1e-5 + hidden / 2 / 1e10))  # its s/t positions
    # Megatron-LM's scatter/gather: 1/t across, all-gathered inside the receiving tp group
    sg = estimate(f, h, Candidate(2, 1, 2, 1, 4), Training(act_bytes=2, scatter_gather=True))
    assert sg.pp_comm == pytest.approx(4 * 2 * (1e-5 + hidden / 2 / 1e10 + 1e-5 + hidden / 2 / 1e10))
    assert estimate(f, h, Candidate(2, 1, 2, 1, 4, sp=True), Training(act_bytes=2, scatter_gather=True)).pp_comm \
        == pytest.approx(sp.pp_comm)  # already split: nothing to gather


def test_buffer_copies_at_the_measured_copy_rate():
    f = facts(comm=False, per_layer=10**7)
    grad = (500 + 4 * 10**7 + 300) * 4
    lay, tr = Candidate(1, 4, 1, 1, 1), Training(act_bytes=2)
    assumed = estimate(f, hw(), lay, tr)
    measured = estimate(f, hw(copy_bandwidth=2.5e10), lay, tr)
    assert hw().copy_rate == 1e11 and hw(copy_bandwidth=2.5e10).copy_rate == 2.5e10
    assert measured.dp_comm - assumed.dp_comm == pytest.approx(2 * grad * 2 * (1 / 2.5e10 - 1 / 1e11))


def test_terms_not_measured_on_the_priced_device_are_assumed():
    from autotp.search.assumed import assumed_terms

    f, lay, tr = facts(), Candidate(2, 2, 2, 1, 4), Training(act_bytes=2)
    preset = estimate(f, hw(), lay, tr)
    assert set(assumed_terms(hw(), preset)) == {k for k, v in preset.terms().items() if v}  # datasheet: all
    timed = tuple(Measured(k, n, Link(1e-5, 1e10)) for k, n in (("all_reduce", 2), ("send", 2)))
    profiled = hw(matmuls=((8, 8, 8, 1e12),), measured=timed, optimizer=1e-9, copy_bandwidth=5e10)
    assert assumed_terms(profiled, estimate(f, profiled, lay, tr)) == {}  # every term timed on this node
    no_copy = dataclasses.replace(profiled, copy_bandwidth=0.0)
    said = assumed_terms(no_copy, estimate(f, no_copy, lay, tr))
    assert list(said) == ["dp comm"] and "copy rate not measured" in said["dp comm"]
    # 2 per node: the tp 2 groups fit a node, the dp groups and the stage neighbours do not
    small = dataclasses.replace(profiled, gpus_per_node=2)
    said = assumed_terms(small, estimate(f, small, lay, tr))
    assert set(said) == {"dp comm", "pp comm"} and "across nodes" in said["dp comm"]
    sp = Candidate(2, 2, 2, 1, 4, sp=True)  # reduce-scatters and all-gathers over tp, never timed here
    assert "tp comm" in assumed_terms(profiled, estimate(f, profiled, sp, tr))


def test_the_json_labels_rejected_layouts_assumed_as_the_table_labels_ranked_ones():
    """`autotp plan --auto --json`: each rejected layout carries the terms that rest on numbers not measured on
    the device, as a ranked one does (a profile that timed this node's collectives: only what crosses nodes)."""
    from autotp.cli.plan_auto import Auto, to_dict
    from autotp.search.assumed import assumed_terms
    from autotp.search.auto import Rejected, Search

    f, tr = facts(), Training(act_bytes=2)
    timed = tuple(Measured(k, n, Link(1e-5, 1e10)) for k, n in (("all_reduce", 2), ("send", 2)))
    h = hw(matmuls=((8, 8, 8, 1e12),), measured=timed, optimizer=1e-9, copy_bandwidth=5e10, gpus_per_node=2)
    fits, over, wide = (estimate(f, h, lay, tr) for lay in (Candidate(2, 1, 1, 1, 1), Candidate(2, 2, 2, 1, 4),
                                                           Candidate(1, 1, 1, 1, 1)))
    rejected = (Rejected(over.candidate, "needs more", 1.0, over), Rejected(wide.candidate, "needs more", 2.0, wide))
    data = to_dict(Auto(f, h, Space(world=8, gpus_per_node=2, batch=4), tr, Search((fits,), rejected, 3)), 5)
    said = {r["label"]: r["assumed"] for r in data["rejected"]}
    assert said == {e.candidate.label(): assumed_terms(h, e, tr) for e in (over, wide)}
    # dp 2 over tp 2 ranks and the stage neighbours span the nodes of 2: assumed; a rank alone: nothing
    assert set(said[over.candidate.label()]) == {"dp comm", "pp comm"} and said[wide.candidate.label()] == {}
    assert data["ranked"][0]["assumed"] == assumed_terms(h, fits, tr)


def test_dp_comm_term_ddp_and_fsdp():
    f = facts(comm=False, per_layer=10**7)
    grad = (500 + 4 * 10**7 + 300) * 4
    buckets = math.ceil(grad / (25 * 2**20))
    copies = 2 * grad * 2 / 1e11  # into the buckets and back, each read and written
    slow = hw(intra=Link(1e-5, 1e8))  # a slow link: the all-reduce outlasts the backward
    e = estimate(f, slow, Candidate(1, 4, 1, 1, 1), Training(act_bytes=2))
    total = buckets * (1e-5 + 2 * 3 / 4 * grad / buckets / 1e8)
    backward = e.compute * 2 / 3
    assert total - backward > total / buckets
    assert e.dp_comm == pytest.approx(total - backward + copies)
    # a fast link: hidden behind the backward but for the last bucket
    fast = estimate(f, hw(intra=Link(1e-5, 1e13)), Candidate(1, 4, 1, 1, 1), Training(act_bytes=2))
    assert fast.dp_comm == pytest.approx(1e-5 + 2 * 3 / 4 * grad / buckets / 1e13 + copies)
    # collectives on the compute's own cores (gloo on a CPU): nothing hidden
    cpu = estimate(f, hw(intra=Link(1e-5, 1e13), overlap=False), Candidate(1, 4, 1, 1, 1), Training(act_bytes=2))
    assert cpu.dp_comm == pytest.approx(buckets * (1e-5 + 2 * 3 / 4 * grad / buckets / 1e13) + copies)
    # one bucket (a small model): nothing to overlap, the whole all-reduce waits for the backward
    small = facts(comm=False)
    one = estimate(small, slow, Candidate(1, 4, 1, 1, 1), Training(act_bytes=2))
    assert one.dp_comm == pytest.approx(1e-5 + 2 * 3 / 4 * (4800 * 4) / 1e8 + 2 * 4800 * 4 * 2 / 1e11)
    fs = estimate(f, slow, Candidate(1, 4, 1, 1, 1, fsdp=True), Training(act_bytes=2))
    units = 4 + 1
    gather = units * (1e-5 + 3 / 4 * grad / units / 1e8)
    scatter = gather
    fwd, bwd = e.compute / 3, e.compute * 2 / 3
    assert fs.dp_comm == pytest.approx(max(gather / units, gather - fwd)
                                       + max(gather / units, gather + scatter - bwd) + 3 * grad * 2 / 1e11)


def test_pipelined_fsdp_gathers_each_stage_once_per_step():
    """Pipelined, each stage is one FSDP unit kept gathered through the step (as autotp.pipeline runs it):
    one all-gather and one reduce-scatter of the stage per step whatever the micro-batches, neither hidden;
    the stage's weights gathered and its gradients unsharded on top of the sharded state."""
    f = facts(comm=False, per_layer=10**7)
    slow = hw(intra=Link(1e-5, 1e8))
    stage = (4 * 10**7 / 2 + 500) * 4  # bytes: half the blocks and the larger end (the embedding, 500)
    for m in (2, 4):
        e = estimate(f, slow, Candidate(1, 2, 2, 1, m, fsdp=True), Training(act_bytes=2))
        one = 1e-5 + 1 / 2 * stage / 1e8
        assert e.dp_comm == pytest.approx(2 * one + 2 * stage * 2 / 1e11)  # one copy out, one copy in
        ddp_state = estimate(f, slow, Candidate(1, 2, 2, 1, m), Training(act_bytes=2)).memory.state
        assert e.memory.state == pytest.approx(ddp_state / 2)
        logits, copies = 1 * 32 * 256 * (2 + 4), stage / 4 * 2  # autocast's bf16 copies of the gathered weights
        assert e.memory.other == pytest.approx(logits + copies + 2 * stage)


def test_fsdp_mixed_precision_gathers_16_bit_weights_and_makes_no_autocast_copies():
    """FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), as torchtitan runs it: the all-gathers
    carry half the bytes, the reduce-scatters the model's fp32, and no rank holds autocast copies of its
    weights (the gathered 16-bit weights are what the compute reads)."""
    f = facts(comm=False, per_layer=10**7)
    slow = hw(intra=Link(1e-5, 1e8), overlap=False)
    grad = (500 + 4 * 10**7 + 300) * 4
    units = 4 + 1
    plain = estimate(f, slow, Candidate(1, 4, 1, 1, 1, fsdp=True), Training(act_bytes=2))
    mixed = estimate(f, slow, Candidate(1, 4, 1, 1, 1, fsdp=True, fsdp_dtype="bf16"), Training(act_bytes=2))
    gather = units * (1e-5 + 3 / 4 * grad / 2 / units / 1e8)
    scatter = units * (1e-5 + 3 / 4 * grad / units / 1e8)
    assert mixed.dp_comm == pytest.approx(2 * gather + scatter + (2 * grad / 2 + grad) * 2 / 1e11)
    assert plain.dp_comm > mixed.dp_comm
    names = dict(mixed.memory.parts)
    assert "autocast weight copies" not in names and dict(plain.memory.parts)["autocast weight copies"] == grad / 2
    assert names["gathered blocks"] == pytest.approx(2 * 10**7 * 2)  # two blocks, 16-bit
    assert mixed.candidate.label() == "tp1 dp4·fsdp(bf16) pp1 mb1×1"
    # searched where activations are narrower than the parameters, never in the model's own dtype
    space = Space(world=4, gpus_per_node=4, batch=8)
    assert any(x.fsdp_dtype == "bf16" for x in candidates(f, space, mixed="bf16"))
    assert not any(x.fsdp_dtype for x in candidates(f, space))
    assert not any(e.candidate.fsdp_dtype for e in search(f, hw(), space, Training(act_bytes=4)).ranked)


def test_fsdp_keep_gathers_and_reduces_once_per_step():
    """Several micro-batches without a pipeline: FSDP per micro-batch gathers and reduce-scatters m times;
    kept gathered (FSDP2's reshard_after_backward off, gradient sync off until the last micro-batch) once per
    step, holding the weights gathered and the gradients unsharded."""
    f = facts(comm=False, per_layer=10**7)
    slow = hw(intra=Link(1e-5, 1e8), overlap=False)
    grad = (500 + 4 * 10**7 + 300) * 4
    per_mb = [estimate(f, slow, Candidate(1, 4, 1, 1, m, fsdp=True), Training(act_bytes=4)) for m in (2, 4)]
    assert per_mb[1].dp_comm == pytest.approx(2 * per_mb[0].dp_comm)
    kept = [estimate(f, slow, Candidate(1, 4, 1, 1, m, fsdp=True, keep=True), Training(act_bytes=4)) for m in (2, 4)]
    one = 1e-5 + 3 / 4 * grad / 1e8
    assert kept[0].dp_comm == pytest.approx(kept[1].dp_comm) == pytest.approx(2 * one + 2 * grad * 2 / 1e11)
    assert dict(kept[0].memory.parts)["gathered weights and unsharded gradients"] == 2 * grad
    space = Space(world=4, gpus_per_node=4, batch=8)
    every = list(candidates(f, space))
    assert all(x.fsdp and x.pp == 1 and x.microbatches > 1 for x in every if x.keep)
    assert any(x.keep for x in every) and not any(runnable(x) for x in every if x.keep)


def test_rejects_name_the_fastest_with_its_memory_terms():
    """The fastest layout memory rules out is named with the terms that rule it out; every reject carries
    its price."""
    f = facts(comm=False, per_layer=10**7)
    base = search(f, hw(), Space(world=4, gpus_per_node=4, batch=8, fsdp=(False,)))
    fastest = base.best  # the memory cap set under it: it and every faster layout is ruled out
    result = search(f, hw(memory_bytes=int(fastest.memory.total / 0.9 * 0.999)),
                    Space(world=4, gpus_per_node=4, batch=8, fsdp=(False,)))
    out = result.fastest_rejected()
    assert out is not None and out.estimate.tokens_per_device >= fastest.tokens_per_device * (1 - 1e-9)
    lines = explain(result)
    said = next(x for x in lines if x.startswith("the fastest layout ruled out"))
    assert out.candidate.label() in said and "state" in said and "autocast weight copies" in said
    assert out.to_dict()["estimate"]["memory"]["fits"] is False


def test_shared_devices_absorb_the_bubble():
    f = facts(comm=False)
    lay = Candidate(1, 1, 2, 1, 4)
    alone = estimate(f, hw(), lay, Training(act_bytes=2))
    shared = estimate(f, hw(share=2.0), lay, Training(act_bytes=2))
    assert alone.pp_bubble > 0 and shared.pp_bubble == 0
    four = estimate(f, hw(share=2.0), Candidate(1, 1, 4, 1, 4), Training(act_bytes=2))
    full = estimate(f, hw(), Candidate(1, 1, 4, 1, 4), Training(act_bytes=2))
    assert four.pp_bubble == pytest.approx(full.pp_bubble * (1 - 1 / 3))


def test_optimizer_and_memory_terms():
    f, h = facts(comm=False), hw()
    lay = Candidate(2, 2, 1, 2, 1)
    e = estimate(f, h, lay, Training(act_bytes=4))
    local = 500 // 2 + 4000 // 2 + 300 // 2
    assert e.optimizer == pytest.approx(2 * STATE_BYTES * local / 1e11)
    measured = estimate(f, hw(optimizer=5e-9), lay, Training(act_bytes=4))
    assert measured.optimizer == pytest.approx(5e-9 * local)
    assert e.memory.state == STATE_BYTES * local
    assert e.memory.activations == pytest.approx(4 * layer_activation_bytes(2, 32, 64, 4, 2, 4, False, True))
    assert e.memory.other == pytest.approx(2 * 32 * 256 / 2 * (4 + 4))  # the logits, no autocast copies
    fs = estimate(f, h, Candidate(2, 2, 1, 2, 1, fsdp=True), Training(act_bytes=4))
    assert fs.memory.state == STATE_BYTES * local / 2
    assert fs.memory.capacity == pytest.approx(0.9 * 100 * GB)


def test_recompute_keeps_layer_inputs_and_pipelines_keep_micro_batches_in_flight():
    f, h = facts(comm=False), hw()
    layer = layer_activation_bytes(1, 32, 64, 4, 1, 2, False, True)
    gpipe_like = estimate(f, h, Candidate(1, 1, 2, 1, 4), Training(act_bytes=2))  # 1F1B rank 0: min(m, p) = 2
    assert gpipe_like.memory.activations == pytest.approx(2 * 2 * layer)
    rc = estimate(f, h, Candidate(1, 1, 2, 1, 4, recompute=True), Training(act_bytes=2))
    assert rc.memory.activations == pytest.approx(2 * 2 * 32 * 64 * 2 + layer)


def test_context_parallel_terms():
    """cp 2: every rank computes, keeps and sends 1/2 of the tokens' work; per layer it gathers K and V twice
    (forward, backward) and hands dK and dV back; the gradients are summed over the pair once per backward."""
    f, h = facts(), hw(overhead=1e-4)
    one = estimate(f, h, Candidate(2, 1, 1, 2, 1), Training(act_bytes=2))
    two = estimate(f, h, Candidate(2, 1, 1, 2, 1, cp=2), Training(act_bytes=2))
    ring_ops = 3 * 1e-4 * 4 * 2 * 2  # 3 passes, 4 layers, 2 ops per ring step, 2 steps
    assert two.compute == pytest.approx(one.compute / 2 + 3 * 1e-4 * (5 + 4 * 10 + 6) / 2 + ring_ops)
    assert two.tp_comm < one.tp_comm and two.memory.activations == pytest.approx(one.memory.activations / 2)
    kv = 2 * 32 * (2 * 64) * 2 / 2  # b·s·(K and V of width h) bf16, each tp rank its half of the heads
    grads = (500 // 2 + 4000 // 2 + 300 // 2) * 4
    gather, scatter = (1e-5 + kv / 2 / 1e10), (1e-5 + kv / 2 / 1e10)
    assert two.cp_comm == pytest.approx(4 * (2 * gather + scatter) + (1e-5 + grads / 1e10) + 2 * grads * 2 / 1e11)
    assert one.cp_comm == 0 and two.step == pytest.approx(sum(two.terms().values()))
    # memory: the logits of half the tokens, one layer's gathered K and V (autocast's bf16 weight copies whole)
    copies = 2 * grads // 4
    assert two.memory.other == pytest.approx((one.memory.other - copies) / 2 + copies + kv)
    assert two.memory.state == one.memory.state  # the parameters are whole on every cp rank
    assert Candidate(2, 1, 1, 2, 1, cp=2).label() == "tp2 cp2 dp1 pp1 mb2×1" and Candidate(2, 1, 1, 2, 1, cp=2).world == 4
    # with FSDP the cp ranks shard the state with the dp ranks, and FSDP's reduce-scatter sums the gradients
    fs = estimate(f, h, Candidate(2, 1, 1, 2, 1, fsdp=True, cp=2), Training(act_bytes=2))
    assert fs.memory.state == two.memory.state / 2 and fs.dp_comm > 0
    assert fs.cp_comm == pytest.approx(4 * (2 * gather + scatter))  # the K/V gathers only


def test_context_parallel_where_nothing_else_can_split_a_long_sample():
    """One sample per step on 8 devices of 4 heads: without cp only tp 4 × pp 2 is left, and a pipeline of one
    micro-batch is not run; with cp the search finds layouts and explains the winner by its mesh."""
    f = facts(s=4096)
    space = Space(world=8, gpus_per_node=8, batch=1)
    without = search(f, hw(), Space(world=8, gpus_per_node=8, batch=1, context=False))
    assert without.best is None
    found = search(f, hw(), space, Training(act_bytes=2))
    assert found.best.candidate.cp > 1 and found.best.candidate.world == 8
    assert {e.candidate.cp for e in found.ranked} <= {2, 4, 8}
    assert any("cp" in line for line in explain(found))
    # a model whose attention cannot run as a ring (the reason the ranks would give) gets no cp layout, said
    refused = dataclasses.replace(f, cp_refused="context parallelism (cp 2) cannot run this forward: ALiBi")
    none = search(refused, hw(), space)
    assert none.best is None and any("context parallelism not considered: " in n and "ALiBi" in n for n in none.notes)
    # the sequence in 2·cp equal chunks: 4096 tokens allow cp 8, 40 tokens only cp 2 and 4 (not 8: 16 ∤ 40)
    short = dataclasses.replace(f, seq=40)
    assert {x.cp for x in candidates(short, space)} == {2, 4}


# -- the enumeration -----------------------------------------------------------------------------------------
def test_tp_sizes_stay_inside_a_node_and_divide_the_heads():
    assert tp_sizes(64, 8, 96) == [1, 2, 4, 8]
    assert tp_sizes(64, 8, 12) == [1, 2, 4]
    assert tp_sizes(1536, 8, 96) == [1, 2, 4, 8]  # 6 divides 1536 and 96 but not a node of 8
    assert tp_sizes(12, 4, None) == [1, 2, 4]


def test_every_layout_respects_the_rules():
    f = facts(layers=4, heads=4)
    space = Space(world=8, gpus_per_node=4, batch=16)
    seen = list(candidates(f, space))
    assert seen
    for lay in seen:
        assert lay.tp * lay.cp * lay.dp * lay.pp == lay.world == 8 and 4 % lay.tp == 0
        assert f.layers % lay.pp == 0
        # context parallelism: 2·cp chunks of the 32 tokens, with tp (sequence parallel or not), data
        # parallelism and pipeline stages (as autotp runs it)
        assert lay.cp == 1 or f.seq % (2 * lay.cp) == 0
        assert lay.batch == 16
        assert lay.pp == 1 or lay.microbatches >= lay.pp
        assert lay.v == 1 or (f.layers % (lay.pp * lay.v) == 0 and lay.microbatches % lay.pp == 0)
        assert lay.dp * lay.cp > 1 or not lay.fsdp  # FSDP over the dp and cp ranks
        assert lay.tp > 1 or not lay.sp
        assert lay.micro_batch <= space.max_micro_batch
    assert {(x.tp, x.pp) for x in seen} == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2)}
    assert {(x.tp, x.cp) for x in seen if x.cp > 1} == {(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)}
    # a batch the data-parallel size does not divide: no such layout
    odd = list(candidates(f, Space(world=8, gpus_per_node=8, batch=2)))
    assert all(2 % x.dp == 0 for x in odd) and {x.dp for x in odd} <= {1, 2}
    # per replica: each replica's batch is fixed, so every dp is allowed
    per = list(candidates(f, Space(world=8, gpus_per_node=8, batch=3, per_replica=True)))
    assert {x.dp for x in per} >= {8, 4} and all(x.micro_batch * x.microbatches == 3 for x in per)


def test_a_fixed_micro_batch_leaves_the_search_the_meshes():
    """Space(micro_batch=b), Megatron-LM's --micro-batch-size: every layout runs micro-batches of b (the
    micro-batches per step follow from dp), where dp leaves each replica a multiple of b; bad values refused."""
    f = facts()
    fixed = list(candidates(f, Space(world=8, gpus_per_node=8, batch=16, micro_batch=2)))
    free = list(candidates(f, Space(world=8, gpus_per_node=8, batch=16)))
    assert fixed and {x.micro_batch for x in fixed} == {2} and {x.micro_batch for x in free} > {2}
    assert all(x.dp * x.micro_batch * x.microbatches == 16 for x in fixed)
    assert {(x.tp, x.pp, x.dp) for x in fixed} == {(x.tp, x.pp, x.dp) for x in free if 16 // x.dp % 2 == 0}
    with pytest.raises(ValueError, match="micro_batch must be a positive int or None, got 0"):
        Space(world=8, gpus_per_node=8, batch=16, micro_batch=0)


def test_runnable_layouts_are_what_autotp_shard_runs():
    assert supported(Candidate(2, 2, 1, 1, 1, fsdp=True, sp=True)) and supported(Candidate(2, 1, 2, 1, 2, sp=True))
    assert supported(Candidate(1, 2, 2, 1, 2, fsdp=True)) and supported(Candidate(1, 2, 2, 1, 4, v=2, fsdp=True))
    assert not runnable(Candidate(1, 1, 1, 1, 1, recompute=True)) and not runnable(Candidate(1, 2, 1, 1, 2))
    f = facts()
    assert all(runnable(x) for x in candidates(f, Space(world=4, gpus_per_node=4, batch=8, runnable=True)))
    # every layout priced is one autotp runs; a pipeline with sequence parallelism among them
    every = list(candidates(f, Space(world=8, gpus_per_node=4, batch=8)))
    assert every and all(supported(x) for x in every) and any(x.pp > 1 and x.sp for x in every)
    assert any(x.pp > 1 and x.fsdp for x in every)


def test_memory_rejects_with_the_amount_over():
    f = facts()
    tiny = hw(memory_bytes=200_000)
    result = search(f, tiny, Space(world=4, gpus_per_node=4, batch=8))
    assert result.rejected
    for r in result.rejected:
        assert r.over > 0 and "over by" in r.reason and "GiB" in r.reason
    assert all(e.memory.fits for e in result.ranked)
    none = search(f, hw(memory_bytes=1), Space(world=4, gpus_per_node=4, batch=8))
    assert not none.ranked and "no layout fits" in none.notes[0]


def test_ranked_by_throughput_and_explained():
    f = facts()
    result = search(f, hw(intra=Link(1e-3, 1e8)), Space(world=4, gpus_per_node=4, batch=8))
    tps = [e.tokens_per_device for e in result.ranked]
    assert tps == sorted(tps, reverse=True)
    why = explain(result)
    assert why and "beats the best" in why[0]


def test_slow_links_push_the_choice_away_from_tensor_parallelism():
    f = facts()
    fast = search(f, hw(intra=Link(0, 1e15)), Space(world=4, gpus_per_node=4, batch=4)).best
    slow = search(f, hw(intra=Link(1e-2, 1e6)), Space(world=4, gpus_per_node=4, batch=4)).best
    assert slow.candidate.tp == 1 and slow.step > fast.step


# -- facts from a real capture, and the command ----------------------------------------------------------
def test_facts_of_the_example_gpt():
    import torch

    from autotp.capture.modelfile import load_model_file
    from autotp.search.model_costs import capture_costs

    mf = load_model_file("examples/nanogpt.py")
    with torch.device("meta"):
        net = mf.build()
    args, kwargs = mf.example_batch()
    b, s = args[0].shape
    f = capture_costs(net, args, kwargs, [1, 2, 4], b, s)
    h, L = f.hidden, f.layers
    assert (L, h, f.heads, f.vocab, f.seq) == (2, 64, 4, 256, 32)
    # per sample: 24·s·h² of linears and 4·s²·h of attention per block; the LM head 2·s·h·V
    assert f.flops[BLOCKS] == L * (24 * s * h * h + 4 * s * s * h)
    assert f.flops[LAST] == 2 * s * h * 256
    assert not f.fused_attention and sorted(f.tps) == [1, 2, 4]  # its attention: matmul, softmax, matmul
    t2 = f.tp(2)
    fwd = [c for c in t2.comm[BLOCKS] if c.direction == "forward"]
    assert sum(c.count for c in fwd) == 2 * L and sum(c.elements for c in fwd) == 2 * L * s * h
    assert t2.params[BLOCKS] < f.tp(1).params[BLOCKS] and math.isclose(t2.flops_split, 1.0)
    # its written-out attention is proven causal: it runs as a ring, gathering K and V of h each per token
    assert f.cp_refused is None and (f.kv_width, f.kv_heads) == (2 * h, 4)


runner = CliRunner()


def test_plan_auto_command(tmp_path):
    out = tmp_path / "auto.json"
    r = runner.invoke(app, ["plan", "examples/nanogpt.py", "--auto", "--world-size", "4", "--gpu", "a100",
                            "--top", "3", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "best:" in r.output and "beats the best" in r.output
    data = json.loads(out.read_text())
    assert len(data["ranked"]) == 3 and data["ranked"][0]["layout"]["tp"] * data["ranked"][0]["layout"]["dp"] \
        * data["ranked"][0]["layout"]["pp"] == 4


def test_plan_auto_prices_context_parallelism(tmp_path):
    """One sequence per step on 4 devices: the data-parallel layouts are gone, and the cp layouts (the example's
    written-out attention runs as a ring) are priced with their own term."""
    out = tmp_path / "auto.json"
    r = runner.invoke(app, ["plan", "examples/nanogpt.py", "--auto", "--world-size", "4", "--gpu", "a100",
                            "--global-batch", "1", "--json", str(out)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    ranked = json.loads(out.read_text())["ranked"]
    meshes = {(e["layout"]["tp"], e["layout"]["cp"]) for e in ranked}
    assert meshes == {(4, 1), (2, 2), (1, 4)} and all(e["layout"]["dp"] == 1 for e in ranked)
    assert all((e["cp_comm_s"] > 0) == (e["layout"]["cp"] > 1) for e in ranked)
    assert "cp comm" in r.output and "tp1 cp4 dp1 pp1" in r.output


@pytest.mark.parametrize("argv, message", [
    (["--auto", "--gpu", "a100"], "--world-size"),
    (["--auto", "--world-size", "4", "--gpu", "a100", "--tp", "2"], "drop --tp"),
    (["--auto", "--world-size", "4", "--gpu", "tpu9"], "neither a preset"),
    (["--auto", "--world-size", "0", "--gpu", "a100"], "--world-size must be >= 1"),
    ([], "give --tp N, or --auto"),
])
def test_plan_auto_bad_flags(argv, message):
    r = runner.invoke(app, ["plan", "examples/nanogpt.py", *argv])
    assert r.exit_code == 2
    assert message in " ".join(r.output.split())


@pytest.mark.slow
def test_shard_auto_runs_the_layout_it_chose(tmp_path):
    """`autotp shard --auto`: the chosen layout is printed before the ranks start, then run and verified."""
    from readme import readme_folder, run_readme

    # the README's command as written there (claimed: tests/e2e/test_readme.py runs it here only), one step
    r = run_readme("autotp shard examples/nanogpt.py --auto --world-size 4", readme_folder(tmp_path / "readme"),
                   "--gpu", "a100", "--steps", "1", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--auto: tp" in r.stderr and "predicted" in r.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    label = r.stderr.split("--auto:")[1].split(" on ")[0].split()  # "tp1", ("cp2",) "dp2", "pp1", "mb..."
    chosen = {part[:2]: part[2:].split("·")[0] for part in label if part[:2] in ("tp", "cp", "dp", "pp")}
    assert (chosen["tp"], chosen["dp"]) == (str(summary["tp"]), str(summary["dp"]))
    assert chosen.get("cp", "1") == str(summary.get("cp", 1))


@pytest.mark.parametrize("argv, message", [
    (["--auto", "--gpu", "a100"], "--auto needs --world-size"),
    (["--auto", "--world-size", "2", "--tp", "2", "--gpu", "a100"], "drop --tp"),
    (["--auto", "--world-size", "4", "--cp", "2", "--gpu", "a100"], "drop --cp"),
    (["--world-size", "3", "--tp", "2"], "tp 2 × --dp 1 × --pp 1 = 2 ranks, not the --world-size 3"),
    (["--tp", "1", "--dp", "2", "--fsdp", "--fsdp-param-dtype", "bf16", "--verify"], "drop --verify"),
    ([], "give --tp N, or --auto"),
])
def test_shard_auto_bad_flags(argv, message):
    r = runner.invoke(app, ["shard", "examples/nanogpt.py", *argv])
    assert r.exit_code == 2
    assert message in " ".join(r.output.split())


def test_command_spells_the_layout_as_autotp_shard_runs_it():
    """The best layout's command line: autotp shard's --dp counts one node's replicas, FSDP's mixed precision
    and the pipeline's knobs are flags, and what the script does (accumulation, recomputation) is said."""
    from autotp.cli.plan_command import command

    space = Space(world=64, gpus_per_node=8, batch=64)
    lay = Candidate(8, 8, 1, 1, 1, fsdp=True, sp=True, recompute=True, fsdp_dtype="bf16")
    cmd = command("llama70b.py", lay, space)
    assert cmd.line.startswith("autotp shard llama70b.py --tp 8 --dp 1 --fsdp --fsdp-param-dtype bf16 "
                               "--sequence-parallel --nnodes 8")
    assert any("checkpointing" in n for n in cmd.notes)
    piped = command("m.py", Candidate(2, 2, 4, 1, 16, v=2), Space(world=16, gpus_per_node=8, batch=32))
    assert "--tp 2 --dp 1 --pp 4 --microbatches 16 --virtual-stages 2 --schedule Interleaved1F1B" in piped.line
    kept = command("m.py", Candidate(1, 8, 1, 2, 4, fsdp=True, keep=True), Space(world=8, gpus_per_node=8, batch=64))
    assert "--nnodes" not in kept.line and any("set_requires_gradient_sync(False)" in n for n in kept.notes)
    # replicas the nodes do not take in equal shares: --dp counts them all, --world-size says so
    odd = command("m.py", Candidate(4, 3, 4, 1, 4), Space(world=48, gpus_per_node=8, batch=12))
    assert "--tp 4 --dp 3 --pp 4 --microbatches 4 --world-size 48 --nnodes 6 --node-rank R" in odd.line
    assert any("--dp 3 counts every node's replicas" in n and "4 pipeline stages sit on different nodes" in n
               for n in odd.notes)
    # the model file's example batch against the replica's sequences per step: said where they differ
    assert piped.notes[-1].endswith("example_batch() sets it")
    short = command("m.py", Candidate(2, 2, 4, 1, 16, v=2), Space(world=16, gpus_per_node=8, batch=32), example_rows=1)
    assert short.notes[-1].endswith("example_batch() sets it, and holds 1 now: make it return 16")
    same = command("m.py", Candidate(2, 2, 4, 1, 16, v=2), Space(world=16, gpus_per_node=8, batch=32), example_rows=16)
    assert same.notes[-1].endswith("example_batch() returns them")
    straddling = command("m.py", Candidate(8, 2, 1, 1, 1), Space(world=16, gpus_per_node=4, batch=2))
    assert straddling.line is None and "tp (8) exceeds gpus per node (4)" in straddling.notes[0]


def test_the_best_layout_is_spelled_and_the_fastest_spelled_one_only_where_it_is_not():
    """A pipeline spanning nodes is spelled with --world-size (--dp the whole data-parallel size), so the best
    layout has its own command line; the fastest layout that has one is printed beside it only for a best that
    autotp shard cannot lay out (a tp group straddling two nodes)."""
    from autotp.cli.plan_auto import Auto, _spelled_dict, spelled_best, to_dict
    from autotp.search.auto import Search

    f, tr = facts(), Training(act_bytes=2)
    across, spelled = (estimate(f, hw(), lay, tr) for lay in (Candidate(4, 1, 4, 1, 4), Candidate(2, 2, 4, 1, 2)))
    space = Space(world=16, gpus_per_node=8, batch=4)
    auto = Auto(f, hw(), space, tr, Search((across, spelled), (), 2), "m.py")
    est, cmd = spelled_best(auto)
    assert est is across and cmd.line.startswith("autotp shard m.py --tp 4 --dp 1 --pp 4 --microbatches 4 "
                                                 "--world-size 16 --nnodes 2")
    assert _spelled_dict(auto) is None and to_dict(auto, 2)["command"]["line"] == cmd.line
    # tp 4 on nodes of 2 (a made-up search: the search itself keeps tp within a node)
    small = Space(world=16, gpus_per_node=2, batch=4)
    fallback = Auto(f, hw(), small, tr, Search((across, spelled), (), 2), "m.py")
    assert spelled_best(fallback)[0] is spelled and _spelled_dict(fallback)["label"] == spelled.candidate.label()


@pytest.mark.extended
def test_a_pipeline_across_nodes_reads_back_as_the_layout(tmp_path):
    """The --world-size spelling (--dp every node's replicas, stages on different nodes) read back by `autotp
    plan` with the command's own flags (all but the rendezvous's): the same sizes, nodes, pipeline, FSDP's gather
    dtype and sequence parallelism. Extended: a pipeline plan takes seconds on 2 cores."""
    from autotp.cli.plan_command import command

    lay = Candidate(2, 2, 2, 1, 4, fsdp=True, sp=True, fsdp_dtype="bf16")
    line = command("examples/nanogpt.py", lay, Space(world=8, gpus_per_node=2, batch=4)).line
    assert "--world-size 8 --nnodes 4" in line
    out = tmp_path / "plan.json"
    r = runner.invoke(app, [*plan_argv(line), "--json", str(out)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert_plans(json.loads(out.read_text()), r.output, lay, 8, 2)


@pytest.mark.extended
def test_the_70b_search_best_row_is_the_command_it_prints(tmp_path):
    """Llama-shaped 70B on 64 H100s at global batch 256 (benchmarks/results/llama70b_auto.md): the best row's
    own command (a pipeline over nodes, with --world-size), no fallback, and `autotp plan` of that command as
    printed (the model file's example batch is the replica's 64 sequences the note names, which autotp shard's
    check of the micro-batches accepts) on the meta model plans that layout.
    Extended: the search and the plan capture 80 blocks (about 40 s of CPU)."""
    from autotp.capture.modelfile import load_model_file
    from autotp.cli.shard import _check_batch

    model = os.path.join(ROOT, "benchmarks", "llama70b.py")
    found = tmp_path / "auto.json"
    r = runner.invoke(app, ["plan", model, "--auto", "--world-size", "64", "--gpus-per-node", "8", "--gpu", "h100",
                            "--global-batch", "256", "--top", "1", "--json", str(found)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    data = json.loads(found.read_text())
    lay = Candidate(**data["ranked"][0]["layout"])
    line = data["command"]["line"]
    assert data["spelled"] is None and "fastest layout autotp shard spells" not in r.output
    assert f"run it: {line}" in " ".join(r.output.split())
    assert "--world-size 64 --nnodes 8" in line and lay.pp > 1 and lay.dp % 8  # stages on different nodes
    per_replica = lay.micro_batch * lay.microbatches
    assert f"trains on {per_replica} sequences per step" in " ".join(r.output.split())
    assert any(n.endswith("example_batch() returns them") for n in data["command"]["notes"])
    mf = load_model_file(model)
    args, kwargs = mf.example_batch()
    assert args[0].shape[0] == per_replica
    _check_batch(mf, args, kwargs, lay.microbatches)  # autotp shard's own check of --microbatches
    out = tmp_path / "plan.json"
    r = runner.invoke(app, [*plan_argv(line), "--json", str(out)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert_plans(json.loads(out.read_text()), r.output, lay, 64, 8)


@pytest.mark.parametrize("argv, message", [
    (["--tp", "2", "--dp", "2", "--world-size", "4", "--nnodes", "3"], "the 4 ranks do not divide into 3 equal nodes"),
    (["--tp", "2", "--dp", "2", "--nnodes", "2", "--gpus-per-node", "2"],
     "--gpus-per-node 2 and --nnodes 2 disagree: 2 nodes of 8 ranks hold 4 each"),  # per-node --dp: world 8
])
def test_plan_reads_nnodes_as_shard_does_and_refuses_what_does_not_add_up(argv, message):
    r = runner.invoke(app, ["plan", "examples/nanogpt.py", *argv], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and message in " ".join(r.output.split())


def plan_argv(line: str) -> list[str]:
    """``autotp plan``'s arguments for an ``autotp shard`` command line: the same model and flags, less the
    rendezvous's (--node-rank, --master-addr, --master-port and their values)."""
    argv = line.split()[1:]  # "shard", the model, its flags
    launch_only = {"--node-rank", "--master-addr", "--master-port"}
    kept = [x for i, x in enumerate(argv) if x not in launch_only and argv[i - 1] not in launch_only]
    return ["plan", *kept[1:]]


def assert_plans(data: dict, output: str, lay: Candidate, world: int, per_node: int) -> None:
    """`autotp plan --json`'s output is ``lay`` on ``world`` ranks, ``per_node`` to a node."""
    assert (data["world"]["tp"], data["world"]["dp"], data["world"]["pp"], data["world"].get("cp", 1)) == \
        (lay.tp, lay.dp, lay.pp, lay.cp)
    assert (data["world"]["world_size"], data["world"]["gpus_per_node"]) == (world, per_node)
    if lay.pp > 1:
        pipe = data["pipeline"]
        assert (pipe["virtual_stages"], pipe["microbatches"], pipe["micro_batch"], pipe["schedule"]) == \
            (lay.v, lay.microbatches, lay.micro_batch, lay.schedule)
    if lay.fsdp:
        said = " ".join(output.split())
        assert "fsdp" in data or f"one FSDP2 unit over dp {lay.dp}" in said
    if lay.fsdp_dtype:
        assert data["fsdp_param_dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[lay.fsdp_dtype]
    assert (data["plan"]["sequence"] is not None) == lay.sp


def test_the_chosen_command_plans_the_same_layout(tmp_path):
    """`autotp plan` of the command printed for a layout (autotp shard's per-node --dp and --nnodes read back as
    the whole dp) plans that layout: its sizes, FSDP and FSDP's gather dtype, sequence parallelism."""
    from autotp.cli.plan_command import command

    lay = Candidate(2, 8, 1, 1, 1, fsdp=True, sp=True, fsdp_dtype="bf16")
    line = command("examples/nanogpt.py", lay, Space(world=16, gpus_per_node=8, batch=8)).line
    argv = line.split()[1:]  # "shard", the model, its flags
    nnodes = int(argv[argv.index("--nnodes") + 1])
    argv = [x for x in argv[:argv.index("--nnodes")]]
    argv[argv.index("--dp") + 1] = str(int(argv[argv.index("--dp") + 1]) * nnodes)
    out = tmp_path / "plan.json"
    r = runner.invoke(app, ["plan", *argv[1:], "--world-size", "16", "--gpus-per-node", "8", "--json", str(out)],
                      env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert (data["world"]["tp"], data["world"]["dp"], data["world"]["pp"]) == (lay.tp, lay.dp, lay.pp)
    assert "fsdp" in data and data["fsdp_param_dtype"] == "bfloat16"
    assert data["plan"]["sequence"] is not None  # sequence parallelism planned
    assert "gathered and computed in bfloat16" in r.output
    bad = runner.invoke(app, ["plan", "examples/nanogpt.py", "--tp", "2", "--fsdp-param-dtype", "bf16"])
    assert bad.exit_code == 2 and "goes with --fsdp" in " ".join(bad.output.split())


def test_matmul_rate_falls_with_fewer_rows_and_a_narrower_model():
    """The presets' matmul curve: matmul_flops · M/(M + M0) · h/(h + h0); a profile without it runs every
    matmul at matmul_flops. The compute term follows the micro-batch's rows."""
    h = hw(matmul_tokens=300, matmul_width=840)
    assert h.matmul_rate(2048, 4096) == pytest.approx(1e12 * 2048 / 2348 * 4096 / 4936)
    assert hw().matmul_rate(1, 1) == 1e12
    assert A100.matmul_rate(2048, 4096) == pytest.approx(0.579 * A100.peak_flops, rel=1e-3)
    f = facts(comm=False)
    one = estimate(f, h, Candidate(1, 1, 1, 1, 8), Training(act_bytes=4))
    eight = estimate(f, h, Candidate(1, 1, 1, 8, 1), Training(act_bytes=4))
    assert one.compute > eight.compute  # the same FLOPs in micro-batches of 32 rows, not 256


def test_ddp_after_the_backward_hides_nothing():
    """Training(ddp_overlap=False): the all-reduce waits for the backward (Megatron-LM's 2021 loop)."""
    f = facts(comm=False, per_layer=10**7)
    fast = hw(intra=Link(1e-5, 1e13))
    grad = (500 + 4 * 10**7 + 300) * 4
    buckets = math.ceil(grad / (25 * 2**20))
    after = estimate(f, fast, Candidate(1, 4, 1, 1, 1), Training(act_bytes=2, ddp_overlap=False))
    assert after.dp_comm == pytest.approx(buckets * (1e-5 + 2 * 3 / 4 * grad / buckets / 1e13) + 2 * grad * 2 / 1e11)
