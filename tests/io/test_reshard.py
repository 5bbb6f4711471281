"""Resharding: a checkpoint written by ``autotp shard --tp 4`` loads at tp 2, at tp 1 and into the
unsharded model, with identical weights and the same outputs."""
from __future__ import annotations

import pytest

import json
import os
from pathlib import Path

import torch
from typer.testing import CliRunner

from autotp.cli.main import app
from ranks import ROOT, launch

NANOGPT = os.path.join(ROOT, "examples", "nanogpt.py")


def _load_at(out: str, tp: int) -> dict:
    import nanogpt

    import autotp
    from autotp.io.checkpoint import load_checkpoint, load_unsharded
    from autotp.distributed.launch import init_distributed

    ctx = init_distributed(tp=tp)
    idx, targets = nanogpt.example_batch()
    tpm = autotp.parallelize(nanogpt.build_model(), tp_group=ctx.tp_group(), example_inputs=(idx, targets)).eval()
    path = Path(out, "checkpoint")
    if tp == 1:
        load_unsharded(tpm, None, path)  # full tensors: the same loader as the unsharded model
    else:
        load_checkpoint(tpm, ctx, path)
    with torch.no_grad():
        logits, loss = tpm(idx, targets)
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {"loss": loss.item(), "logits": logits, "state": autotp.full_state_dict(tpm)}


@pytest.mark.slow
def test_tp4_checkpoint_loads_at_tp2_tp1_and_unsharded(tmp_path):
    import nanogpt

    from autotp.io.checkpoint import load_unsharded

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["shard", NANOGPT, "--tp", "4", "--steps", "2", "--out", str(out)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    final = json.loads((out / "summary.json").read_text())["final_loss"]

    model = nanogpt.build_model().eval()
    untrained = {k: v.clone() for k, v in model.state_dict().items()}
    load_unsharded(model, None, out / "checkpoint")
    assert not torch.equal(untrained["transformer.h.0.attn.c_attn.weight"],
                           model.state_dict()["transformer.h.0.attn.c_attn.weight"])
    with torch.no_grad():
        ref_logits, ref_loss = model(*nanogpt.example_batch())
    assert abs(ref_loss.item() - final) < 1e-5
    ref_state = model.state_dict()

    for tp in (2, 1):
        for r in launch(_load_at, tp, str(out), tp).values():
            assert sorted(r["state"]) == sorted(ref_state)
            assert all(torch.equal(r["state"][k], ref_state[k]) for k in ref_state), f"weights differ at tp {tp}"
            assert abs(r["loss"] - ref_loss.item()) < 1e-5
            assert (r["logits"] - ref_logits).abs().max().item() < 1e-5
