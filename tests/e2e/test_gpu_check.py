"""benchmarks/gpu_check.py: its CPU mode runs every code path of the GPU check; and what the GPU check found,
held here without a GPU: a capture on stand-ins keeps no dtype assertion (under a device's autocast the
capture on meta saw fp32 where the call sees bf16), constants made on the capture's device move to the
model's, torch's fake process group (one rank's compute alone) runs a step, and the plan's facts of a model
of blocks alone read its hidden size from the residual stream."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._ops import ops

import autotp
from autotp.capture.structure import flatten
from autotp.capture.tracer import capture, retarget_device
from small_models import MODELS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

COLUMNS = ["section", "check", "measured", "bound / reference", "result", "note"]


@pytest.fixture
def fake_tp(request):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=request.param)
    yield request.param
    dist.destroy_process_group()


def test_capture_keeps_no_dtype_assertions():
    model, args, kwargs = MODELS["llama"]()  # RMSNorm's .to(float32), attention's .to(query.dtype)
    gm, _ = capture(model, args, kwargs)
    assert not [n for n in gm.graph.nodes if n.target is ops.aten._assert_tensor_metadata.default]
    outs = gm(*flatten((args, kwargs))[0])  # the graph takes the call's tensors flat
    assert any(o.shape == want.shape and torch.equal(o, want) for o in outs
               for want in [model(*args, **kwargs).logits])


class _Constant(nn.Module):
    """A constant built from Python data in forward (a cache's ``torch.tensor([])``): export lifts it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.tensor([[1.0, 2.0]]), self.proj(x)])


def test_retarget_moves_constants_to_the_model_device():
    gm, _ = capture(_Constant(), (torch.ones(1, 2),), {})
    consts = [n.target for n in gm.graph.nodes if n.op == "get_attr" and not n.target.startswith("proj.")]
    assert consts and all(getattr(gm, c).device.type == "cpu" for c in consts)
    retarget_device(gm, torch.device("meta"), torch.device("cpu"))  # any other device: meta stands in for cuda
    assert all(getattr(gm, c).device.type == "meta" for c in consts)
    assert gm.proj.weight.device.type == "cpu"  # parameters are the model's, bound later: untouched


@pytest.mark.parametrize("fake_tp", [8], indirect=True)
def test_one_rank_on_the_fake_group_runs_a_training_step(fake_tp: int):
    """Collectives of torch's fake backend return at once and never report completion: autotp waits on them
    (it polls gloo's alone), so one rank's step runs with no peers."""
    from gpu_check_compute import Stack
    from llama_shaped import Config

    c = Config(hidden_size=64, intermediate_size=224, num_attention_heads=16, num_key_value_heads=8,
               max_position_embeddings=16)
    x = torch.randn(2, 16, 64)
    model = autotp.parallelize(Stack(c, 2), example_inputs=((x,), {}))
    model(x.requires_grad_()).sum().backward()
    assert model.layers[0].mlp.gate_proj.weight.grad.shape == (224 // fake_tp, 64)
    assert x.grad.shape == x.shape


def test_costs_of_a_model_of_blocks_alone():
    from autotp.search.model_costs import capture_costs
    from gpu_check_compute import Stack
    from llama_shaped import Config

    c = Config(hidden_size=64, intermediate_size=224, num_attention_heads=16, num_key_value_heads=8,
               max_position_embeddings=16)
    with torch.device("meta"):
        net = Stack(c, 2)
    costs = capture_costs(net, (torch.zeros(1, 16, 64, device="meta"),), {}, [8], 1, 16)
    assert (costs.layers, costs.hidden, costs.heads, costs.vocab) == (2, 64, 16, None)  # not the rotary's 4


@pytest.mark.slow
@pytest.mark.extended  # the whole GPU check on CPU ranks: run before a GPU session, not in CI
def test_gpu_check_cpu_mode(tmp_path):
    """The whole script in its CPU mode: every exactness row passes, every section has rows, and the table
    has the GPU run's columns."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--cpu", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "250"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu-cpu.json").read_text())
    assert result["exact"] and all(r["ok"] for r in result["exact"]), result["exact"]
    assert {r["check"] for r in result["exact"]} >= {"nanogpt fp32", "nanogpt bf16 autocast", "llama fp32",
                                                     "nanogpt compile=True (aot_eager)",
                                                     "llama KV-cache greedy decode: tokens differing"}
    assert result["world_one"]["ok"] and result["world_one"]["backend"] == "gloo"
    assert {(r["tp"], r["compiled"]) for r in result["compute"]} >= {(1, False), (2, False), (4, False),
                                                                     (8, False), (8, True)}
    assert len(result["memory"]) == 4 and all("predicted" in r for r in result["memory"])
    assert result["allreduce"] and result["settings"]["cuda.matmul.allow_tf32"] is False
    header = next(line for line in proc.stdout.splitlines() if "section" in line and "check" in line)
    assert all(col in header for col in COLUMNS), header
