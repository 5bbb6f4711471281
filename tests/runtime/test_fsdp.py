"""FSDP2 over the data-parallel ranks × autotp inside each tensor-parallel group.

Structural: the units (repeated blocks) found in several spellings of a block stack, the graph split into one
piece per unit computing what the model computes, what cannot be split. Multi-process (gloo): 3 AdamW steps
with gradient clipping against the unsharded model on the whole batch, collectives counted.
"""
from __future__ import annotations

from collections import Counter
from functools import partial

import pytest
import torch
import torch.nn as nn

from autotp.capture.structure import flatten, unflatten
from autotp.capture.tracer import capture
from autotp.distributed.data_parallel import FSDPConfig
from autotp.errors import ProcessGroupError
from autotp.passes import run_passes
from autotp.passes.split_units import split_units
from autotp.plan.plan import Plan
from autotp.plan.planner import cut_copies_in_graph, make_plan
from autotp.operators.pieces import PieceCall, bind_pieces
from ranks import Launches
from fsdp_models import KINDS, build
from fsdp_workers import fsdp_load_weights, fsdp_parity, fsdp_parity_many, fsdp_resume_matrix
from fsdp_workers import fsdp_mixed_precision as fsdp_workers_mp
from small_models import MODELS, loss_and_logits

UNITS = {
    "modulelist": ["layers.0", "layers.1", "layers.2"],
    "sequential": ["blocks.0", "blocks.1", "blocks.2"],
    "attributes": ["first", "second", "third"],
    "dense_first": ["layers.0", "layers.1", "layers.2"],  # the dense block is an item of the same list
    "nested": ["trunk.stack.0", "trunk.stack.1", "trunk.stack.2"],
    "nanogpt": ["transformer.h.0", "transformer.h.1"],
    "llama": ["model.layers.0", "model.layers.1"],
    "gpt2": ["transformer.h.0", "transformer.h.1"],
}
# the modules read only before the blocks (a unit of their own) and only after them; a tied embedding and
# LM head, read on both sides, stay with the root; so do norms between the blocks ("nested")
EDGES = {
    "modulelist": ((), ("norm",)),
    "sequential": (("wte",), ("norm", "head")),
    "attributes": (("wte",), ("norm", "head")),
    "dense_first": (("wte",), ("norm", "head")),
    "nested": (("wte",), ("post.2", "norm", "head")),
    "nanogpt": (("transformer.wpe",), ("transformer.ln_f",)),
    "llama": (("model.embed_tokens",), ("model.norm", "lm_head")),
    "gpt2": (("transformer.wpe",), ("transformer.ln_f",)),
}


def _all_units(name: str) -> list[str]:
    """Every unit in the order it runs, each named by its first module."""
    first, last = EDGES[name]
    return [*first[:1], *UNITS[name], *last[:1]]


def _model(name: str):
    return MODELS[name]() if name in MODELS else build(name)


def _captured(name: str, tp: int = 1):
    model, args, kwargs = _model(name)
    gm, spec = capture(model, args, kwargs)
    return model, args, kwargs, gm, make_plan(gm, tp), spec


@pytest.mark.parametrize("name", list(UNITS))
def test_units_are_the_repeated_blocks(name: str):
    *_, plan, _ = _captured(name)
    assert [u.module for u in plan.units if u.kind == "block"] == UNITS[name]
    edges = tuple(tuple(u.members) for u in plan.units if u.kind == "first"), \
        tuple(tuple(u.members) for u in plan.units if u.kind == "last")
    assert edges == tuple((e,) if e else () for e in EDGES[name])
    assert [u.kind for u in plan.units] == ["first"] * bool(EDGES[name][0]) + ["block"] * len(UNITS[name]) + ["last"]
    for u in plan.units:
        assert u.params and all(any(p.startswith(m + ".") for m in u.members) for p in u.params)
    assert Plan.from_json(plan.to_json()).units == plan.units


@pytest.mark.parametrize("name", [*KINDS, "llama"])
def test_split_graph_computes_what_the_model_computes(name: str):
    """One piece per block (plus root-level code), each reading its parameters from the model when it runs:
    same loss and same gradients as the model's own forward."""
    model, args, kwargs, gm, plan, spec = _captured(name)
    top = run_passes(run_passes(gm, plan), plan, (split_units,))
    pieces = [m for m in top.modules() if isinstance(m, PieceCall)]
    assert [p.unit for p in pieces if p.unit is not None] == _all_units(name)
    assert not list(top.parameters()), "the top graph keeps no parameter: the pieces read the model's"
    bind_pieces(top, model)
    got = loss_and_logits(unflatten(top(*flatten((args, kwargs))[0]), spec))[0]
    got.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want = loss_and_logits(model(*args, **kwargs))[0]
    want.backward()
    assert torch.equal(got, want)
    for n, p in model.named_parameters():
        assert torch.equal(grads[n], p.grad), n


def test_pieces_make_each_parameter_local_just_before_its_first_reader():
    """Run eagerly, a piece takes the parameters themselves (FSDP's DTensors) and makes each local right
    before the first node that reads it. Autograd runs the ready node made last first, so a ``to_local`` of
    every parameter made before the piece ran would run its backward after the piece's whole backward,
    holding every gradient of the unit at once (a pipeline stage's: 1.19× the memory formula)."""
    from autotp.operators.pieces import _local

    model, args, kwargs, gm, plan, spec = _captured("nanogpt")
    top = run_passes(run_passes(gm, plan), plan, (split_units,))
    bind_pieces(top, model)
    checked = set()
    for piece in (m for m in top.modules() if isinstance(m, PieceCall)):
        nodes = list(piece._lazy_locals().graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        for node, what in zip(placeholders, piece.inputs):
            if not isinstance(what, str) or not node.users:
                continue
            (local,) = node.users
            assert local.target is _local
            first = min(local.users, key=nodes.index)
            between = nodes[nodes.index(local) + 1:nodes.index(first)]
            assert all(n.target is _local for n in between), (what, between)  # its reader's other operands
            checked.add(what)
    assert len(checked) >= len(list(model.parameters()))  # every parameter (a tied one under both names)
    got = loss_and_logits(unflatten(top(*flatten((args, kwargs))[0]), spec))[0]
    assert torch.equal(got, loss_and_logits(model(*args, **kwargs))[0])


@pytest.mark.parametrize("name", ["nanogpt", "llama"])
def test_sequence_parallel_gradients_are_summed_in_each_unit(name: str):
    """With FSDP the norm weights' gradient sum (sequence parallelism) is one all-reduce per unit, inside that
    unit's piece, so FSDP's reduce-scatter of a unit (at the end of its backward) gets summed gradients; the
    plan lists the same sums, each with its unit's element count."""
    from autotp.operators.seq_ops import SumGrads
    from autotp.plan.plan import SEQ_PARAMS
    from autotp.plan.planner import group_seq_grads

    model, args, kwargs = _model(name)
    gm, _ = capture(model, args, kwargs)
    whole = make_plan(gm, 2, sequence_parallel=True)
    plan = group_seq_grads(gm, whole, "unit")
    sums = [c for c in plan.collectives if c.module == SEQ_PARAMS]
    assert len([c for c in whole.collectives if c.module == SEQ_PARAMS]) == 1
    assert len(sums) == len(UNITS[name]) + 1  # each block's norms, and the final norm (the last unit)
    assert sum(int(c.shape[0]) for c in sums) == \
        int(next(c for c in whole.collectives if c.module == SEQ_PARAMS).shape[0])
    top = run_passes(run_passes(gm, plan), plan, (split_units,))
    assert not [m for m in top.children() if isinstance(m, SumGrads)]
    per_piece = {p.unit: sum(isinstance(m, SumGrads) for m in p.piece.modules())
                 for p in top.modules() if isinstance(p, PieceCall)}
    assert per_piece == {u: int(u in UNITS[name] or u == EDGES[name][1][0]) for u in _all_units(name)}, per_piece


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(torch.relu(self.lin(x)))


class _Twice(nn.Module):
    """A block stack run twice (weights shared across depth): block 0 runs again after block 1."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(_Layer() for _ in range(2))

    def forward(self, ids):
        x = self.emb(ids)
        for _ in range(2):
            for layer in self.layers:
                x = layer(x)
        return x.sum()


class _ReadOutside(nn.Module):
    """A block's parameter also read at the root (``x * self.layers[0].norm.weight``)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x * self.layers[0].norm.weight).sum()


@pytest.mark.parametrize("model, args, says", [
    (_Twice(), (torch.zeros(2, 4, dtype=torch.long),), "interleaved"),
    (_ReadOutside(), (torch.zeros(2, 8),), "layers.0.norm.weight"),
])
def test_a_graph_that_cannot_be_cut_says_why(model, args, says):
    gm, _ = capture(model, args, {})
    plan = make_plan(gm, 1)
    assert len([u for u in plan.units if u.kind == "block"]) == 2
    with pytest.raises(Exception, match=says):
        run_passes(gm, plan, (split_units,))


def test_kv_heads_held_by_several_ranks_are_cut_in_the_graph():
    """llama's 2 kv heads at tp 4 (each held by two ranks): under FSDP the k and v projections stay whole (a
    DTensor is sharded or replicated over tp, never a block on two ranks of four) and the graph cuts each to
    the rank's slice where it is read, through f: one gradient all-reduce per parameter, backward, in its
    block's unit."""
    model, _, _, gm, plan, _ = _captured("llama", tp=4)
    kv = {n for n, s in plan.params if s.replicated_blocks(4)}
    assert kv == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "kv"}
    cut = cut_copies_in_graph(gm, plan)
    assert {c.name for c in cut.graph_cuts} == kv and not kv & {n for n, _ in cut.params}
    assert kv <= {w.name for w in cut.whole if "kv heads" in w.reason}
    kinds = [Counter((c.kind, c.direction) for c in p.collectives) for p in (cut, plan)]
    assert kinds[0] - kinds[1] == Counter({("all_reduce", "backward"): 4})
    assert Plan.from_json(cut.to_json()) == cut
    assert cut_copies_in_graph(gm, make_plan(gm, 2)) == make_plan(gm, 2), "kv heads tp divides: nothing to cut"
    top = run_passes(run_passes(gm, cut), cut, (split_units,))
    for piece in (m for m in top.modules() if isinstance(m, PieceCall)):
        cuts = [n for n in piece.piece.graph.nodes
                if n.op == "call_module" and str(n.target).startswith("autotp_graph_cut_")]
        mine = [c for c in cut.graph_cuts if c.name.startswith(f"{piece.unit}.")] if piece.unit else []
        assert len(cuts) == 2 * len(mine), (piece.unit, cuts)  # f and the slice, in the unit that owns the weight
    with pytest.raises(ValueError, match="replicas"):
        FSDPConfig(replicas=0)


def test_fsdp_without_a_mesh_says_how_to_get_one(monkeypatch):
    import autotp
    from autotp.distributed.job import ENV_JOB

    monkeypatch.delenv(ENV_JOB, raising=False)
    model, args, kwargs = _model("nanogpt")
    with pytest.raises(ProcessGroupError, match="init_device_mesh"):
        autotp.parallelize(model, example_inputs=(args, kwargs), fsdp=True)
    assert type(model).__name__ == "GPT" and not hasattr(model, "_autotp")


# forward all-reduces of plain TP (embedding, 2 per layer, the loss's 3) and backward (2 per layer, LM head)
def _tp_all_reduces(layers: int) -> tuple[Counter, Counter]:
    return Counter({("all_reduce", "sum"): 2 * layers + 3, ("all_reduce", "max"): 1}), \
        Counter({("all_reduce", "sum"): 2 * layers + 1})


def _kinds(calls, *names) -> Counter:
    return Counter((c[0], c[1]) for c in calls if c[0] in names)


# the default run: Llama at tp 2 × fsdp 2 (the other layouts in the extended run)
PARITY = [pytest.param("nanogpt", 2, marks=pytest.mark.extended), ("llama", 2),
          pytest.param("nanogpt", 1, marks=pytest.mark.extended), pytest.param("llama", 1, marks=pytest.mark.extended)]
META = [("nanogpt", 2, "dcp"), ("llama", 1, "torch")]
# (parallel blocks and offset slices in the extended run)
SPELLINGS = ["pattern:qk_norm_width", "pattern:gqa_qk_norm"]
MQA = ["pattern:mqa_repeat", "pattern:falcon_mqa"]  # k and v projections of their own; fused q|k|v
REST = {"spellings": ["pattern:parallel", "pattern:offset_slices"]}
CORE = [p for p in PARITY if not hasattr(p, "marks")]
EXTENDED = [tuple(p.values) for p in PARITY if hasattr(p, "marks")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Launches:
    """Every 4-rank job of this file in one launch (made when a test first asks): the weight files the meta
    models load are written first."""
    import warnings

    import torch.distributed.checkpoint as dcp

    tmp = tmp_path_factory.mktemp("fsdp")
    jobs: dict[str, tuple] = {f"parity {model} {tp}": (fsdp_parity, model, tp) for model, tp in CORE}
    jobs["resume"] = (fsdp_resume_matrix, str(tmp / "resume"), ["nanogpt", "llama"])
    jobs["mixed precision"] = (fsdp_workers_mp, "nanogpt", 2)
    jobs["sp llama"] = (partial(fsdp_parity, sequence_parallel=True), "llama", 2)
    # the extended run's jobs: the other layouts and options, meta models, kv heads, spellings
    rest: dict[str, tuple] = {f"parity {model} {tp}": (fsdp_parity, model, tp) for model, tp in EXTENDED}
    rest["kept"] = (fsdp_parity, "modulelist", 2, 3, 0.05, False, False)
    rest["hsdp"] = (fsdp_parity, "dense_first", 1, 3, 0.05, True, True, 2)
    for name, tp, kind in META:
        # a torch state-dict file (read tensor by tensor) or a DCP folder (read in one go at the end)
        state = _model(name)[0].state_dict()
        path = tmp / f"{name}-{kind}" / ("weights.pt" if kind == "torch" else "weights")
        path.parent.mkdir()
        if kind == "torch":
            torch.save(state, path)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
                dcp.save(state, checkpoint_id=str(path))
        rest[f"meta {name}"] = (fsdp_load_weights, name, str(path), tp)
    rest.update({f"without units {kind}": (fsdp_parity, kind, 2) for kind in ("single", "twice")})
    rest["spellings"] = (fsdp_parity_many, SPELLINGS, 2)
    rest["kv llama"] = (fsdp_parity, "llama", 4)  # 2 kv heads, each on two of the 4 tp ranks (dp 1)
    rest["kv spellings"] = (fsdp_parity_many, MQA, 2)  # one kv head on both tp ranks, dp 2
    # AOTAutograd's graphs run eagerly: Inductor over FSDP is the 8-rank command test's (tests/runtime/test_pipeline.py)
    rest["sp compile nanogpt"] = (partial(fsdp_parity, sequence_parallel=True, compile={"backend": "aot_eager"}),
                                  "nanogpt", 2)
    rest.update({f"{name} rest": (fsdp_parity_many, kinds, 2) for name, kinds in REST.items()})
    return Launches({4: jobs}, extended={4: rest}, reuse_captures=True)


@pytest.mark.slow
@pytest.mark.parametrize("model, tp", PARITY)
def test_fsdp_training_parity(runs, model: str, tp: int):
    """tp × fsdp on 4 ranks: 3 AdamW steps with clip_grad_norm_ as the unsharded model on the whole batch;
    one all-gather per unit forward (embeddings, blocks, final norm and head, and the root where a tied
    embedding keeps parameters there), one per unit backward but the last (kept gathered, as its backward
    starts at once), one reduce-scatter per unit; the tensor-parallel all-reduces unchanged."""
    results = runs(4, f"parity {model} {tp}")
    units, layers = len(_all_units(model)), len(UNITS[model])
    for rank, r in results.items():
        assert r["units"] == _all_units(model)
        assert r["root_params"] == (model == "nanogpt") and r["last_kept"]  # nanoGPT ties wte and lm_head
        assert r["dtensors"] and r["same_class"]
        for got, want in [(r["losses"], r["ref_losses"]), (r["norms"], r["ref_norms"])]:
            assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (rank, got, want)
        assert r["param_diff"] <= 1e-5, (rank, r["param_diff"])
        assert r["eval_diff"] <= 1e-5 and r["graphs"] == 2, "a later call signature is captured and exact"
        fwd, bwd = r["forward_collectives"], r["backward_collectives"]
        root = int(r["root_params"])
        assert _kinds(fwd, "all_gather", "reduce_scatter") == Counter({("all_gather", ""): units + root})
        assert Counter(c[0] for c in bwd if c[0] != "all_reduce") == \
            Counter({"all_gather": units - 1, "reduce_scatter": units + root})
        want_fwd, want_bwd = _tp_all_reduces(layers) if tp > 1 else (Counter(), Counter())
        assert _kinds(fwd, "all_reduce") == want_fwd and _kinds(bwd, "all_reduce") == want_bwd
        # the gradient norm: one all-reduce of the squares' sum over all tp × dp ranks, not one per mesh dim
        assert sum(r["norm_collectives"].values()) == 1, r["norm_collectives"]
        assert "all_reduce" in next(iter(r["norm_collectives"])), r["norm_collectives"]
        # each rank keeps 1/(tp·dp) of the parameters (FSDP pads dim 0 to a multiple of dp)
        assert r["local_numel"] <= r["full_numel"] / 4 * 1.25


@pytest.mark.slow
@pytest.mark.parametrize("job", ["sp llama", pytest.param("sp compile nanogpt", marks=pytest.mark.extended)])
def test_fsdp_with_sequence_parallelism_and_compile(runs, job: str):
    """tp 2 with sequence parallelism × fsdp 2 (and each unit's piece compiled): exact after 3 AdamW steps
    with clip_grad_norm_; the collectives are each dimension's own, added: FSDP's all-gathers and
    reduce-scatters per unit, sequence parallelism's per layer, and the norm weights' gradients summed by one
    all-reduce per unit (FSDP reduce-scatters a unit's gradients as soon as its backward ends)."""
    model = job.split()[-1]
    results = runs(4, job)
    units, layers = len(_all_units(model)), len(UNITS[model])
    sp = 2 * layers + 1  # per layer attention and MLP, and the embedding / LM head (tests/passes/test_sequence.py)
    for rank, r in results.items():
        for got, want in [(r["losses"], r["ref_losses"]), (r["norms"], r["ref_norms"])]:
            assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (rank, got, want)
        assert r["param_diff"] <= 1e-5 and r["eval_diff"] <= 1e-5 and r["graphs"] == 2, rank
        root = int(r["root_params"])
        fwd, bwd = Counter(c[0] for c in r["forward_collectives"]), Counter(c[0] for c in r["backward_collectives"])
        assert fwd == Counter({"all_gather": units + root + sp, "reduce_scatter": sp, "all_reduce": 3}), fwd
        # the blocks' norms and the final norm (the last unit): one all-reduce each
        assert bwd == Counter({"all_gather": units - 1 + 2 * sp + (model == "nanogpt"),  # + learned positions
                               "reduce_scatter": units + root + sp, "all_reduce": layers + 1}), bwd
        if "compile" in job:
            assert r["breaks"] == {} and r["compiled_graphs"] >= units, (r["breaks"], r["compiled_graphs"])


@pytest.mark.slow
@pytest.mark.extended
def test_fsdp_with_kv_heads_held_by_several_ranks(runs):
    """Fewer kv heads than tp under FSDP (llama's 2 at tp 4; one at tp 2 × dp 2, k and v projections of their
    own or fused with q): exact after 3 AdamW steps with clip_grad_norm_ (the whole k and v weights counted
    once); the tensor-parallel all-reduces plus one backward all-reduce of each cut weight's gradient."""
    llama = runs(4, "kv llama")
    layers = len(UNITS["llama"])
    for r in (*llama.values(), *(x for by in runs(4, "kv spellings").values() for x in by.values())):
        for got, want in [(r["losses"], r["ref_losses"]), (r["norms"], r["ref_norms"])]:
            assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
        assert r["param_diff"] <= 1e-5 and r["eval_diff"] <= 1e-5, r["param_diff"]
        assert r["graph_cuts"] and not any("left replicated" in w for w in r["warnings"]), r["warnings"]
    for r in llama.values():
        assert len(r["graph_cuts"]) == 2 * layers  # k and v of each layer
        want_fwd, want_bwd = _tp_all_reduces(layers)
        assert _kinds(r["forward_collectives"], "all_reduce") == want_fwd
        assert _kinds(r["backward_collectives"], "all_reduce") == want_bwd + Counter({("all_reduce", "sum"): 2 * layers})


@pytest.mark.slow
@pytest.mark.extended
def test_fsdp_options_and_hsdp(runs):
    """Keeping the gathered blocks until backward (no all-gather in backward), no prefetch, HSDP (2 replica
    groups × 2 shards: gradients reduce-scattered in a group, then all-reduced across the groups) on a
    dense-first mixture-of-experts stack."""
    kept = runs(4, "kept")[0]
    assert kept["root_params"]  # the tied embedding and head
    assert Counter(c[0] for c in kept["backward_collectives"] if c[0] != "all_reduce") == \
        Counter({"reduce_scatter": len(_all_units("modulelist")) + 1})
    hsdp = runs(4, "hsdp")
    for r in (kept, *hsdp.values()):
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= 1e-5
        assert max(abs(a - b) for a, b in zip(r["norms"], r["ref_norms"])) <= 1e-5
        assert r["param_diff"] <= 1e-5
    bwd, units = hsdp[0]["backward_collectives"], len(_all_units("dense_first"))
    assert not hsdp[0]["root_params"]
    assert Counter(c[0] for c in bwd) == Counter({"all_gather": units - 1, "reduce_scatter": units,
                                                  "all_reduce": units})


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_at_any_layout(runs):
    """A checkpoint saved at tp 2 × fsdp 2 holds autotp's global per-segment layout (weights and AdamW
    state): resumed at tp 4 × dp 1, tp 1 × fsdp 4 and tp 2 × dp 2 (DDP) it trains on as if uninterrupted."""
    results = runs(4, "resume")[0]
    for name, runs in results.items():
        reference = runs.pop("reference")
        assert set(runs) == {(4, False), (1, True), (2, False)}
        for layout, run in runs.items():
            assert run["step"] == 3
            diff = max((run["state"][k] - v).abs().max().item() for k, v in reference.items())
            assert diff <= 1e-6, (name, layout, diff)
        assert runs[(4, False)]["note"] == "resumed from tp 2 × dp 2 → tp 4 × dp 1: weights and optimizer state resharded"


@pytest.mark.slow
def test_autotp_shard_fsdp_runs_as_is(tmp_path):
    """The README's `autotp shard examples/nanogpt.py --tp 2 --dp 2 --fsdp`: parity check, training,
    checkpoint."""
    import json

    from readme import readme_folder, run_readme

    proc = run_readme("autotp shard examples/nanogpt.py --tp 2 --dp 2 --fsdp --out fsdp", readme_folder(tmp_path),
                      columns=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "fsdp"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parity"]["ok"] and summary["fsdp"] == 1
    assert summary["fsdp_units"] == _all_units("nanogpt")
    assert len(summary["losses"]) == 3 and summary["losses"][-1] < summary["losses"][0]
    assert "FSDP2 over 2 ranks" in proc.stdout and (out / "checkpoints" / "step-000003" / ".metadata").is_file()
    # each rank holds about a quarter of the parameters (tp 2 × fsdp 2), not half as under DDP
    assert all(r["param_bytes"] <= summary["unsharded_bytes"] * 0.3 for r in summary["ranks"])


@pytest.mark.parametrize("flags, says", [
    (["--tp", "2", "--fsdp"], "there is one"),  # no data-parallel ranks to shard over
    (["--tp", "1", "--dp", "4", "--hsdp", "3", "--fsdp"], "do not divide"),
    (["--tp", "1", "--dp", "2", "--hsdp", "2"], "needs --fsdp"),
    (["--tp", "2", "--dp", "2", "--nnodes", "2", "--master-addr", "h", "--master-port", "1", "--fsdp", "--hsdp", "1"],
     "would span nodes"),
    (["--tp", "1", "--dp", "2", "--pp", "2", "--fsdp", "--schedule", "InterleavedZeroBubble"],
     "fsdp with the InterleavedZeroBubble schedule is not supported yet"),
])
def test_fsdp_bad_flags_fail_before_any_rank(flags, says):
    import os

    from typer.testing import CliRunner

    from autotp.cli.main import app
    from ranks import ROOT

    result = CliRunner().invoke(app, ["shard", os.path.join(ROOT, "examples", "nanogpt.py"), *flags],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert says in result.output


@pytest.mark.slow
def test_fsdp_mixed_precision_under_autocast(runs):
    """bf16 parameters for compute (all-gathered in bf16), gradients reduce-scattered in fp32 into fp32 master
    weights, under bf16 autocast: as close to the fp32 model as the single-device autocast run is."""
    for rank, r in runs(4, "mixed precision").items():
        assert r["master_dtypes"] == ["torch.float32"]
        assert r["travel"] == [("all_gather", "bfloat16"), ("reduce_scatter", "float32")], r["travel"]
        bf16 = 2 ** -8
        assert max(r["loss_rel"]) <= max(2 * max(r["amp_loss_rel"]), 4 * bf16), (rank, r)
        assert r["update_rel"] <= max(2 * r["amp_update_rel"], 0.05), (rank, r["update_rel"], r["amp_update_rel"])


@pytest.mark.slow
@pytest.mark.parametrize("name, tp, kind", META)
@pytest.mark.extended
def test_fsdp_model_built_on_meta_loads_its_weights(runs, name: str, tp: int, kind: str):
    """A torch state-dict file (read tensor by tensor) or a DCP folder (read in one go at the end): written
    by the ``runs`` fixture."""
    for rank, r in runs(4, f"meta {name}").items():
        assert r["tensors"] > 0 and r["loss_diff"] <= 1e-5 and r["param_diff"] == 0.0, (rank, r)


def test_hsdp_at_tp2_on_8_ranks_structure():
    """tp 2 × HSDP (2 replica groups × 2 shards) needs 8 ranks: built on torch's fake process group (one
    process, no communication), every parameter is a DTensor over (dp_replicate, dp_shard, tp): replicated
    across the groups, dim 0 of its TP shard cut over the shard group, cut (or whole) over tp."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autotp

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        model, args, kwargs = _model("nanogpt")
        full = {n: p.shape for n, p in model.named_parameters()}
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        model = autotp.parallelize(model, example_inputs=(args, kwargs), fsdp=FSDPConfig(replicas=2), mesh=mesh)
        st = autotp.tp_state(model)
        assert st.units == tuple(_all_units("nanogpt"))
        for name, p in model.named_parameters():
            assert p.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp"), name
            # dim 0 of the TP shard over dp_shard: Shard(0), or _StridedShard(0) where tp cuts dim 0 too
            assert p.placements[0] == Replicate() and getattr(p.placements[1], "dim", None) == 0, (name, p.placements)
            shard = st.shards.get(name)
            assert p.placements[2] == (Shard(shard.dim) if shard else Replicate()), (name, p.placements)
            tp_rows = full[name][0] // (2 if shard is not None and shard.dim == 0 else 1)
            assert p.to_local().shape[0] == -(-tp_rows // 2), name  # this rank's half of its TP shard's rows
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.extended
def test_fsdp_without_units_shards_the_whole_model(runs):
    """Nothing repeats (one block), or the blocks cannot be cut apart (a stack run twice): the whole model is
    one FSDP unit (said once, for the stack run twice), exact, its parameters read when the graph runs."""
    for kind in ("single", "twice"):
        for rank, r in runs(4, f"without units {kind}").items():
            assert r["units"] == [] and r["root_params"], (kind, r["units"])
            assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= 1e-5, (kind, rank)
            assert max(abs(a - b) for a, b in zip(r["norms"], r["ref_norms"])) <= 1e-5, (kind, rank)
            assert r["param_diff"] <= 1e-5 and r["eval_diff"] <= 1e-5, (kind, rank)
            assert Counter(c[0] for c in r["backward_collectives"] if c[0] != "all_reduce") == \
                Counter({"reduce_scatter": 1}), kind
            assert any("one unit" in w for w in r["warnings"]) == (kind == "twice"), r["warnings"]



@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("part", ["spellings", "spellings rest"])
def test_fsdp_parity_across_spellings(runs, part: str):
    """q/k norms over the whole width (their statistics completed over tp in the graph), grouped-query
    attention with q/k norms; in the extended run parallel attention and MLP, q|k|v read by offset slices:
    tp 2 × fsdp 2 exact."""
    for rank, results in runs(4, part).items():
        for name, r in results.items():
            assert r["units"] == ["emb", "blocks.0", "blocks.1", "norm"], (name, r["units"])
            for got, want in [(r["losses"], r["ref_losses"]), (r["norms"], r["ref_norms"])]:
                assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (name, rank, got, want)
            assert r["param_diff"] <= 1e-5 and r["eval_diff"] <= 1e-5, (name, rank, r["param_diff"])
