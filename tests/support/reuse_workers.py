"""Ranks of tests/plan/test_plan_cache.py's restart test: a job parallelizes a model (capturing, storing its plan),
then a restarted job builds it on meta, shards it from the cached plan without capturing, loads its
weights mapped, and must compute what the first job and the unsharded model compute."""
from __future__ import annotations

import copy
import json
import os

import torch
import torch.distributed as dist

import autotp
from autotp.errors import PlanCacheError
from ranks import CollectiveLog
from small_models import llama, loss_and_logits


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def _step(model, args, kwargs) -> tuple[torch.Tensor, torch.Tensor, list]:
    log = CollectiveLog()
    with log:
        loss, logits = loss_and_logits(model(*args, **kwargs))
        loss.backward()
    return loss, logits, log.calls


def restart(folder: str) -> dict:
    os.environ["AUTOTP_CACHE_DIR"] = os.path.join(folder, "plans")  # the ranks' own: set before any lookup
    os.environ["AUTOTP_PLAN_CACHE"] = "1"  # the tests' default is off
    ref, args, kwargs = llama(layers=3)
    rank = dist.get_rank()
    if rank == 0:
        from safetensors.torch import save_model

        save_model(ref, os.path.join(folder, "model.safetensors"))
    out: dict = {}

    first = autotp.parallelize(copy.deepcopy(ref), example_inputs=(args, kwargs))
    st = autotp.tp_state(first)
    out["first"] = {"cached": st.cached is not None, "graphs": len(st.graphs)}
    loss1, logits1, calls1 = _step(first, args, kwargs)
    dist.barrier()  # both ranks have stored the plan

    with autotp.empty_weights():  # the restarted job: nothing of the first one in memory
        model = llama(layers=3)[0]
    model = autotp.parallelize(model, example_inputs=(args, kwargs))
    st = autotp.tp_state(model)
    out["restart"] = {"cached": st.cached is not None, "graphs": len(st.graphs),
                      "from": os.path.dirname(st.cached_from),
                      "same_shards": st.shards == autotp.tp_state(first).shards}
    loaded = autotp.load_weights(model, os.path.join(folder, "model.safetensors"), mmap=True)
    out["mapped"] = loaded.mapped
    model.eval(), ref.eval()  # the first call another signature than the cached plan's: checked against it
    with torch.no_grad():
        out["eval_logits"] = _diff(model(args[0] if args else kwargs["input_ids"]).logits,
                                   ref(kwargs["input_ids"]).logits)
    model.train(), ref.train()
    loss, logits, calls = _step(model, args, kwargs)
    rloss, rlogits = loss_and_logits(ref(*args, **kwargs))
    rloss.backward()
    grads = dict(first.named_parameters())
    out["graphs_after"] = len(st.graphs)
    out["loss"] = max(_diff(loss, rloss), _diff(loss, loss1))
    out["logits"] = max(_diff(logits, rlogits), _diff(logits, logits1))
    out["grads"] = max(_diff(p.grad, grads[n].grad) for n, p in model.named_parameters())
    out["same_collectives"] = calls == calls1 and len(calls) > 0

    other = autotp.parallelize(copy.deepcopy(ref), example_inputs=(args, kwargs), vocab_multiple=48)
    out["other_option_cached"] = autotp.tp_state(other).cached is not None

    dist.barrier()
    plans = os.path.join(folder, "plans")
    if rank == 0:  # a plan changed after it was written
        for name in os.listdir(plans):
            path = os.path.join(plans, name)
            data = json.loads(open(path).read())
            data["body"]["plan"]["tp"] = 3
            with open(path, "w") as f:
                json.dump(data, f)
    dist.barrier()
    try:
        autotp.parallelize(copy.deepcopy(ref), example_inputs=(args, kwargs))
        out["tampered"] = ""
    except PlanCacheError as exc:
        out["tampered"] = str(exc)
    return out
