"""Functions that run inside each gloo rank of the FSDP × TP tests and return what the test asserts on."""
from __future__ import annotations

import contextlib
import copy
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autotp
from autotp.distributed.data_parallel import FSDPConfig
from ranks import CollectiveLog
from small_models import MODELS, loss_and_logits


def _replica(batch, d: int, dp: int):
    """Data-parallel replica ``d``'s rows of every batched tensor (dim 0 split in dp equal parts)."""
    def cut(x):
        return x.chunk(dp, 0)[d] if isinstance(x, torch.Tensor) and x.dim() >= 1 else x
    args, kwargs = batch
    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def _side_by_side(ref: torch.Tensor, name: str, model) -> torch.Tensor:
    """``ref`` as the sharded model's DTensor sees it globally: every TP rank's shard side by side."""
    st = autotp.tp_state(model)
    shard = st.shards.get(name)
    if shard is None:
        return ref
    return torch.cat([shard.shard(ref, st.tp, r) for r in range(st.tp)], shard.dim)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def _model(name: str):
    if name in MODELS:
        return MODELS[name]()
    if name.startswith("pattern:"):  # tests/support/pattern_models.py's spellings (q/k norms, fused q|k|v, ...)
        from pattern_models import build as pattern

        return pattern(name.removeprefix("pattern:"))
    from fsdp_models import build

    return build(name)


def fsdp_parity(model_name: str, tp: int, steps: int = 3, clip: float = 0.05, reshard: bool = True,
                prefetch: bool = True, replicas: int = 1, **options) -> dict:
    """Losses, gradient norms (clipped), parameters after AdamW steps and collectives of a model under
    FSDP × autotp, each data-parallel replica on its share of the batch, against the unsharded model on the
    whole batch. ``replicas`` > 1: HSDP. ``options``: parallelize's (sequence_parallel, compile, ...)."""
    ref, args, kwargs = _model(model_name)
    dp = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    d = mesh["dp"].get_local_rank()
    la, lk = _replica((args, kwargs), d, dp)
    from torch._dynamo.utils import counters

    counters.clear()  # graph breaks, where compiled
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = autotp.parallelize(copy.deepcopy(ref), example_inputs=(la, lk),
                                   fsdp=FSDPConfig(reshard, prefetch, replicas=replicas), mesh=mesh, **options)
    st = autotp.tp_state(model)
    opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (model, ref))
    from torch.distributed.fsdp import fully_shard

    out: dict = {"units": list(st.units or ()), "losses": [], "warnings": [str(w.message) for w in caught],
                 "root_params": fully_shard.state(model)._fsdp_param_group is not None,
                 "last_kept": any(u.kind == "last" for u in st.plan.units) and reshard, "ref_losses": [], "norms": [], "ref_norms": [],
                 "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
                 "same_class": isinstance(model, type(ref))}
    for step in range(steps):
        log = CollectiveLog()
        with log:
            loss = loss_and_logits(model(*la, **lk))[0]
        n_fwd = len(log.calls)
        with log:
            loss.backward()
        if step == 0:
            out["forward_collectives"], out["backward_collectives"] = log.calls[:n_fwd], log.calls[n_fwd:]
        from torch.distributed.tensor.debug import CommDebugMode

        comm = CommDebugMode()  # DTensor's own collectives (the norm's redistribution), which a dispatch mode misses
        with comm:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            _full(norm)
        if step == 0:
            out["norm_collectives"] = {str(k): v for k, v in comm.get_comm_counts().items()}
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())
        out["losses"].append(mean.item() / dp)
        out["norms"].append(_full(norm).item())
        rloss = loss_and_logits(ref(*args, **kwargs))[0]
        rloss.backward()
        out["ref_norms"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
        ropt.step()
        ropt.zero_grad()
        out["ref_losses"].append(rloss.item())
    out["local_numel"] = sum(p.to_local().numel() for p in model.parameters())  # sharded between steps
    # a later call signature (eval, another batch size) is captured on the FSDP-sharded model
    model.eval()
    ref.eval()
    with torch.no_grad():
        few = _replica((args, kwargs), 0, 2 * dp)
        out["eval_diff"] = (loss_and_logits(model(*few[0], **few[1]))[0] - loss_and_logits(ref(*few[0], **few[1]))[0]).abs().item()
    out["graphs"] = len(st.graphs)
    out["graph_cuts"] = [c.name for c in st.plan.graph_cuts]
    out["breaks"] = dict(counters["graph_break"])
    out["compiled_graphs"] = counters["stats"]["unique_graphs"]
    ref_params = dict(ref.named_parameters())
    out["param_diff"] = max((_full(p).detach() - _side_by_side(ref_params[n].detach(), n, model)).abs().max().item()
                            for n, p in model.named_parameters())
    out["full_numel"] = sum(p.numel() for p in ref.parameters())
    return out


def _job(name: str, tp: int, fsdp: bool):
    from autotp.cli.shard_worker import data_parallel
    from autotp.distributed.launch import init_distributed

    ctx = init_distributed(tp=tp)
    model, args, kwargs = _model(name)
    where = dict(fsdp=True, mesh=ctx.mesh) if fsdp else dict(fsdp=False, tp_group=ctx.tp_group())
    tpm = autotp.parallelize(model, example_inputs=(args, kwargs), **where)
    opt = torch.optim.AdamW(tpm.parameters(), lr=1e-3, eps=1e-6)
    return ctx, tpm, opt, data_parallel(tpm, ctx), args, kwargs


def _train(model, opt, args, kwargs, steps: int) -> None:
    from autotp.cli.shard_worker import train_step

    for _ in range(steps):
        train_step(model, opt, args, kwargs)


def fsdp_resume_matrix(out: str, names: list[str]) -> dict:
    """Saved at tp 2 × fsdp 2 after 3 steps (every replica on the same batch, so any dp follows one
    trajectory), trained 3 more as the reference; resumed at tp 4 × dp 1, tp 1 × fsdp 4 and tp 2 × dp 2
    (DDP) for the same 3 steps. Rank 0 returns each model's full state dicts."""
    from pathlib import Path

    from autotp.io.ckpt_io import latest_checkpoint, load_training_state, save_training_state

    results = {}
    for name in names:
        run = Path(out) / name
        ctx, tpm, opt, model, args, kwargs = _job(name, 2, True)
        _train(model, opt, args, kwargs, 3)
        save_training_state(run, 3, tpm, opt, ctx)
        _train(model, opt, args, kwargs, 3)
        results[name] = {"reference": autotp.full_state_dict(tpm)}
        for tp, fsdp in ((4, False), (1, True), (2, False)):
            ctx, tpm, opt, model, args, kwargs = _job(name, tp, fsdp)
            resumed = load_training_state(latest_checkpoint(run), tpm, opt, ctx)
            _train(model, opt, args, kwargs, 3)
            results[name][(tp, fsdp)] = {"step": resumed.step, "note": resumed.describe(),
                                         "state": autotp.full_state_dict(tpm)}
    return results if dist.get_rank() == 0 else {}


def fsdp_mixed_precision(model_name: str, tp: int, steps: int = 3) -> dict:
    """FSDP's mixed precision (bf16 parameters for compute, fp32 gradient reduction and master weights)
    under bf16 autocast, every replica on the same batch, against the unsharded model in fp32 (exact) and
    under autocast alone (what a single-device bf16 run gives): relative errors of losses and updates."""
    from amp_workers import DtypeLog, _rel

    ref, args, kwargs = _model(model_name)
    amp = copy.deepcopy(ref)
    dp = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    config = FSDPConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = autotp.parallelize(copy.deepcopy(ref), example_inputs=(args, kwargs), fsdp=config, mesh=mesh)
    start = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (model, ref, amp)]
    out: dict = {"loss_rel": [], "amp_loss_rel": []}
    log = DtypeLog()
    for step in range(steps):
        losses = []
        for m, opt, cast in ((model, opts[0], True), (ref, opts[1], False), (amp, opts[2], True)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast), (log if m is model and step == 0
                                                                              else contextlib.nullcontext()):
                loss = loss_and_logits(m(*args, **kwargs))[0]
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().float())
        out["loss_rel"].append(_rel(losses[0], losses[1]))
        out["amp_loss_rel"].append(_rel(losses[2], losses[1]))
    ref_params, amp_params = dict(ref.named_parameters()), dict(amp.named_parameters())

    def update(n):
        return _side_by_side(ref_params[n].detach(), n, model) - _side_by_side(start_ref[n], n, model)

    start_ref = {n: p.detach() for n, p in copy.deepcopy(_model(model_name)[0]).named_parameters()}
    got = torch.cat([(_full(p).detach() - start[n]).flatten() for n, p in model.named_parameters()])
    want = torch.cat([update(n).flatten() for n, _ in model.named_parameters()])
    amp_got = torch.cat([(_side_by_side(amp_params[n].detach(), n, model) - _side_by_side(start_ref[n], n, model))
                         .flatten() for n, _ in model.named_parameters()])
    out["update_rel"], out["amp_update_rel"] = _rel(got, want), _rel(amp_got, want)
    out["master_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    # what FSDP moves (the input check's int64 fingerprints aside)
    out["travel"] = sorted({(k, dtype) for k, dtype, _ in log.dtypes if k != "all_reduce" and dtype != "int64"})
    return out


def fsdp_load_weights(name: str, path: str, tp: int) -> dict:
    """A model built on meta, parallelized with FSDP (only this rank's pieces allocated), filled by
    ``autotp.load_weights`` from a torch state-dict file: the unsharded model's loss and parameters."""
    ref, args, kwargs = _model(name)
    dp = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    with autotp.empty_weights():
        model = _model(name)[0]
    model = autotp.parallelize(model, example_inputs=(args, kwargs), fsdp=True, mesh=mesh)
    loaded = autotp.load_weights(model, path)
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        loss = loss_and_logits(model(*args, **kwargs))[0]
        want = loss_and_logits(ref(*args, **kwargs))[0]
    return {"tensors": loaded.tensors, "loss_diff": (loss - want).abs().item(),
            "param_diff": max((_full(p).detach() - _side_by_side(ref_params[n].detach(), n, model)).abs().max().item()
                              for n, p in model.named_parameters())}


def fsdp_parity_many(names: list[str], tp: int) -> dict:
    """:func:`fsdp_parity` for each model, in one launch."""
    return {name: fsdp_parity(name, tp) for name in names}
