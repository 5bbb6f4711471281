"""``parallelize(model, compile=True)``: torch.compile over the rewritten graph, no graph breaks, same loss.

One world-2 gloo launch of a tiny nanoGPT; each rank runs ``torch._dynamo.explain`` on the rewritten graph
(graph breaks and their reasons), one inductor compile through ``compile=True`` (loss and gradients against
the eager unsharded model), and checks that the collectives are inside the dynamo graph (functional
collectives; on CPU the all-reduces are ``autotp.all_reduce``, polled rather than slept on).
"""
from __future__ import annotations

import pytest

import copy


from ranks import launch


def _count(graphs, name: str) -> int:
    """Calls of ops named like ``name`` in dynamo's graphs, subgraphs (autograd.Function fwd/bwd) included."""
    return sum(name in str(n.target) for g in graphs for m in g.modules() if hasattr(m, "graph")
               for n in m.graph.nodes if n.op == "call_function")


def compile_worker() -> dict:
    import torch._dynamo

    import autotp
    from autotp.operators.compile import DYNAMO_CONFIG, uncompiled
    from autotp.operators.gathered import local_outputs as _local_outputs
    from nanogpt import GPT, GPTConfig

    torch.manual_seed(0)
    ref = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16))
    g = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(0, 64, (2, 16), generator=g) for _ in range(2))
    tpm = autotp.parallelize(copy.deepcopy(ref), example_inputs=(idx, targets), compile=True)
    (compiled,) = (c.module for c in autotp.tp_state(tpm).graphs.values())
    gm = uncompiled(compiled)

    # dynamo only (no inductor): breaks, reasons and the captured graphs
    torch._dynamo.reset()
    with torch._dynamo.config.patch(**DYNAMO_CONFIG):  # as compile=True traces it
        # what compile=True compiles: the graph without the gathered-on-use wrapping of its outputs
        explained = torch._dynamo.explain(_local_outputs(gm)[0])(idx, targets)
    out = {
        "graphs": explained.graph_count, "breaks": explained.graph_break_count,
        "reasons": [str(getattr(r, "reason", r)) for r in explained.break_reasons],
        "all_reduce": _count(explained.graphs, "all_reduce"),
        "wait_tensor": _count(explained.graphs, "wait_tensor"),
        "polled": _count(explained.graphs, "autotp.all_reduce"),
    }
    torch._dynamo.reset()
    # with sequence parallelism: reduce-scatter and all-gather as functional collectives in the same one graph
    sp = autotp.parallelize(copy.deepcopy(ref), example_inputs=(idx, targets), compile=True, sequence_parallel=True)
    (sp_compiled,) = (c.module for c in autotp.tp_state(sp).graphs.values())
    with torch._dynamo.config.patch(**DYNAMO_CONFIG):
        explained = torch._dynamo.explain(_local_outputs(uncompiled(sp_compiled))[0])(idx, targets)
    out["sequence_parallel"] = {
        "graphs": explained.graph_count, "breaks": explained.graph_break_count,
        "reasons": [str(getattr(r, "reason", r)) for r in explained.break_reasons],
        **{k: _count(explained.graphs, k) for k in ("reduce_scatter", "all_gather", "all_reduce")},
    }
    torch._dynamo.reset()

    # the real thing: inductor through compile=True, forward and backward
    from torch._dynamo.utils import counters

    counters.clear()
    logits, loss = tpm(idx, targets)
    loss.backward()
    rlogits, rloss = ref(idx, targets)
    rloss.backward()
    out["compiled_breaks"] = dict(counters["graph_break"])
    out["loss_diff"] = (loss.detach() - rloss.detach()).abs().item()
    out["logits_type"] = type(logits).__name__
    out["logits_diff"] = (logits - rlogits).abs().max().item()  # reading them gathers, outside the step
    ln = "transformer.h.0.ln_1.weight"  # replicated: gradients compare directly
    out["grad_diff"] = (tpm.get_parameter(ln).grad - ref.get_parameter(ln).grad).abs().max().item()
    return out


@pytest.mark.slow
def test_compile_no_graph_breaks_and_parity():
    results = launch(compile_worker, 2)
    for rank, r in results.items():
        assert r["breaks"] == 0 and r["graphs"] == 1, (rank, r["reasons"])
        assert not r["compiled_breaks"], (rank, r["compiled_breaks"])
        assert r["logits_type"] == "GatheredOnUse" and r["logits_diff"] <= 1e-5, (rank, r)
        # forward: embedding, attention out, MLP out (sum), cross-entropy max + 2 sums; backward of f:
        # entering attention, MLP, LM head — the backward all-reduces sit in the autograd.Function subgraphs
        assert r["all_reduce"] >= 6, (rank, r)
        # on CPU each is autotp's polled all-reduce, which Inductor keeps whole (no wait_tensor to sleep in)
        assert r["polled"] == r["all_reduce"] and r["wait_tensor"] == 0, (rank, r)
        assert r["loss_diff"] <= 1e-5, (rank, r["loss_diff"])
        assert r["grad_diff"] <= 1e-5, (rank, r["grad_diff"])
        sp = r["sequence_parallel"]
        assert sp["breaks"] == 0 and sp["graphs"] == 1, (rank, sp["reasons"])
        # forward: the embedding's and two pairs' reduce-scatters, two column groups' and the LM head's
        # all-gathers; their backwards sit in the autograd.Function subgraphs
        assert sp["reduce_scatter"] >= 3 and sp["all_gather"] >= 3, (rank, sp)
