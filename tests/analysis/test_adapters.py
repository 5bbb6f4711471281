"""Low-rank adapters added to column projections (tests/support/adapter_models.py: three hand-written spellings and
Hugging Face's Zamba2), cut as Megatron would cut ``W x + B(A(x))``: ``B`` column-parallel with ``W``'s split
(segment by segment for a fused gate | up), ``A`` whole on every rank, ``A``'s ``(b, s, r)`` output entering ``B``
through f (identity forward, all-reduce backward); the sum feeds the row-parallel projection as ``W x`` alone would.
Per pair Megatron's one all-reduce forward (the row's, b·s·h) and f's backward (b·s·h of the input the columns
read), and one more f backward per adapter: b·s·r, A's output. Zamba2's MLP was left whole ('replicated operand
... spans the sharded dim'): the adapter paired on its own, A column and B row, and its all-reduced output met
gate_up_proj's sharded one."""
from __future__ import annotations

import math

import pytest

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from adapter_models import FF, HF, R, WRITTEN, build
from parity_checks import assert_exact, assert_fully_sharded
from parity_workers import pattern_parity
from pattern_models import H, S
from ranks import Launches
from shared_graphs import SHARED, spelling

# why a weight of these models is whole: a column adapter's A (r < h here), a row adapter's B, or Zamba2's per-layer
# linear, both reading a row's all-reduced output
BY_DESIGN = ("down-projection kept whole", "post-row linear kept whole")

# spelling -> {projection weight: its adapter's (A, B) weights}, block 0 (the shared block's first application)
ADAPTERS = {
    "lora_matmul": {"blocks.0.mlp.fc.weight": ("blocks.0.mlp.a", "blocks.0.mlp.b")},
    "lora_linear": {"blocks.0.attn.q.weight": ("blocks.0.attn.qa", "blocks.0.attn.qb"),
                    "blocks.0.attn.v.weight": ("blocks.0.attn.va", "blocks.0.attn.vb"),
                    "blocks.0.mlp.gate_up.weight": ("blocks.0.mlp.a", "blocks.0.mlp.b")},
    "lora_module": {f"shared.{w}.weight": (f"shared.{w}_adapters.{i}.lora.0.weight",
                                           f"shared.{w}_adapters.{i}.lora.1.weight")
                    for w in ("q", "k", "v", "gate_up") for i in range(2)},
}
# spelling -> {module: its pairs' all-reduces (forward b·s·h, backward b·s·h, backward b·s·r)}: the shared block
# holds both its pairs at both layers
SUMS = {"lora_matmul": {"blocks.0.mlp": (1, 1, 1)},
        "lora_linear": {"blocks.0.attn": (1, 1, 2), "blocks.0.mlp": (1, 1, 1)},
        "lora_module": {"shared": (4, 4, 8)}}

def _check_plan(model, gm, tp: int) -> dict:
    """Nothing replicated, every 2-D weight cut or whole by design, at most 1/tp + 0.12 of the parameters per rank;
    the plan's shardings by name."""
    plan = make_plan(gm, tp)
    assert plan.replicated == (), (tp, plan.replicated)
    # a parameter several modules hold (Zamba2's shared block at each hybrid layer, its tied embedding and head):
    # the plan names it once, by any name
    every = dict(model.named_parameters(remove_duplicate=False))
    aliases = {n: [m for m, q in every.items() if q is p] for n, p in every.items()}
    shards = {n: s for name, s in plan.params for n in aliases.get(name, [name])}
    whole = {n: w.reason for w in plan.whole for n in aliases.get(w.name, [w.name])}
    params = dict(model.named_parameters())
    assert all(why.startswith(BY_DESIGN) for why in whole.values()), (tp, whole)
    assert [n for n, p in params.items() if p.dim() >= 2 and n not in shards and n not in whole] == []
    held = sum(math.prod(shards[n].local_shape) if n in shards else p.numel() for n, p in params.items())
    assert held / sum(p.numel() for p in params.values()) <= 1 / tp + 0.12, (tp, held)
    return {"plan": plan, "shards": shards, "whole": whole}


@SHARED
@pytest.mark.parametrize("kind", list(ADAPTERS))
def test_adapter_is_cut_with_its_projection(kind: str):
    model, _, _, gm = spelling("adapter_models", kind)
    for tp in (2, 4):
        found = _check_plan(model, gm, tp)
        shards, whole = found["shards"], found["whole"]
        for w, (a, b) in ADAPTERS[kind].items():
            cut, up = shards[w], shards[b]
            # B's rows cut as W's: each rank the same output features, fused gate | up segment by segment
            assert (up.role, up.dim, up.segments) == ("column", 0, cut.segments), (tp, w, up, cut)
            assert up.local_shape == (cut.local_shape[0], R), (tp, b, up)
            assert a not in shards and whole[a].startswith("down-projection kept whole"), (tp, a, whole.get(a))
        if kind != "lora_matmul":
            gate_up = shards["shared.gate_up.weight" if kind == "lora_module" else "blocks.0.mlp.gate_up.weight"]
            assert [(g.size, g.parts) for g in gate_up.segments] == [(FF, tp)] * 2, (tp, gate_up)
        # per pair: the row's all-reduce forward; backward f of the input (b·s·h) and one f of r per adapter
        for m, (fwd, bwd, adapters) in SUMS[kind].items():
            sums = sorted((c.op, c.direction, c.shape[-1]) for c in found["plan"].collectives if c.module == m)
            assert sums == sorted([("sum", "backward", str(H))] * bwd + [("sum", "backward", str(R))] * adapters
                                  + [("sum", "forward", str(H))] * fwd), (tp, m, sums)

@SHARED
def test_adapter_of_a_row_is_row_parallel_beside_it():
    """Adapters on the row projections (attention's o, the MLP's proj): A reads the row's sharded input, so it is
    row-parallel beside the row, its rows cut alike (one more all-reduce forward, of b·s·r); B reads A's all-reduced
    output whole, and stays whole on every rank, named."""
    model, _, _, gm = spelling("adapter_models", "lora_rows")
    for tp in (2, 4):
        found = _check_plan(model, gm, tp)
        shards, whole = found["shards"], found["whole"]
        for row, a, b, m in (("attn.o.weight", "attn.oa", "attn.ob", "attn"),
                             ("mlp.proj.weight", "mlp.a", "mlp.b", "mlp")):
            cut, down = shards[f"blocks.0.{row}"], shards[f"blocks.0.{a}"]
            assert (down.role, down.dim, down.segments) == ("row", 1, cut.segments), (tp, a, down, cut)
            assert whole[f"blocks.0.{b}"].startswith("post-row linear kept whole"), (tp, b, whole)
            sums = sorted((c.op, c.direction, c.shape[-1]) for c in found["plan"].collectives
                          if c.module == f"blocks.0.{m}")
            expected = [("sum", "backward", str(H)), ("sum", "forward", str(R)), ("sum", "forward", str(H))]
            assert sums == sorted(expected), (tp, m, sums)


def test_zamba2_shared_block_is_cut_with_its_adapters():
    """Hugging Face's Zamba2, 2 hybrid layers sharing one transformer block, adapters on q, k, v and gate_up_proj:
    nothing replicated at tp 2 and 4; gate_up_proj and each layer's adapter B cut alike (gate | up per segment),
    down_proj row-parallel, each layer's own linear of the block's output whole (it reads down_proj's all-reduced
    output)."""
    model, args, kwargs = build("zamba2")
    gm = capture(model, args, kwargs)[0]
    ff = "model.layers.1.shared_transformer.feed_forward"
    attn = "model.layers.1.shared_transformer.self_attn"
    for tp in (2, 4):
        found = _check_plan(model, gm, tp)
        shards, whole = found["shards"], found["whole"]
        gate_up = shards[f"{ff}.gate_up_proj.weight"]
        assert [(g.size, g.parts) for g in gate_up.segments] == [(128, tp)] * 2, (tp, gate_up)
        assert shards[f"{ff}.down_proj.weight"].role == "row"
        for i in range(2):
            assert shards[f"{ff}.gate_up_proj_adapter_list.{i}.1.weight"].segments == gate_up.segments
            for w in "qkv":
                up = shards[f"{attn}.linear_{w}_adapter_list.{i}.1.weight"]
                assert up.segments == shards[f"{attn}.{w}_proj.weight"].segments, (tp, w, up)
            assert whole[f"model.layers.{i}.linear.weight"].startswith("post-row linear kept whole"), whole


PARITY = Launches({2: {"adapters": (pattern_parity, ["lora_linear"], 3, False, "adapter_models")}},
                  extended={2: {"adapters_more": (pattern_parity, ["lora_matmul", "lora_module", "lora_rows", *HF], 3,
                                                  False, "adapter_models")},
                            4: {"adapters_more": (pattern_parity, [*WRITTEN, *HF], 3, False, "adapter_models")}})
# spelling -> all-reduces of a step: forward b·s·h (the rows') and b·s·r (a row adapter's A), backward b·s·h (f of
# each pair's input, the head's) and b·s·r (f of a column adapter's A output)
STEPS = {"lora_matmul": (5, 0, 5, 2), "lora_linear": (5, 0, 5, 6), "lora_module": (7, 0, 7, 8),
         "lora_rows": (5, 4, 5, 0)}


def _check_run(by_rank: dict, kinds: list[str], world: int) -> None:
    bsh, bsr, bs = 2 * S * H, 2 * S * R, 2 * S
    for rank, by_kind in by_rank.items():
        assert list(by_kind) == kinds, (rank, list(by_kind))
        for kind, r in by_kind.items():  # every kind's numbers first
            assert_exact(r, (rank, kind))
        for kind, r in by_kind.items():
            assert_fully_sharded(r, world, (rank, kind))
            if kind in HF:
                continue
            fwd, fwd_r, bwd, bwd_r = STEPS[kind]
            forward = [("all_reduce", "sum", bsh)] * fwd + [("all_reduce", "sum", bsr)] * fwd_r + \
                [("all_reduce", "max", bs)] + [("all_reduce", "sum", bs)] * 2
            assert sorted(r["forward"]) == sorted(forward), (rank, kind, r["forward"])
            backward = [("all_reduce", "sum", bsh)] * bwd + [("all_reduce", "sum", bsr)] * bwd_r
            assert sorted(r["backward"]) == sorted(backward), (rank, kind, r["backward"])


@pytest.mark.slow
def test_adapters_train_exactly_with_megatron_collectives():
    """3 AdamW steps at world 2 (q, v and gate | up adapters written ``F.linear(F.linear(x, A), B)``): loss,
    gradients and parameters within 1e-5, at most 1/2 + 0.12 of the parameters per rank; forward Megatron's
    all-reduces (2 per layer and the embedding's of b·s·h, the loss's max and two sums of b·s), backward
    Megatron's f per pair and the head's (b·s·h) and one f of b·s·r per adapter (A's output entering B)."""
    _check_run(PARITY(2, "adapters"), ["lora_linear"], 2)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("world", [2, 4])
def test_every_adapter_spelling_trains_exactly(world: int):
    """The other spellings and Zamba2 at world 2, every one at world 4: exact, fully sharded, and for the
    hand-written ones Megatron's all-reduces plus one f of b·s·r per column adapter and one all-reduce of b·s·r
    forward per row adapter."""
    kinds = ["lora_matmul", "lora_module", "lora_rows", *HF] if world == 2 else [*WRITTEN, *HF]
    _check_run(PARITY(world, "adapters_more"), kinds, world)
