"""Functions that run inside each gloo rank of the resume tests: train, save, resume at another layout.

Every replica trains on the same batch, so a run at tp × dp follows the same trajectory as one at tp × 1
and a resumed run can be compared with an uninterrupted one parameter for parameter.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import autotp
from autotp.cli.shard_worker import data_parallel, train_step
from autotp.io.ckpt_io import latest_checkpoint, load_training_state, save_training_state
from autotp.distributed.launch import init_distributed
from small_models import gpt2, llama
from moe_models import build as moe
from pattern_models import build

# GPT-2 with a vocabulary no tp divides (127 rows: padded at tp 2 and 4); Llama with 2 kv heads (replicated
# at tp 4); Falcon's fused [2 kv groups, q heads + k + v, d] (whole groups at tp 2, split groups at tp 4);
# experts fused as 3-D parameters with gate | up stacked (each segment cut per expert)
MODELS = {"gpt2_padded": lambda: gpt2(vocab=127), "llama_gqa": llama, "falcon_grouped": lambda: build("grouped_index"),
          "moe_gate_up": lambda: moe("gathered_bmm")}
SAVE_TP, BEFORE, AFTER = 2, 3, 3


def _job(name: str, tp: int):
    ctx = init_distributed(tp=tp)
    model, args, kwargs = MODELS[name]()
    tpm = autotp.parallelize(model, tp_group=ctx.tp_group(), example_inputs=(args, kwargs))
    # eps 1e-6 as in the parity tests: gradients that are zero analytically (a key bias) are fp32 noise that
    # differs with the tp; Adam at eps 1e-8 would scale it up to ±lr
    opt = torch.optim.AdamW(tpm.parameters(), lr=1e-3, eps=1e-6)
    return ctx, tpm, opt, data_parallel(tpm, ctx), args, kwargs


def _train(model, opt, args: tuple, kwargs: dict, steps: int) -> None:
    for _ in range(steps):
        train_step(model, opt, args, kwargs)


def _resume(out: Path, name: str, tp: int) -> dict:
    ctx, tpm, opt, model, args, kwargs = _job(name, tp)
    resumed = load_training_state(latest_checkpoint(out / name), tpm, opt, ctx)
    _train(model, opt, args, kwargs, AFTER)
    return {"step": resumed.step, "note": resumed.describe(), "state": autotp.full_state_dict(tpm)}


def save_then_resume(out: str, resume_tps: tuple[int, ...], names: tuple[str, ...] = tuple(MODELS)) -> dict:
    """At tp 2: train 3 steps, save, train 3 more (the uninterrupted reference); then resume at each of
    ``resume_tps`` (dp = world / tp) and train 3 steps. Rank 0 returns {model: {"reference"|(tp, dp): ...}}."""
    out_dir, results = Path(out), {}
    for name in names:
        ctx, tpm, opt, model, args, kwargs = _job(name, SAVE_TP)
        _train(model, opt, args, kwargs, BEFORE)
        save_training_state(out_dir / name, BEFORE, tpm, opt, ctx)
        _train(model, opt, args, kwargs, AFTER)
        results[name] = {"reference": autotp.full_state_dict(tpm)}
        for tp in resume_tps:
            results[name][(tp, dist.get_world_size() // tp)] = _resume(out_dir, name, tp)
    return results if dist.get_rank() == 0 else {}


def resume_only(out: str, resume_tps: tuple[int, ...], names: tuple[str, ...] = tuple(MODELS)) -> dict:
    """Resume each of ``names``' checkpoints at each of ``resume_tps`` (dp = world / tp), 3 steps each."""
    results = {name: {(tp, dist.get_world_size() // tp): _resume(Path(out), name, tp) for tp in resume_tps}
               for name in names}
    return results if dist.get_rank() == 0 else {}
