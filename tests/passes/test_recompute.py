"""The model's own activation checkpointing survives parallelize: each torch.utils.checkpoint call (non-
reentrant, reentrant, around a function, around the MLP alone, Hugging Face's gradient_checkpointing_enable)
becomes a region the rewritten graph runs under checkpoint again, so a rank keeps what the model kept, and
the numbers are the unsharded model's: in the whole graph, in each piece of a graph split into FSDP units or
pipeline stages, and under compile=True."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

import autotp
from ranks import Launches, launch
from recompute_models import LAYERS, STYLES, build, loss_of
from recompute_workers import _example, recompute_in_pieces, recompute_parity
from tiers import core_first


@pytest.fixture
def fake_tp2():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _kept_bytes(model, style: str, idx, targets) -> int:
    """Bytes autograd keeps for backward in one forward, each storage once, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(model, style, idx, targets)
    return sum(seen.values())


@pytest.mark.parametrize("style", core_first(STYLES, ["layer"]))
def test_checkpointed_regions_are_recomputed(style: str, fake_tp2):
    kept = {}
    for recompute in (False, True):
        model, (idx, targets) = build(style, recompute)
        tpm = autotp.parallelize(model, example_inputs=_example(style, idx, targets))
        kept[recompute] = _kept_bytes(tpm, style, idx, targets)
        regions = [n for c in autotp.tp_state(tpm).graphs.values() for n, _ in c.module.named_children()
                   if n.startswith("autotp_recompute_")]
        assert len(regions) == (LAYERS if recompute else 0), (style, recompute, regions)
    assert kept[True] < 0.7 * kept[False], kept  # the layers' insides are no longer kept


def test_capture_leaves_checkpoint_as_it_was():
    import torch.utils.checkpoint as cp

    before = (cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction.apply)
    model, (idx, targets) = build("reentrant")
    from autotp.capture.tracer import capture

    capture(model, (idx, targets), {})
    assert (cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction.apply) == before
    assert "apply" not in cp.CheckpointFunction.__dict__


# every style at tp 2; at tp 4, in the extended run (four ranks on CI's two cores cost the most of any
# launch), the reentrant one and one whose region draws random numbers, then the others
AT = {(2, False): STYLES, (4, False): ["reentrant", "dropout"],
      (4, True): [s for s in STYLES if s not in ("reentrant", "dropout")]}


@pytest.mark.slow
@pytest.mark.parametrize("world,rest", [(2, False), pytest.param(4, False, marks=pytest.mark.extended),
                                        pytest.param(4, True, marks=pytest.mark.extended)])
def test_checkpointing_models_train_exactly(world: int, rest: bool):
    for rank, r in launch(recompute_parity, world, AT[world, rest]).items():
        assert list(r) == AT[world, rest]
        for style, d in r.items():
            assert d["regions"] == LAYERS, (rank, style, d)
            assert d["loss"] <= 1e-5 and d["grad"] <= 1e-5 and d["param"] <= 1e-5, (rank, style, d)


def _tagged_piece() -> fx.GraphModule:
    """A piece of a split graph (as split_units leaves one) whose middle two ops ran in one checkpoint call."""
    from autotp.operators.recompute import KEY

    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    a = g.call_function(torch.ops.aten.mm.default, (x, w))
    b = g.call_function(torch.ops.aten.relu.default, (a,))
    c = g.call_function(torch.ops.aten.mul.Tensor, (b, b))
    d = g.call_function(torch.ops.aten.add.Tensor, (c, x))
    for n in (b, c):
        n.meta["custom"] = {KEY: 0}
    g.output(d)
    return fx.GraphModule({}, g)


def test_regions_are_outlined_inside_pieces():
    """A graph split into pieces (FSDP units, pipeline stages) has its checkpointed regions inside the pieces:
    each becomes a Recompute there, and the piece's forward keeps only the region's input for backward."""
    from autotp.operators.recompute import Recompute
    from autotp.passes import outline_recompute
    from autotp.operators.pieces import PieceCall

    g = fx.Graph()
    g.output(g.call_module("autotp_unit_1", (g.placeholder("x"), g.placeholder("w"))))
    top = fx.GraphModule({"autotp_unit_1": PieceCall(_tagged_piece(), None, (0, 1))}, g)
    top.autotp_unit_1.bind(top)
    xs, ws = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    want = top(xs, ws)
    assert outline_recompute(top) == 1
    piece = top.autotp_unit_1.piece
    assert [type(m) for _, m in piece.named_children()] == [Recompute]
    runs = []
    piece.autotp_recompute_0.region.register_forward_pre_hook(
        lambda *a: runs.append(torch._C._current_graph_task_id() != -1))
    got = top(xs, ws)
    got.sum().backward()
    assert torch.equal(got, want) and runs == [False, True]  # run in the forward, again in the backward


def _saved_activation_bytes(style: str, recompute: bool) -> int:
    """Bytes the compiled forward saves for its backward, graph inputs (parameters, token ids) left out: the
    backward graph's inputs that are neither tangents nor forward inputs (AOTAutograd's ``primals``)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    saved = []

    def backward(gm: fx.GraphModule, _inputs):
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            if n.op == "placeholder" and isinstance(v, torch.Tensor) and not n.name.startswith(("tangents", "primals")):
                numel = v.numel()
                saved.append((numel.node.hint if isinstance(numel, torch.SymInt) else numel) * v.element_size())
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda gm, _inputs: make_boxed_func(gm.forward), bw_compiler=backward)
    model, (idx, targets) = build(style, recompute)
    tpm = autotp.parallelize(model, example_inputs=(idx, targets), compile={"backend": backend})
    loss_of(tpm, style, idx, targets).backward()
    assert saved, "the compiled graph ran no backward"
    return sum(saved)


@pytest.mark.slow  # two compilations (no processes)
@pytest.mark.extended  # CI runs few compile tests: test_compile.py's
def test_compiled_regions_are_recomputed(fake_tp2):
    """compile=True: torch.compile traces each region's checkpoint (its higher-order op) and its partitioner
    recomputes the region in the backward, so the compiled forward saves less."""
    kept, plain = (_saved_activation_bytes("layer", rc) for rc in (True, False))
    assert kept < 0.7 * plain, (kept, plain)


# (style, tp, options) per world: FSDP units at tp 2 × dp 2, pipeline stages at pp 2 (dropout recomputed with the
# forward's masks in both: in the extended run)
PIECES = {
    2: [("layer", 1, dict(pp=2))],
    4: [("layer", 2, dict(fsdp=True))],
}
# the rest of the layouts the layout search prices with recomputation: sequence parallelism in FSDP units and
# pipeline stages, context parallelism with FSDP over dp × cp, DDP over dp, tp 2 × pp 2
EXTENDED = {2: [("dropout", 1, dict(pp=2, schedule="GPipe"))],
            4: [("dropout", 2, dict(fsdp=True)), ("mlp_only", 1, dict(pp=2, fsdp=True)),
                ("layer", 2, dict(fsdp=True, sequence_parallel=True)),
                ("function", 2, dict(pp=2, sequence_parallel=True)),
                ("layer", 1, dict(fsdp=True, context_parallel=2)),
                ("layer", 2, {}),
                ("reentrant", 2, dict(pp=2, schedule="GPipe"))]}


def _jobs(table: dict) -> dict:
    return {world: {f"{style}/{tp}/{options}": (functools.partial(recompute_in_pieces, style, tp, **options),)
                    for style, tp, options in rows} for world, rows in table.items()}


PIECE_RUNS = Launches(_jobs(PIECES), _jobs(EXTENDED), reuse_captures=True)


@pytest.mark.slow
@pytest.mark.parametrize("world,style,tp,options",
                         [(w, *row) for w, rows in PIECES.items() for row in rows]
                         + [pytest.param(w, *row, marks=pytest.mark.extended) for w, rows in EXTENDED.items()
                            for row in rows])
def test_pieces_recompute_exactly(world: int, style: str, tp: int, options: dict):
    for rank, r in PIECE_RUNS(world, f"{style}/{tp}/{options}").items():
        assert r["regions"] == LAYERS, (rank, r)
        for forward, again in r["runs"]:  # every region this rank runs is recomputed in its backward
            assert forward > 0 and again == forward, (rank, r["runs"])
        assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and r["param"] <= 1e-5, (rank, r)
