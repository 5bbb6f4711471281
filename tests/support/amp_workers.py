"""Functions that run inside each gloo rank of the mixed-precision tests (autocast, GradScaler, full_tensor)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autotp
from small_models import MODELS as _MODELS, loss_and_logits


def _moe_bmm():
    from moe_models import build

    return build("gathered_bmm")


def _mixtral():
    from hf_moe_models import build

    return build("mixtral")


# experts gathered per slot (bmm) and Hugging Face's Mixtral (grouped GEMM) beside the dense models
MODELS = {**_MODELS, "moe_bmm": _moe_bmm, "mixtral": _mixtral}
from parity_workers import _local

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class DtypeLog(TorchDispatchMode):
    """The dtype of every eager all-reduce, all-gather and reduce-scatter: what travels."""

    dtypes: list[tuple[str, str, int]] = field(default_factory=list)

    def __post_init__(self):
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d" and name == "allreduce_":
            self.dtypes.append(("all_reduce", str(args[0][0].dtype).removeprefix("torch."), args[0][0].numel()))
        elif func.namespace == "c10d" and name in ("_reduce_scatter_base_", "_allgather_base_"):
            kind = "reduce_scatter" if name.startswith("_reduce") else "all_gather"
            self.dtypes.append((kind, str(args[1].dtype).removeprefix("torch."), args[1].numel()))
        return func(*args, **(kwargs or {}))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| relative to max |b|: the error in units of the tensor's scale."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0


def autocast_parity(model_name: str, dtype_name: str, sequence_parallel: bool = False,
                    capture_under: bool = False, steps: int = 3, expert_parallel: bool = False) -> dict:
    """Loss, gradients and AdamW steps of a parallelized model under ``torch.autocast`` against the unsharded
    model under the same autocast; the unsharded fp32 run gives the scale of autocast's own error."""
    dtype = DTYPES[dtype_name]
    ref, args, kwargs = MODELS[model_name]()
    ref32 = copy.deepcopy(ref)
    model = copy.deepcopy(ref)

    def ctx():
        return torch.autocast("cpu", dtype=dtype)

    if capture_under:  # parallelize itself called inside the script's autocast region
        with ctx():
            tpm = autotp.parallelize(model, example_inputs=(args, kwargs), sequence_parallel=sequence_parallel,
                                     expert_parallel=expert_parallel)
    else:
        tpm = autotp.parallelize(model, example_inputs=(args, kwargs), sequence_parallel=sequence_parallel,
                                 expert_parallel=expert_parallel)
    log = DtypeLog()
    with ctx():
        raw = tpm(*args, **kwargs)
    with log:
        with ctx():
            raw = tpm(*args, **kwargs)  # the second call: no capture, no input check
        loss, logits = loss_and_logits(raw)
        loss.backward()
    with ctx():
        rloss, rlogits = loss_and_logits(ref(*args, **kwargs))
    rloss.backward()
    loss32, _ = loss_and_logits(ref32(*args, **kwargs))
    loss32.backward()
    ref_params, ref32_params = dict(ref.named_parameters()), dict(ref32.named_parameters())
    st = autotp.tp_state(tpm)
    grads = [(p.grad, _local(ref_params[n].grad, n, tpm), _local(ref32_params[n].grad, n, tpm))
             for n, p in tpm.named_parameters()]
    plan = next(c.plan for k, c in st.graphs.items() if k[-1] != (("cpu", None),))  # the plan captured under autocast
    out = {
        "loss_dtype": str(loss.dtype), "logits_dtype": str(logits.dtype), "ref_logits_dtype": str(rlogits.dtype),
        "loss_rel": _rel(loss, rloss), "autocast_loss_rel": _rel(rloss, loss32),
        "logits_rel": _rel(logits, rlogits),
        "grad_rel": max(_rel(g, r) for g, r, _ in grads), "autocast_grad_rel": max(_rel(r, r32) for _, r, r32 in grads),
        "grad_dtypes": sorted({str(g.dtype) for g, _, _ in grads}),
        "traveled": log.dtypes,
        "plan_dtypes": sorted({(c.direction, c.kind, c.op, c.dtype) for c in plan.collectives}),
        "graphs": len(st.graphs),
    }
    # AdamW in fp32 (master weights) on autocast forward and backward, both models; the fp32 model's steps
    # measure how far autocast alone moves the parameters
    start = {n: p.detach().clone() for n, p in ref32.named_parameters()}  # all three start here
    opt, ropt, ropt32 = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (tpm, ref, ref32))
    for _ in range(steps):
        for o, m, on in ((opt, tpm, True), (ropt, ref, True), (ropt32, ref32, False)):
            o.zero_grad()
            with torch.autocast("cpu", dtype=dtype, enabled=on):
                step_loss = loss_and_logits(m(*args, **kwargs))[0]
            step_loss.backward()
            o.step()
    out["param_diff"] = max((p - _local(ref_params[n], n, tpm)).abs().max().item() for n, p in tpm.named_parameters())
    out["autocast_param_diff"] = max((ref_params[n] - p).abs().max().item() for n, p in ref32_params.items())
    out["update_rel"] = _update_rel({n: p - _local(start[n], n, tpm) for n, p in tpm.named_parameters()},
                                    {n: _local(ref_params[n] - start[n], n, tpm) for n, _ in tpm.named_parameters()})
    out["autocast_update_rel"] = _update_rel({n: ref_params[n] - start[n] for n in start},
                                             {n: ref32_params[n] - start[n] for n in start})
    return out


def _update_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """‖got − want‖ / ‖want‖ over all parameter updates: Adam moves each element by about ±lr whatever its
    gradient's size, so an element whose gradient is at rounding level may move either way; the norm
    over all updates says whether the steps agree as a whole."""
    num = sum(((got[n] - want[n]).double() ** 2).sum() for n in want)
    den = sum((want[n].double() ** 2).sum() for n in want)
    return (num / den).sqrt().item()


def full_tensor_grad() -> dict:
    """DTensor's habit: the loss computed from ``logits.full_tensor()`` backpropagates, in fp32 and bf16."""
    import torch.nn.functional as F

    out = {}
    for dtype_name in ("float32", "bfloat16"):
        ref, (idx, targets), _ = MODELS["nanogpt"]()
        tpm = autotp.parallelize(copy.deepcopy(ref), example_inputs=(idx, targets))
        with torch.autocast("cpu", dtype=DTYPES[dtype_name], enabled=dtype_name != "float32"):
            logits, _ = tpm(idx, targets)
            full = logits.full_tensor()
            loss = F.cross_entropy(full.flatten(0, 1).float(), targets.flatten())
            rlogits, _ = ref(idx, targets)
            rloss = F.cross_entropy(rlogits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        rloss.backward()
        ref_params = dict(ref.named_parameters())
        if dtype_name == "float32":  # clip_grad_norm_'s fused path on CUDA: the full gradients' norms
            norms = torch._foreach_norm([p.grad for _, p in tpm.named_parameters()])
            want = [ref_params[n].grad.norm() for n, _ in tpm.named_parameters()]
            out["foreach_norm_rel"] = max(_rel(a, b) for a, b in zip(norms, want))
            out["foreach_inf_norm_rel"] = max(_rel(a, b.abs().max()) for a, b in zip(
                torch._foreach_norm([p.grad for _, p in tpm.named_parameters()], float("inf")),
                [ref_params[n].grad for n, _ in tpm.named_parameters()]))
        out[dtype_name] = {
            "plain": type(full) is torch.Tensor, "requires_grad": full.requires_grad,
            "loss_rel": _rel(loss, rloss),
            "grad_rel": max(_rel(p.grad, _local(ref_params[n].grad, n, tpm)) for n, p in tpm.named_parameters()),
        }
    with torch.no_grad():
        out["no_grad_plain"] = not tpm(idx, targets)[0].full_tensor().requires_grad
    return out


def grad_scaler_overflow(steps: int = 4, inject_at: int = 1) -> dict:
    """fp16 autocast with ``torch.amp.GradScaler``: an inf written into rank 0's shard of one gradient at step
    ``inject_at`` (and into the same element of the unsharded model's gradient) skips that step on every
    rank; scales and parameters stay those of the unsharded run."""
    ref, args, kwargs = MODELS["nanogpt"]()
    tpm = autotp.parallelize(copy.deepcopy(ref), example_inputs=(args, kwargs))
    st = autotp.tp_state(tpm)
    name = "transformer.h.0.mlp.c_fc.weight"  # column-parallel: rank r holds rows [r·n/t, (r+1)·n/t)
    assert st.shards[name].role == "column"
    scalers = {m: torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for m in ("tp", "ref")}
    opts = {m: torch.optim.AdamW(mod.parameters(), lr=1e-3, eps=1e-6) for m, mod in (("tp", tpm), ("ref", ref))}
    out: dict = {"scales": [], "skipped_unchanged": None, "ref_scales": []}
    ref_params = dict(ref.named_parameters())
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for step in range(steps):
        before = {n: p.detach().clone() for n, p in tpm.named_parameters()}
        for key, mod in (("tp", tpm), ("ref", ref)):
            opts[key].zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_and_logits(mod(*args, **kwargs))[0]
            scalers[key].scale(loss).backward()
            if step == inject_at:
                grad = mod.get_parameter(name).grad
                if key == "ref":
                    grad[0, 0] = float("inf")  # global row 0: held by tp rank 0
                elif st.rank == 0:
                    grad[0, 0] = float("inf")
            scalers[key].unscale_(opts[key])
            torch.nn.utils.clip_grad_norm_(mod.parameters(), 1.0)
            scalers[key].step(opts[key])
            scalers[key].update()
        out["scales"].append(scalers["tp"].get_scale())
        out["ref_scales"].append(scalers["ref"].get_scale())
        if step == inject_at:
            out["skipped_unchanged"] = all(torch.equal(p, before[n]) for n, p in tpm.named_parameters())
    out["param_diff"] = max((p - _local(ref_params[n], n, tpm)).abs().max().item() for n, p in tpm.named_parameters())
    out["moved"] = max((p - before[n]).abs().max().item() for n, p in tpm.named_parameters())
    out["update_rel"] = _update_rel({n: p - _local(start[n], n, tpm) for n, p in tpm.named_parameters()},
                                    {n: _local(ref_params[n] - start[n], n, tpm) for n, _ in tpm.named_parameters()})
    return out
