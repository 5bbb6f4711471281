"""Context parallelism end to end on a captured forward: each rank runs its head-tail chunk of the sequence,
attention as torch's ring, positions and the loss global; exact against one device."""
from __future__ import annotations

import pytest

import context_models
from context_workers import (context_compile, context_dropout, context_fsdp_parity, context_parities,
                             context_sampling, context_script_parity, expert_parity, parallelize_parity,
                             sequence_parity)
from ranks import Launches

# every spelling at cp 2; at cp 4 one of each kind of attention (written out, SDPA with a mask, einsum + rotary)
AT = {2: ["nanogpt_example", "hf_llama", "rope_interleaved", "baddbmm", *context_models.RUNS],
      4: ["nanogpt_example", "hf_llama", "einsum_rope"]}
TP2 = ["nanogpt_example", "hf_llama", "einsum_rope"]
# cp 2 × tp 2 with expert parallelism: experts read by W[ids] per slot (each token repeated per slot)
EXPERTS = ["moe:gathered_bmm"]
SP = ["nanogpt_example", "hf_llama"]  # cp 2 × tp 2 with sequence parallelism: written-out and SDPA attention
# scores no ring computes, run with their keys gathered: ALiBi, soft-capping, a sliding window, two spellings
# each at cp 2 (pattern_models' sequence of 12 takes cp 2 only), and Hugging Face's Gemma-2 (eager attention:
# soft-capped scores, a sliding window every other layer, one mask made for every layer); context_models' at
# cp 4; cp 2 × tp 2 (at 4 ranks a mask per layer and SDPA's with a padding mask; the others in the extended run)
KEYED = {2: ["alibi", "softcap", *context_models.KEYED, "hf_gemma2", "hf_llama_padded"],
         4: ["window", "hf_llama_padded"]}
KEYED_TP2 = ["softcap_where", "hf_llama_padded"]
# the 4-rank jobs of the extended run (the default 4-rank launch: FSDP over cp 2 × tp 2, which composes all three;
# `autotp shard --tp 2 --cp 2` of tests/cli/test_context_cli.py runs cp 2 × tp 2 by the command line)
AT_4_EXTENDED = ("graph", "parallelize", "keyed", "keyed_tp2", "dropout", "fsdp", "hsdp", "cp2_tp2_sp", "experts",
                 "cp2_tp2")
# at cp 2: the keyed spellings and the sampling loop in the extended run too
AT_2_EXTENDED = ("keyed", "sampling")
KEYED_REST = {(4, 1): ["alibi_abs", "softcap_where", "shared_window", "sdpa_window"], (2, 2): ["alibi", "sdpa_window"]}


def test_sequence_parallelism_needs_tp_times_cp_to_divide_the_length():
    """Under cp the tp ranks split the cp chunk (s/cp), not the sequence: a length of 12 at tp 4 × cp 2 is a
    multiple of tp and of 2·cp, yet its chunk of 6 is not one of tp; such a call runs without sequence
    parallelism. A call run whole on every cp rank (cp 1 here) needs tp only."""
    from autotp.parallel.parallelize import sequence_divisor

    assert sequence_divisor(4, 2) == 8 and 12 % sequence_divisor(4, 2) and not 12 % 4 and not 12 % (2 * 2)
    assert not 16 % sequence_divisor(4, 2) and not 12 % sequence_divisor(4, 1) and sequence_divisor(2, 1) == 2


@pytest.fixture(scope="module")
def runs() -> Launches:
    """Both tests' jobs in one launch per cp."""
    jobs = {cp: {"graph": (context_parities, 3, 32), "parallelize": (parallelize_parity, AT[cp])} for cp in AT}
    jobs[4]["cp2_tp2"] = (parallelize_parity, TP2, 3, 2)  # 4 ranks: cp 2 × tp 2
    jobs[4]["cp2_tp2_sp"] = (sequence_parity, SP, 3, 2)  # and sequence parallelism inside each cp chunk
    for cp in KEYED:
        jobs[cp]["keyed"] = (parallelize_parity, KEYED[cp])
    jobs[4]["keyed_tp2"] = (parallelize_parity, KEYED_TP2, 3, 2)
    rest = {"keyed rest": (parallelize_parity, KEYED_REST[4, 1]), "keyed_tp2 rest": (parallelize_parity, KEYED_REST[2, 2], 3, 2)}
    rest2 = {"compile inductor": (context_compile, ["nanogpt_example"], 3, "inductor")}
    jobs[2]["dropout"], jobs[4]["dropout"] = (context_dropout, 1), (context_dropout, 2)  # cp 2; cp 2 × tp 2
    jobs[2]["script"] = (context_script_parity, 3)
    jobs[2]["sampling"] = (context_sampling,)
    # compile: AOTAutograd's trace of forward and backward here, Inductor's code in the extended run
    jobs[2]["compile"] = (context_compile, ["nanogpt_example"], 3, "aot_eager")
    jobs[4]["fsdp"] = (context_fsdp_parity, ["nanogpt_example", "hf_llama"], 1)  # dp 2 × cp 2
    jobs[4]["fsdp_tp2"] = (context_fsdp_parity, ["nanogpt_example"], 2)  # cp 2 × tp 2
    jobs[4]["hsdp"] = (context_fsdp_parity, ["nanogpt_example"], 1, 3, 2)  # 2 replicas × (dp_shard 1 · cp 2)
    jobs[4]["experts"] = (expert_parity, EXPERTS, 3, 2)  # cp 2 × tp 2, E/tp whole experts per tp rank
    # CI's time: the default 4-rank launch runs two pairings (cp 2 × tp 2, FSDP over cp 2 × tp 2); cp 4, the keyed
    # spellings, dropout at cp 2 × tp 2, sequence parallelism and experts inside the chunks, FSDP over dp × cp,
    # HSDP and the sampling loop run in the extended run
    rest.update({name: jobs[4].pop(name) for name in AT_4_EXTENDED})
    rest2.update({name: jobs[2].pop(name) for name in AT_2_EXTENDED})
    return Launches(jobs, extended={4: rest, 2: rest2}, reuse_captures=True)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_context_parallel_training_matches_one_device(runs, cp):
    """nanoGPT (SDPA, causal, learned positions) at cp 2 and 4: the loss, the gathered logits, the summed
    parameter gradients and 3 AdamW steps within 1e-5 of one device (fp32), with and without ignored
    targets. Collectives of a step: per layer one K/V all-gather forward, one all-gather and cp
    all-to-alls backward; the loss's sum and count (two all-reduces); the logits' gather; backward, one
    all-reduce of every parameter's gradient, flattened together."""
    results = runs(cp, "graph")
    for ignore in (False, True):
        for rank, by_case in results.items():
            r = by_case[ignore]
            assert max(r["errors"].values()) <= 1e-5, (cp, ignore, rank, r["errors"])
            plan = r["plan"]
            assert len(plan.attention) == 2 and len(plan.positions) == 1 and len(plan.losses) == 1
            kinds = [c[0] for c in r["calls"]]
            assert kinds.count("all_to_all_single") == 2 * cp, kinds
            assert kinds.count("all_reduce") == 3, kinds  # the loss's sum and count, the gradients



@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("cp, tp, rest", [(2, 1, False), pytest.param(4, 1, False, marks=pytest.mark.extended),
                                          pytest.param(2, 2, False, marks=pytest.mark.extended),
                                          *(pytest.param(cp, tp, True, marks=pytest.mark.extended) for cp, tp in KEYED_REST)])
def test_scores_no_ring_computes_train_exactly_with_their_keys_gathered(runs, cp, tp, rest):
    """Attention written out with scores a ring cannot compute — ALiBi (a slopes buffer times distances; -|i−j|
    with slopes from a list), tanh soft-capping (Gemma-2's; with methods and a ``where`` mask), a sliding-window
    mask (one per layer, one for all layers, SDPA's additive mask), Gemma-2's, and Hugging Face Llama's SDPA
    given a padding mask — runs as written on the chunk's query rows over every key: 3 AdamW steps within 1e-5 of one device
    at cp 2 and 4 and cp 2 × tp 2. Per layer K and V are all-gathered once forward and their gradients
    reduce-scattered once backward; no ring (no all-to-all)."""
    kinds = KEYED_REST[cp, tp] if rest else KEYED[cp] if tp == 1 else KEYED_TP2
    part = ("keyed" if tp == 1 else "keyed_tp2") + (" rest" if rest else "")
    for rank, by_kind in runs(cp * tp, part).items():
        assert list(by_kind) == kinds
        for kind, r in by_kind.items():
            assert max(r["errors"].values()) <= 1e-5, (cp, tp, kind, rank, r["errors"])
            ctx = r["context"]
            layers = len(ctx.keyed)
            assert layers >= 2 and not ctx.attention, (kind, ctx)
            kinds_ = [c[0] for c in r["calls"]]
            assert kinds_.count("all_gather") == 2 * layers == kinds_.count("reduce_scatter"), (kind, kinds_)
            assert "all_to_all_single" not in kinds_, (kind, kinds_)
            if tp == 1:  # the loss's sum and count, and every parameter gradient in one bucket
                assert kinds_.count("all_reduce") == 3, (kind, kinds_)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_parallelize_context_parallel_trains_every_causal_spelling_exactly(runs, cp):
    """``autotp.parallelize(model, context_parallel=cp)``: attention written out by hand (examples/nanogpt.py,
    a mask from a buffer, ``where``, a very negative bias, einsum with rotary tables read up to the length,
    baddbmm and bmm with the heads folded into the batch),
    Hugging Face Llama's SDPA with a mask made from positions (proven causal) and its labels shifted inside
    the loss (the shift computed on the whole labels): 3 AdamW steps within 1e-5 of one device. A step that
    reads only the loss gathers no logits: its all-gathers are the rings' K/V only (one per layer forward,
    one backward), and one all-reduce sums every gradient. A sequence length 2·cp does not divide is
    refused, naming the numbers."""
    for rank, by_kind in runs(cp, "parallelize").items():
        assert list(by_kind) == AT[cp]
        for kind, r in by_kind.items():
            assert max(r["errors"].values()) <= 1e-5, (cp, kind, rank, r["errors"])
            ctx = r["context"]
            layers = len(ctx.attention)
            assert layers >= 2 and all(a.is_causal for a in ctx.attention), (kind, ctx.attention)
            assert all(a.folded for a in ctx.attention) == (kind == "baddbmm"), (kind, ctx.attention)
            gathers = [c for c in r["calls"] if c[0] == "all_gather"]
            assert len(gathers) == 2 * layers, (kind, gathers)  # K/V: forward and backward, per layer
            kinds = [c[0] for c in r["calls"]]
            assert kinds.count("all_to_all_single") == cp * layers, (kind, kinds)
            # the loss's sum and count, and every parameter gradient in one bucket
            assert kinds.count("all_reduce") == 3, (kind, kinds)
            assert f"by 2·cp = {2 * cp}" in r["refused"] and f"sequence length {2 * cp + 2}" in r["refused"], r["refused"]


@pytest.mark.slow
@pytest.mark.extended
def test_context_parallel_composes_with_tensor_parallelism(runs):
    """cp 2 × tp 2 on a (cp, tp) mesh: heads split over tp, the sequence over cp; the loss and the logits
    (gathered over both groups when read) of 3 AdamW steps within 1e-5 of one device; the vocab-parallel loss
    summed over each rank's tokens, its mean over the cp group."""
    for rank, by_kind in runs(4, "cp2_tp2").items():
        assert list(by_kind) == TP2
        for kind, r in by_kind.items():
            assert r["errors"]["loss"] <= 1e-5 and r["errors"]["logits"] <= 1e-5, (kind, rank, r["errors"])
            assert r["context"].cp == 2 and all(a.is_causal for a in r["context"].attention)


@pytest.mark.slow
@pytest.mark.extended
def test_sequence_parallelism_splits_each_context_chunk_exactly(runs):
    """cp 2 × tp 2 with sequence parallelism (Megatron's and torchtitan's order: the tp group's norm and
    residual regions split the cp chunk further, each rank holding (b, s/(cp·tp), h)): the loss and the
    logits of 3 AdamW steps within 1e-5 of one device. Collectives of a step that reads only the loss, per
    rank: the tp group's 2·(2L + 1) reduce-scatters (the embedding, attention and MLP outputs forward; the
    column inputs' gradients backward), each carrying the cp chunk, b·(s/cp)·h elements, not the whole
    sequence; the ring's cp all-to-alls per layer; no all-reduce of b·(s/cp)·h (sequence parallelism
    replaced them all)."""
    for rank, by_kind in runs(4, "cp2_tp2_sp").items():
        assert list(by_kind) == SP
        for kind, r in by_kind.items():
            assert r["errors"]["loss"] <= 1e-5 and r["errors"]["logits"] <= 1e-5, (kind, rank, r["errors"])
            assert r["sequence"] and r["context"].cp == 2, (kind, r["sequence"])
            layers = len(r["context"].attention)
            kinds = [c[0] for c in r["calls"]]
            assert kinds.count("all_to_all_single") == 2 * layers, (kind, kinds)
            scatters = [c[2] for c in r["calls"] if c[0] == "reduce_scatter"]
            chunk = scatters[0]  # b·(s/cp)·h
            assert len(scatters) == 2 * (2 * layers + 1) and set(scatters) == {chunk}, (kind, scatters)
            assert not [c for c in r["calls"] if c[0] == "all_reduce" and c[2] == chunk], (kind, r["calls"])


@pytest.mark.slow
@pytest.mark.extended
def test_expert_parallelism_routes_each_chunks_tokens_exactly(runs):
    """cp 2 × tp 2 with expert parallelism: each tp rank holds E/tp whole experts and computes what the router
    sends them of its cp chunk's tokens (routing is per token: top-k, each token repeated per slot, an expert's
    weights gathered per slot by id); the loss and the logits of 3 AdamW steps within 1e-5 of one device. Per
    layer one K/V ring (cp all-to-alls in the backward); the loss's sum and count over the cp group."""
    for rank, by_kind in runs(4, "experts").items():
        assert list(by_kind) == EXPERTS
        for kind, r in by_kind.items():
            assert r["errors"]["loss"] <= 1e-5 and r["errors"]["logits"] <= 1e-5, (kind, rank, r["errors"])
            assert r["experts"] == [("blocks.0.moe", 4), ("blocks.1.moe", 4)], r["experts"]  # whole experts
            layers = len(r["context"].attention)
            kinds = [c[0] for c in r["calls"]]
            assert layers == 2 and kinds.count("all_to_all_single") == 2 * layers, (kind, kinds)
            assert [c for c in r["calls"] if c[0] == "all_reduce" and c[2] == 1][:2] == [("all_reduce", "sum", 1)] * 2


@pytest.mark.slow
@pytest.mark.parametrize("job", ["compile", pytest.param("compile inductor", marks=pytest.mark.extended)])
def test_compiled_context_parallel_is_one_graph_and_exact(runs, job):
    """``parallelize(model, context_parallel=2, compile=...)``: the rewritten graph traces as one dynamo graph
    with no break, each ring attention one opaque op (``autotp::ring_attention``, its backward another: dynamo
    cannot trace torch's ring itself), a tied embedding's gradient summed over the group once (a tensor handed
    twice to one autograd Function breaks the graph); the loss, logits, gradients and 3 AdamW steps of the
    compiled model within 1e-5 of the eager unsharded model (AOTAutograd here; Inductor in the extended
    run)."""
    for rank, by_kind in runs(2, job).items():
        for kind, r in by_kind.items():
            assert max(r["errors"].values()) <= 1e-5, (job, kind, rank, r["errors"])
            assert r["graphs"] == 1 and r["breaks"] == 0, (kind, r["reasons"])
            assert r["traced"] == r["rings"] >= 2, (kind, r)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_each_chunk_draws_its_own_dropout_masks(runs, world):
    """Dropout on the embeddings and the residual branches at cp 2 (and cp 2 × tp 2): the three dropouts run on
    the chunk's stream, so the two chunks' masks differ where they would otherwise repeat position by position;
    the tp ranks of a chunk drop the same elements of their replicated activations; the default generator is
    not advanced apart on any rank."""
    for rank, r in runs(world, "dropout").items():
        assert r["streams"] == ["cp"] * 3, (rank, r["streams"])
        assert all(0.2 < d < 0.4 for d in r["dropped"]), r["dropped"]  # p = 0.3 of the live elements
        assert r["chunks_differ"] and r["tp_identical"] and r["default_in_step"], (rank, r)


@pytest.mark.slow
@pytest.mark.parametrize("job, tp", [pytest.param("fsdp", 1, marks=pytest.mark.extended), ("fsdp_tp2", 2)])
def test_fsdp_shards_over_the_data_and_context_ranks_exactly(runs, job, tp):
    """FSDP with cp 2 (dp 2 × cp 2, and cp 2 × tp 2): FSDP shards over the dp and cp ranks together and its
    reduce-scatter sums the chunks' gradients, averaged over dp only: the losses, the clipped gradient norm
    and the parameters after 3 AdamW steps within 1e-5 of one device on the whole batch. The graph sums no
    gradient of its own: its only all-reduces are the loss's sum and count (and with tp, Megatron's)."""
    for rank, by_kind in runs(4, job).items():
        for kind, r in by_kind.items():
            assert max(r["errors"].values()) <= 1e-5, (job, kind, rank, r["errors"])
            assert r["grads_in_graph"] == 0
            kinds = [c[0] for c in r["calls"]]
            assert kinds.count("all_to_all_single") == 2 * r["rings"], kinds  # the ring's backward, cp per layer
            scalars = [c for c in r["calls"] if c[0] == "all_reduce" and c[2] == 1]
            assert scalars == [("all_reduce", "sum", 1)] * 2, scalars  # Σ loss, Σ counted tokens
            if tp == 1:
                assert kinds.count("all_reduce") == 2 and kinds.count("reduce_scatter") >= 4, kinds


@pytest.mark.slow
@pytest.mark.extended
def test_hsdp_shards_over_the_context_ranks_and_replicates_over_the_rest(runs):
    """HSDP with cp 2 (2 replica groups × (dp_shard 1 · cp 2), torchtitan's dp_replicate × dp_shard_cp): the
    losses, the clipped gradient norm and the parameters after 3 AdamW steps within 1e-5 of one device on the
    whole batch. Each unit's gradients are reduce-scattered over its shard group (the cp pair) and the
    shard, half of them, all-reduced over the replicas; the graph sums no gradient of its own."""
    for rank, by_kind in runs(4, "hsdp").items():
        for kind, r in by_kind.items():
            assert max(r["errors"].values()) <= 1e-5, (kind, rank, r["errors"])
            assert r["grads_in_graph"] == 0
            scatters = [c[2] for c in r["calls"] if c[0] == "reduce_scatter"]
            replicas = [c[2] for c in r["calls"] if c[0] == "all_reduce" and c[2] > 1]
            assert scatters and replicas == [n // 2 for n in scatters], (scatters, replicas)


@pytest.mark.slow
def test_checkpointed_layers_and_autocast_train_as_on_one_device(runs):
    """What GPU scripts do, at cp 2: layers under torch.utils.checkpoint (non-reentrant and reentrant: the
    ring's collectives run again when the layer is recomputed) exact in fp32 after 3 AdamW steps; the example
    under bf16 autocast, and under fp16 autocast with a GradScaler (its scale kept), as close to the unsharded
    model under the same autocast as that is to fp32 (the graph captured under autocast is checked in fp32:
    a bf16 matmul cut in parts rounds differently from the whole, which is no reason to refuse it)."""
    for rank, r in runs(2, "script").items():
        for style in ("layer", "reentrant"):
            assert r[style]["loss"] <= 1e-5 and r[style]["params"] <= 1e-5, (rank, style, r[style])
        for name in ("bf16", "fp16"):
            a = r[name]
            assert a["loss"] <= 2 * a["autocast_loss"] + 1e-5 and a["params"] <= 2 * a["autocast_params"], (name, a)
        assert r["fp16"]["scale"] == 65536.0  # no step skipped: nothing overflowed


@pytest.mark.slow
@pytest.mark.extended
def test_a_sampling_loop_runs_whole_where_chunks_cannot(runs):
    """The example's own sampling loop under torch.no_grad() at cp 2: its calls read the last position's logits
    and grow one token at a time, so they run the whole sequence on every rank (said once) and draw the same
    tokens as one device; training afterwards is exact; a training call of length 5 is refused with the
    numbers. The signature found not to run on chunks is not captured again for that on every token: the loop's
    nine calls capture two graphs: the chunked attempt, then the whole sequence (it captured on every call)."""
    for rank, r in runs(2, "sampling").items():
        assert r["captures"] == 2, (rank, r["captures"])
        assert r["same_tokens"] and r["loss"] <= 1e-5, (rank, r)
        assert r["graphs"] == ["whole context"] and len(r["warned"]) == 1 and "x[:, [-1]]" in r["warned"][0]
        assert "sequence length 5 is not divisible by 2·cp = 4" in r["refused"]
