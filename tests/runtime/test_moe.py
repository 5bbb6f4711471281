"""Expert tensor parallelism: every expert's FFN cut column→row (its 3-D fused weights too: per expert in a
loop, gathered per token for bmm/einsum, or whole for a grouped GEMM), one all-reduce of the router-weighted
sum per MoE layer, the router whole and the same on every rank, a shared expert cut like a dense MLP beside
them and its sigmoid gate whole; in the spellings of tests/support/moe_models.py and in Hugging Face's own classes."""
from __future__ import annotations

import math
import os

import pytest
import torch

from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan
from ranks import Launches
from moe_models import AUX, DR, E, KINDS, KR, QR, H, S, build, collectives
from parity_workers import pattern_parity

LAYERS = 2
# how each kind stores its experts: parameter (under blocks.N.moe) -> (dim cut, segments)
FUSED = {"fused_loop": {"w1": (1, 1), "w3": (1, 1), "w2": (2, 1)},
         "fused_loop_t": {"w1": (2, 1), "w3": (2, 1), "w2": (1, 1)},
         "gathered_bmm": {"gate_up": (1, 2), "down": (2, 1)},
         "gathered_einsum": {"w1": (1, 1), "w3": (1, 1), "w2": (2, 1)}}
FUSED["shared_sigmoid"] = FUSED["top1_aux"] = FUSED["capacity"] = FUSED["mla_cat"] = FUSED["mla_copy"] = FUSED["fused_loop"]
# latent attention: the down-projections whole by design, the up-projections cut by heads (each head's
# non-rotary | rotary q and its k | v), the output projection by rows
MLA = {"q_down": None, "kv_down": None, "q_up": (0, "column"), "kv_up": (0, "column"), "o": (1, "row")}


HF = ["mixtral", "mixtral:batched_mm", "qwen2_moe", "deepseek_v3", "gpt_oss", "ernie4_5_moe"]
# (at tp 4 one Hugging Face model per expert form: grouped GEMM, grouped with latent attention, grouped with biases)
# (the extended run adds the others' forms at tp 4: grouped GEMM, grouped with biases)
HF_AT = {2: ["mixtral", "deepseek_v3"], 4: ["deepseek_v3"]}
# at tp 2 by default, and at tp 4 (one expert per rank) in the extended run: a fused and a gathered expert layout
# and latent attention; the extended run adds one of each other routing at tp 4 and the other spellings at tp 2
# (each spelling's plan at tp 2 and 4 is checked below)
KINDS_AT = {2: ["fused_loop_t", "gathered_einsum", "mla_cat"], 4: ["fused_loop_t", "gathered_einsum", "mla_cat"]}
REST = {"spellings rest": ["list_dense", "shared_sigmoid", "capacity"],
        "hugging face rest": ["mixtral", "gpt_oss", "ernie4_5_moe"]}
OTHERS_AT_2 = {"spellings others": [k for k in KINDS if k not in KINDS_AT[2]],
               "hugging face others": [k for k in HF if k not in HF_AT[2]]}


@pytest.fixture(scope="module")
def runs() -> Launches:
    """Both multi-process tests' jobs in one launch per world."""
    # tp 4 in the extended run (four ranks on CI's two cores cost the most of any launch)
    return Launches({2: {"spellings": (pattern_parity, KINDS_AT[2], 3, False, "moe_models"),
                         "hugging face": (pattern_parity, HF_AT[2], 3, False, "hf_moe_models")}},
                    extended={2: {"spellings others": (pattern_parity, OTHERS_AT_2["spellings others"], 3, False,
                                                       "moe_models"),
                                  "hugging face others": (pattern_parity, OTHERS_AT_2["hugging face others"], 3,
                                                          False, "hf_moe_models")},
                              4: {"spellings": (pattern_parity, KINDS_AT[4], 3, False, "moe_models"),
                                  "hugging face": (pattern_parity, HF_AT[4], 3, False, "hf_moe_models"),
                                  "spellings rest": (pattern_parity, REST["spellings rest"], 3, False, "moe_models"),
                                  "hugging face rest": (pattern_parity, REST["hugging face rest"], 3, False,
                                                        "hf_moe_models")}})


def _parts(name: str) -> list:
    return [(2, name), pytest.param(2, f"{name} others", marks=pytest.mark.extended),
            pytest.param(4, name, marks=pytest.mark.extended),
            pytest.param(4, f"{name} rest", marks=pytest.mark.extended)]


@pytest.mark.parametrize("kind", KINDS)
def test_expert_weights_are_cut_and_the_router_kept_whole_by_design(kind: str):
    """No process group: every expert weight at 1/tp on the dim of its features (gate | up as two segments),
    the router (and a gate) whole with a reason that names it, nothing left replicated, one all-reduce per
    MoE layer forward."""
    model, args, _ = build(kind)
    gm = capture(model, args, {})[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), plan.replicated
        whole = {w.name: w.reason for w in plan.whole}
        for i in range(LAYERS):
            moe = f"blocks.{i}.moe"
            assert whole.pop(f"{moe}.router.weight").startswith("router kept whole: its 64→4 linear")
            for name, cut in MLA.items() if kind.startswith("mla") else ():
                if cut is None:
                    assert whole.pop(f"blocks.{i}.attn.{name}.weight").startswith("down-projection kept whole: ")
                    continue
                shard = plan.param(f"blocks.{i}.attn.{name}.weight")
                assert (shard.dim, shard.role) == cut and math.prod(shard.local_shape) * tp == math.prod(shard.full_shape)
            if kind == "shared_sigmoid":
                assert whole.pop(f"{moe}.shared_gate.weight").startswith("gate kept whole: its 64→1 linear")
            for name, (dim, segments) in FUSED.get(kind, {}).items():
                shard = plan.param(f"{moe}.{name}")
                assert shard.dim == dim and len(shard.segments) == segments, (name, shard)
                assert math.prod(shard.local_shape) * tp == math.prod(shard.full_shape) and shard.full_shape[0] == E
            for e in range(E) if kind.startswith("list") else ():
                for w, role in (("w1", "column"), ("w3", "column"), ("w2", "row")):
                    shard = plan.param(f"{moe}.experts.{e}.{w}.weight")
                    assert shard.role == role and shard.dim == (0 if role == "column" else 1), shard
        assert whole == {}, whole
        # forward all-reduces of activations (b, s, h): the embedding's, then one per attention and MoE layer
        forward = [c for c in plan.collectives if c.direction == "forward" and c.shape[-1:] == (str(H),)]
        assert len(forward) == 1 + 2 * LAYERS, [(c.module, c.node, c.shape) for c in forward]
        assert sum(c.module.startswith(f"blocks.{i}.moe") for c in forward for i in range(LAYERS)) == LAYERS, forward


def test_an_expert_that_cannot_be_cut_keeps_all_experts_of_its_weights_whole():
    """The experts of a loop share their 3-D parameters: when one expert's pair cannot be cut (a softmax over
    its hidden features), the others are not cut either, and the plan says which expert and why."""
    model, args, _ = build("fused_loop_odd")
    plan = make_plan(capture(model, args, {})[0], 2)
    for i in range(LAYERS):
        for w in ("w1", "w2", "w3"):
            assert plan.param(f"blocks.{i}.moe.{w}") is None
    reasons = [r for m, r in plan.replicated if m == "blocks.0.moe"]
    assert any("softmax over the sharded dim" in r for r in reasons), plan.replicated
    assert any(f"expert {E - 1} of blocks.0.moe.w1" in r or f"expert {E - 1} of blocks.0.moe.w3" in r
               for r in reasons), plan.replicated
    whole = {w.name: w.reason for w in plan.whole}
    assert "blocks.0.moe.w1" in whole and "expert" in whole["blocks.0.moe.w1"], whole


@pytest.mark.slow
@pytest.mark.parametrize("world,part", _parts("spellings"))
def test_moe_spellings_shard_exactly_with_one_all_reduce_per_layer(runs, world: int, part: str):
    """3 AdamW steps within 1e-5 of the unsharded model (load-balancing losses included), every expert
    weight at 1/tp, and exactly: forward one all-reduce per attention and per MoE layer (b·s·h); backward one
    entering each, plus the router's weights once per layer (b·s·k, or b·s·E for a dense routing matrix)."""
    results = runs(world, part)
    bsh, rows = 2 * S * H, 2 * S
    for rank, by_kind in results.items():
        assert list(by_kind) == {**REST, **OTHERS_AT_2}.get(part, KINDS_AT[world])
        for kind, r in by_kind.items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert r["replicated"] == [] and r["unexplained"] == [], (kind, r)
            # what is whole: the routers, gates and latent attention's down-projections (each with its reason);
            # every other 2-D or 3-D weight 1/tp
            small = {f"blocks.{i}.{m}.weight" for i in range(LAYERS)
                     for m in ("moe.router", "moe.shared_gate", "attn.q_down", "attn.kv_down")}
            assert set(r["quarter"]) <= small and set(r["whole"]) <= small, (kind, r["quarter"], r["whole"])
            forward, backward, router = collectives(kind, LAYERS)
            assert sorted(r["forward"]) == sorted(forward), kind
            if kind.startswith("mla"):  # attention's f on its latents (b·s·QR, b·s·KR) and the rotary key head
                latent = [("all_reduce", "sum", rows * n) for n in (QR, KR, DR)] * LAYERS
                mlp = [("all_reduce", "sum", bsh)] * (LAYERS + 1)
                assert sorted(r["backward"]) == sorted(mlp + latent + router), (kind, r["backward"])
                continue
            assert sorted(r["backward"]) == sorted(backward), (kind, r["backward"])
            assert kind not in AUX or r["loss_diff"] <= 1e-5



@pytest.mark.slow
@pytest.mark.parametrize("world,part", _parts("hugging face"))
def test_hugging_face_moe_models_shard_their_fused_experts(runs, world: int, part: str):
    """Mixtral (grouped GEMM, Hugging Face's default, and batched_mm), Qwen2-MoE (a shared expert with a
    sigmoid gate) and DeepSeek-V3 (latent attention, a dense first layer, then routed and shared experts),
    built from configs: exact, about half (tp 2) or a quarter (tp 4) of the model per rank, one all-reduce per
    attention and MoE layer forward; backward the routing weights (b·s·k) once per MoE layer (and Qwen2's
    shared-expert gate, b·s), and for DeepSeek attention's f on its latents (b·s·24, b·s·16) and on the rotary
    key head (b·s·8). GPT-OSS (experts with biases, gate and up interleaved; attention sinks): its experts'
    bias is added per (token, k) slot before the routing weights, so their all-reduce is of b·s·k·h, after the
    down-projection, where the bias is added once. Ernie-4.5-MoE (a dense first layer; a (1, E) correction bias
    added to the softmax scores topk chooses by, whole by design with its router; a shared expert)."""
    results = runs(world, part)
    assert all(list(by_kind) == {**REST, **OTHERS_AT_2}.get(part, HF_AT[world]) for by_kind in results.values())
    bsh, rows = 2 * 8 * 64, 2 * 8
    for rank, by_kind in results.items():
        for kind, r in by_kind.items():
            assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, kind, r)
            assert r["replicated"] == [] and r["unexplained"] == [], (kind, r)
            # (at tp 4 the 2 kv heads of Mixtral and Qwen2 are each held by 2 ranks, Megatron's way; DeepSeek's
            # latent down-projections are whole by design)
            assert r["fraction"] < 1 / world + (0.075 if kind == "deepseek_v3" else 0.04), (kind, r["fraction"])
            slots = [("all_reduce", "sum", 2 * bsh)] * LAYERS if kind == "gpt_oss" else []
            layers = LAYERS + 1 if kind == "gpt_oss" else 2 * LAYERS + 1
            assert sorted(c for c in r["forward"] if c[2] >= bsh) == sorted([("all_reduce", "sum", bsh)] * layers + slots), \
                (kind, r["forward"])
            small = sorted(c for c in r["backward"] if c[2] != bsh)
            entering = len([c for c in r["backward"] if c[2] == bsh])
            if kind == "deepseek_v3":
                # b·s·h entering the dense MLP, the MoE layer (routed and shared experts), the LM head
                latent = [("all_reduce", "sum", rows * n) for n in (24, 16, 8)] * LAYERS
                assert small == sorted(latent + [("all_reduce", "sum", rows * 2)]), (kind, small)
                assert entering == LAYERS + 1, (kind, r["backward"])
                continue
            if kind == "ernie4_5_moe":
                # one MoE layer (the first is dense): its routing weights' b·s·k; b·s·h entering attention twice,
                # the dense MLP, the LM head, and the MoE layer twice: its routed experts read the tokens through
                # the fp32 cast the router reads too (its replicated gradient must not be summed), so they enter
                # apart from the shared expert; at tp 4 the 2 kv heads' k and v weight blocks (16·64 each)
                assert small == [("all_reduce", "sum", rows * 2)], (kind, small)
                assert entering == 2 * LAYERS + 2 + (2 * LAYERS if world > 2 else 0), (kind, r["backward"])
                continue
            gate = [("all_reduce", "sum", rows)] * LAYERS if kind == "qwen2_moe" else []
            # (Qwen2's and GPT-OSS's k and v biases held by 2 ranks each at tp 4: gradients summed, 16 elements each)
            bias = [("all_reduce", "sum", 16)] * 2 * LAYERS if kind in ("qwen2_moe", "gpt_oss") and world > 2 else []
            # the routing weights multiply the experts' reduced output in GPT-OSS: no f for them
            router = [("all_reduce", "sum", rows * 2)] * LAYERS if kind != "gpt_oss" else []
            assert small == sorted(router + gate + bias), (kind, small)
            # entering attention and the MoE layer, the LM head; at tp 4 the k and v weight blocks of the 2 kv
            # heads held by 2 ranks each get their gradients summed (16·64 elements each, per layer)
            kv = 2 * LAYERS if world > 2 else 0
            assert entering == 2 * LAYERS + 1 + kv, (kind, r["backward"])


def test_autotp_plan_shows_experts_router_and_latent_down_projections(tmp_path):
    """``autotp plan`` of a model file with latent attention and fused experts: the router and the
    down-projections named by role, the experts' 3-D weights with their cut, the formula counting one
    all-reduce each way per MoE layer (not per expert)."""
    from typer.testing import CliRunner

    from autotp.cli.main import app
    from ranks import ROOT

    model_py = tmp_path / "moe_model.py"
    model_py.write_text(f"import sys\nsys.path.insert(0, {os.path.join(ROOT, 'tests', 'support')!r})\n"
                        "from moe_models import build\n"
                        "def build_model():\n    return build('mla_copy')[0]\n"
                        "def example_batch():\n    return build('mla_copy')[1]\n")
    result = CliRunner().invoke(app, ["plan", str(model_py), "--tp", "2"], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines() if line.count("│") > 5}
    assert "router (whole)" in rows["blocks.0.moe.router"], rows["blocks.0.moe.router"]
    assert "latent down-proj (whole)" in rows["blocks.0.attn.q_down"]
    assert "column (4 experts)" in rows["blocks.0.moe"] and "[4, 16, 64]" in rows["blocks.0.moe"], rows["blocks.0.moe"]
    # forward sums: the embedding, per layer attention and the MoE layer, the loss's two: 7, as the formula counts
    fwd = next(line for line in result.output.splitlines() if line.startswith("│ fwd ") and "all-reduce(sum)" in line)
    assert [c.strip() for c in fwd.split("│")[3:6]] == ["7", "7", "1.00"], fwd


class _BiasedRouterMoE(torch.nn.Module):
    """A router chosen among through a balancing bias: ``topk(logits + b)`` (Kolibri, DeepSeek-V3's correction
    bias) or ``argsort(logits + b)[:, :k]``, its weights the logits gathered at the choice, then sigmoid; experts
    every token, weighted by a dense routing matrix."""

    def __init__(self, spelling: str):
        super().__init__()
        from moe_models import Expert, V
        self.spelling = spelling
        self.emb, self.head = torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)
        self.router = torch.nn.Linear(H, E, bias=False)
        self.register_buffer("bias", torch.linspace(-0.1, 0.1, E))
        # Ernie-4.5-MoE's spelling: a (1, E) parameter with no gradient, squeezed and added to the softmax scores
        self.stats = torch.nn.Parameter(torch.linspace(-0.1, 0.1, E).view(1, E), requires_grad=False)
        self.experts = torch.nn.ModuleList(Expert() for _ in range(E))

    def forward(self, idx):
        x = self.emb(idx).flatten(0, 1)  # (T, h)
        logits = self.router(x)  # (T, E)
        if self.spelling == "topk":
            sel = torch.topk(logits + self.bias, 2, dim=-1)[1]
        elif self.spelling == "stats_param":
            sel = torch.topk(logits.softmax(-1) + self.stats.squeeze(), 2, dim=-1)[1]
        else:
            sel = torch.argsort(logits + self.bias, dim=-1, descending=True)[:, :2]
        w = logits.gather(1, sel).sigmoid()  # (T, 2)
        dense = torch.zeros_like(logits).scatter(-1, sel, w)
        x = x + sum(dense[:, e, None] * expert(x) for e, expert in enumerate(self.experts))
        return self.head(x).view(*idx.shape, -1)


@pytest.mark.parametrize("spelling", ["topk", "argsort", pytest.param("stats_param", marks=pytest.mark.extended)])
def test_a_router_chosen_among_through_a_bias_is_kept_whole_by_design(spelling: str):
    """Its 64→4 linear is read by an add (the bias) and a gather, not by an activation: still a router, kept
    whole by design (Megatron's), with its experts cut and nothing left replicated. A bias held as a (1, 4)
    parameter (Ernie-4.5-MoE's) reaches the loss only through topk's indices: whole by design with the router."""
    torch.manual_seed(0)
    gm = capture(_BiasedRouterMoE(spelling), (torch.randint(0, 96, (2, S)),), {})[0]
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        assert plan.replicated == (), plan.replicated
        whole = {w.name: w.reason for w in plan.whole}
        reads = "gather, softmax then add" if spelling == "stats_param" else "add, gather"
        assert whole["router.weight"].startswith(f"router kept whole: its 64→4 linear is read by {reads}"), whole
        assert spelling != "stats_param" or whole["stats"].startswith(
            "router kept whole: its 1×4 values reach the loss and the outputs only through the integer or boolean "
            "values of topk"), whole
        assert plan.param("experts.0.w1.weight").role == "column" and plan.param("experts.0.w2.weight").role == "row"
