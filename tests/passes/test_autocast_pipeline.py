"""Autocast regions inside pipeline stages: the captured graph cut into stages as ``autotp.pipeline`` cuts it
(:func:`autotp.passes.split_stages`), each stage's piece outlines the regions it holds under their own
``torch.autocast``, and the stages run one after another, as ``PipelineStage`` hands each what the previous
one returned, compute what the model computes under an outer bf16 autocast, to the bit. Structural: one
process, no process group."""
from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from autotp.capture.structure import flatten, unflatten
from autotp.capture.tracer import capture
from autotp.passes import outline_autocast, run_passes, split_stages
from autotp.plan.planner import make_plan
from autotp.plan.stages import StageRequest
from autotp.operators.autocast import Autocast, region_of
from autotp.passes.tagged_regions import tagged_regions
from autotp.operators.stages import StageModule, input_name, wire_stages
from autotp.operators.pieces import bind_pieces
from autocast_models import KINDS, build, rotate_plain
from pattern_models import HD, NH, H, V, RMSNorm, SwiGLU, build_with

LOSS = 1  # every model here returns (logits, loss): the loss is flat output 1
BF16 = dict(device_type="cpu", dtype=torch.bfloat16)
# the autocast regions (runs of tagged nodes) each of the two stages (blocks.0 | blocks.1) holds
RUNS = {"qk_norm_with": (1, 1), "qk_norm_decorated": (2, 2), "rope_decorated": (2, 2),
        "final_norm_with": (0, 3),  # the final norm's region and the one nested in it: the last stage's
        "rope_matmul_with": (1, 1)}


class _Attention(nn.Module):
    """Rotary attention that rotates in fp32 and leaves the score matmul to the caller's autocast."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, NH, HD) for proj in (self.q, self.k, self.v))
        q, k = (rotate_plain(t.float(), cos, sin).transpose(1, 2) for t in (q, k))  # fp32
        att = (q @ k.transpose(-2, -1)) / math.sqrt(HD) + mask  # bf16 under the outer autocast
        return self.o((att.softmax(-1) @ v.transpose(1, 2)).transpose(1, 2).reshape(b, s, H))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2, self.attn, self.mlp = RMSNorm(H), RMSNorm(H), _Attention(), SwiGLU()

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.n1(x), cos, sin, mask)
        return x + self.mlp(self.n2(x))


class RootTables(nn.Module):
    """Rotary tables and the causal mask made once, before the blocks, in fp32 under ``with
    torch.autocast(device_type, enabled=False)`` (Hugging Face's Llama rotary embedding), and read by every
    block: a later pipeline stage makes them again instead of receiving them."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD)), persistent=False)
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])
        self.norm, self.head = RMSNorm(H), nn.Linear(H, V, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        s = idx.shape[1]
        pos = torch.arange(s, device=x.device)[None, None, :].float()
        with torch.autocast(x.device.type, enabled=False):
            freqs = (self.inv_freq[None, :, None].float() @ pos).transpose(1, 2)  # (1, s, hd/2)
            cos, sin = freqs.cos()[0, :, None, :], freqs.sin()[0, :, None, :]
            mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
        for blk in self.blocks:
            x = blk(x, cos, sin, mask)
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _root_tables():
    torch.manual_seed(0)
    return build_with(RootTables())


def _stages(model: nn.Module, args: tuple, outline: bool = True):
    """The model captured under an outer bf16 autocast (as ``autotp.pipeline`` captures a step made under
    one), cut into two stages, its regions outlined (``outline``); the top graph, the plan, each stage's
    piece and how many regions (runs of tagged nodes) each piece held before the outlining."""
    with torch.autocast(**BF16):
        gm, spec = capture(model, args, {}, static=True)
    plan = make_plan(gm, 1, stages=StageRequest(2))
    top = run_passes(run_passes(gm, plan), plan, (split_stages,))
    pieces = [top.get_submodule(w.piece).piece for w in wire_stages(top, LOSS)]
    runs = tuple(len(tagged_regions(p, region_of)) for p in pieces)
    if outline:
        assert outline_autocast(top) == sum(runs)  # the regions of every stage's piece
    bind_pieces(top, model)
    return top, spec, plan, pieces, runs


def _run(top: fx.GraphModule, spec, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits (the top graph) and the loss of the stages run one after another as ``StageModule``s,
    each given what the previous one returned and the graph's inputs locally."""
    flat = flatten((args, {}))[0]
    wirings = wire_stages(top, LOSS)
    inputs = {input_name(i): t for i, t in enumerate(flat)}
    received: tuple = ()
    for w in wirings:
        out = StageModule(top, w, [], w is wirings[-1])(*received, **inputs)
        received = out if isinstance(out, tuple) else (out,)
    return unflatten(top(*flat), spec)[0], received[0].reshape(())


def _autocast_inside(top: fx.GraphModule) -> list[bool]:
    """Records, each time an outlined region runs, whether the CPU autocast is on inside it."""
    seen: list[bool] = []
    for m in top.modules():
        if isinstance(m, Autocast):
            m.region.register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    return seen


def _ops(region: Autocast) -> list:
    return [n.target for n in region.region.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_regions_of_pipeline_stages_run_under_their_autocast_again(kind: str):
    """Each stage outlines the regions of the blocks (or the final norm) it holds, and nothing else: each
    runs with autocast off inside the outer bf16 one, and the stages one after another give the model's
    logits and loss to the bit. Without the outlining the rotary tables' fp32 matmul would run in bf16."""
    model, args, _ = build(kind)
    top, spec, plan, pieces, runs = _stages(model, args)
    assert [s.blocks for s in plan.stages] == [("blocks.0",), ("blocks.1",)]
    assert runs == RUNS[kind]
    for piece, n in zip(pieces, runs):
        outlined = [m for m in piece.modules() if isinstance(m, Autocast)]
        assert len(outlined) == n and all(m.settings.enabled is False for m in outlined)
        left = [node for node in piece.graph.nodes if region_of(node) is not None]  # the outputs' reads only
        assert all(node.target is operator.getitem and node.args[0].op == "call_module" for node in left), left
    seen = _autocast_inside(top)
    with torch.no_grad(), torch.autocast(**BF16):
        want_logits, want = model(*args)
        logits, loss = _run(top, spec, args)
    assert logits.dtype == want_logits.dtype == torch.bfloat16
    assert torch.equal(logits, want_logits) and torch.equal(loss, want)
    assert seen == [False] * 2 * sum(runs)  # each region, once for the logits and once in the stages
    if kind == "rope_matmul_with":
        plain = _stages(*build(kind)[:2], outline=False)
        with torch.no_grad(), torch.autocast(**BF16):
            assert not torch.equal(_run(plain[0], plain[1], args)[1], want)


def test_a_region_made_again_in_a_later_stage_holds_only_its_own_ops():
    """Rotary tables and a mask made in fp32 before the blocks, read by both stages: the second stage makes
    them again, and its outlined region holds exactly the ops of the model's region (not the block's fp32
    rotation or its score matmul between the reads of the tables and of the mask, which would then run in
    fp32): the stages give the model's loss to the bit, and without the outlining they do not."""
    model, args, _ = _root_tables()
    top, spec, plan, pieces, runs = _stages(model, args)
    assert [s.blocks for s in plan.stages] == [("blocks.0",), ("blocks.1",)]
    assert runs == (1, 1)
    first, second = ([m for m in p.modules() if isinstance(m, Autocast)] for p in pieces)
    assert len(first) == len(second) == 1
    assert _ops(second[0]) == _ops(first[0])
    assert torch.ops.aten.matmul.default in _ops(first[0])  # the rotary tables' fp32 matmul
    seen = _autocast_inside(top)
    with torch.no_grad(), torch.autocast(**BF16):
        want_logits, want = model(*args)
        logits, loss = _run(top, spec, args)
    assert torch.equal(logits, want_logits) and torch.equal(loss, want)
    assert seen == [False] * 4
    plain = _stages(*_root_tables()[:2], outline=False)
    with torch.no_grad(), torch.autocast(**BF16):
        assert not torch.equal(_run(plain[0], plain[1], args)[1], want)
