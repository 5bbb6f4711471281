"""Functions that run inside each gloo rank of the pipeline tests and return what the test asserts on."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autotp
from small_models import loss_and_logits
from pipeline_models import MODELS


def _replica(batch, d: int, dp: int):
    def cut(x):
        return x.chunk(dp, 0)[d] if isinstance(x, torch.Tensor) and x.dim() >= 1 else x
    args, kwargs = batch
    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def pipeline_parity(model_name: str, tp: int, pp: int, schedule: str, microbatches: int,
                    virtual_stages: int | None = None, steps: int = 3, clip: float = 0.05,
                    compile: bool | dict = False, sequence_parallel: bool = False,
                    expert_parallel: bool = False, fsdp: bool = False, cp: int = 1) -> dict:
    """Losses, clipped gradient norms and parameters after AdamW steps of the pipelined model (each
    data-parallel replica on its share of the batch) against the unsharded model on the whole batch.
    ``compile``: each stage's piece compiled (graph breaks counted). ``cp`` > 1: on a (pp, dp, cp, tp) mesh,
    every stage on 1/cp of the sequence."""
    from torch._dynamo.utils import counters

    counters.clear()
    ref, args, kwargs = MODELS[model_name]()
    dp = dist.get_world_size() // (tp * pp * cp)
    if cp > 1:
        mesh = init_device_mesh("cpu", (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    d = mesh["dp"].get_local_rank()
    la, lk = _replica((args, kwargs), d, dp)
    model = copy.deepcopy(ref)
    pipe = autotp.pipeline(model, example_inputs=(la, lk), microbatches=microbatches, schedule=schedule,
                           virtual_stages=virtual_stages, mesh=mesh, compile=compile,
                           sequence_parallel=sequence_parallel, expert_parallel=expert_parallel, fsdp=fsdp)
    st = autotp.tp_state(model)
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=1e-3, eps=1e-6)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    out: dict = {"losses": [], "ref_losses": [], "norms": [], "ref_norms": [], "stages": list(pipe.stage_indices), "count": pipe.num_stages,
                 "blocks": [list(s.blocks) for s in st.plan.stages], "same_class": isinstance(model, type(ref)),
                 "experts": [(x.module, x.count) for x in st.plan.experts], "experts_kept": list(st.plan.experts_kept)}
    from ranks import CollectiveLog

    for step in range(steps):
        log = CollectiveLog()
        with log:
            loss = pipe.step(*la, **lk)
        out.setdefault("steps_collectives", []).append([c[:2] for c in log.calls])
        out.setdefault("steps_sized", []).append(list(log.calls))
        if step == 0:
            out["step_collectives"] = [c[:2] for c in log.calls]
        dist.all_reduce(loss, group=mesh.get_group("dp"))
        out["losses"].append(loss.item() / dp)
        out["norms"].append(pipe.clip_grad_norm_(clip).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        rloss = loss_and_logits(ref(*args, **kwargs))[0]
        rloss.backward()
        out["ref_norms"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
        ropt.step()
        ropt.zero_grad(set_to_none=True)
        out["ref_losses"].append(rloss.item())
    refs = dict(ref.named_parameters(remove_duplicate=False))
    worst, sums = 0.0, {}
    from torch.distributed.tensor import DTensor

    for name, p in pipe.named_parameters():
        shard = st.shards.get(name)
        want = refs[name].detach()
        if isinstance(p, DTensor):  # FSDP: the tp shards side by side, each whole over dp
            p = p.full_tensor()
            want = torch.cat([shard.shard(want, st.tp, r) for r in range(st.tp)], shard.dim) if shard else want
        else:
            want = shard.shard(want, st.tp, st.rank) if shard is not None else want
        worst = max(worst, (p.detach() - want).abs().max().item())
        sums[name] = p.detach().double().sum().item()
    held = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.is_meta}
    cut = {c.name for c in st.plan.graph_cuts}  # kv weights held whole, cut in the graph: this rank's stages'
    out["cut_numels"] = [(p.to_local() if isinstance(p, DTensor) else p).numel()
                         for n, p in pipe.named_parameters() if n in cut]
    out.update(param_diff=worst, held=sorted(held), sums=sums, dropped=len(st.dropped),
               fsdp_units=list(st.units or ()),
               held_numel=sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in pipe.parameters()),
               full_numel=sum(p.numel() for p in ref.parameters()))
    if schedule != "ZBVZeroBubble":
        out["eval_loss"] = pipe.eval_step(*la, **lk).item()
        with torch.no_grad():
            out["ref_eval"] = loss_and_logits(ref.eval()(*la, **lk))[0].item()
        ref.train()
    out["breaks"], out["compiled_graphs"] = dict(counters["graph_break"]), counters["stats"]["unique_graphs"]
    if 0 in pipe.stage_indices:  # what the first stage sends across its cut, for one micro-batch
        from autotp.capture.structure import flatten
        from autotp.operators.stages import input_name

        with torch.no_grad():
            sent = pipe.modules[0](**{input_name(i): t for i, t in enumerate(flatten(pipe._micro)[0])})
        out["sent"] = [tuple(t.shape) for t in (sent if isinstance(sent, tuple) else (sent,))]
        out["micro"] = [tuple(t.shape) for t in flatten(pipe._micro)[0]]
    try:
        model(*la, **lk)
        out["direct_call"] = "ran"
    except autotp.ShardingError as e:
        out["direct_call"] = str(e)
    return out


def pipeline_parity_many(configs: list[tuple], refused: list[tuple] = ()) -> list[dict]:
    """:func:`pipeline_parity` for each (model, tp, pp, schedule, microbatches, virtual stages), in turn; then
    each of ``refused``'s PipelineError (its first sentence)."""
    out = [pipeline_parity(*c) for c in configs]
    for c in refused:
        try:
            pipeline_parity(*c)
            out.append({"refused": None})
        except autotp.PipelineError as e:
            out.append({"refused": str(e).split(":")[0]})
    return out


def _gathered(model, ctx) -> dict:
    """The whole model's unsharded state on rank 0 (each rank holds its stages'; {} elsewhere)."""
    mine = autotp.full_state_dict(model)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out = {}
    for part in parts:
        out.update(part)
    return out if dist.get_rank() == 0 else {}


def _job(name: str, tp: int, pp: int):
    """(ctx, model, a step function, optimizer, batch): pipelined at pp > 1 (1F1B, pp micro-batches), plainly
    parallelized at pp 1."""
    from autotp.distributed.launch import init_distributed

    ctx = init_distributed(tp=tp, pp=pp)
    model, args, kwargs = MODELS[name]()
    if pp > 1:
        pipe = autotp.pipeline(model, example_inputs=(args, kwargs), microbatches=pp, mesh=ctx.mesh)
        params, step = list(pipe.parameters()), pipe.step
    else:
        autotp.parallelize(model, example_inputs=(args, kwargs), tp_group=ctx.tp_group())
        params = list(model.parameters())

        def step(*a, **k):
            loss = loss_and_logits(model(*a, **k))[0]
            loss.backward()
            return loss
    opt = torch.optim.AdamW(params, lr=1e-3, eps=1e-6)
    return ctx, model, step, opt, args, kwargs


def _train(step, opt, args, kwargs, steps: int) -> None:
    for _ in range(steps):
        step(*args, **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)


def pipeline_resume_matrix(out: str, name: str) -> dict:
    """Saved at tp 2 × pp 2 after 3 steps, trained 3 more as the reference; resumed at tp 4 × pp 1 and
    tp 1 × pp 4 for the same 3 steps. Rank 0 returns each run's whole unsharded state."""
    from pathlib import Path

    from autotp.io.ckpt_io import latest_checkpoint, load_training_state, save_training_state

    run = Path(out) / name
    ctx, model, step, opt, args, kwargs = _job(name, 2, 2)
    _train(step, opt, args, kwargs, 3)
    save_training_state(run, 3, model, opt, ctx)
    _train(step, opt, args, kwargs, 3)
    results: dict = {"reference": _gathered(model, ctx)}
    for tp, pp in ((4, 1), (1, 4)):
        ctx, model, step, opt, args, kwargs = _job(name, tp, pp)
        resumed = load_training_state(latest_checkpoint(run), model, opt, ctx)
        _train(step, opt, args, kwargs, 3)
        results[(tp, pp)] = {"step": resumed.step, "note": resumed.describe(), "state": _gathered(model, ctx)}
    return results if dist.get_rank() == 0 else {}


def pipeline_from_meta(path: str, name: str, tp: int, pp: int, steps: int = 3) -> dict:
    """A model built on meta (``autotp.empty_weights``), pipelined, then loaded from a checkpoint: each rank
    allocates only its stages' shards; trained as the unsharded model from the same weights."""
    ref, args, kwargs = MODELS[name]()
    ref.load_state_dict(torch.load(path, weights_only=True))
    with autotp.empty_weights():
        model = MODELS[name]()[0]
    mesh = init_device_mesh("cpu", (pp, dist.get_world_size() // (tp * pp), tp), mesh_dim_names=("pp", "dp", "tp"))
    pipe = autotp.pipeline(model, example_inputs=(args, kwargs), microbatches=2, mesh=mesh, device="cpu")
    allocated = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if not p.is_meta)
    loaded = autotp.load_weights(model, path)
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=1e-3, eps=1e-6)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    losses, ref_losses = [], []
    for _ in range(steps):
        losses.append(pipe.step(*args, **kwargs).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        rloss = loss_and_logits(ref(*args, **kwargs))[0]
        rloss.backward()
        ropt.step()
        ropt.zero_grad(set_to_none=True)
        ref_losses.append(rloss.item())
    st = autotp.tp_state(model)
    refs = dict(ref.named_parameters(remove_duplicate=False))
    worst = 0.0
    for n, p in pipe.named_parameters():
        want = refs[n].detach()
        want = st.shards[n].shard(want, st.tp, st.rank) if n in st.shards else want
        worst = max(worst, (p.detach() - want).abs().max().item())
    return {"losses": losses, "ref_losses": ref_losses, "param_diff": worst, "allocated": allocated,
            "held": sum(p.numel() for p in pipe.parameters()), "read": loaded.tensors}


def _overflow(p: torch.Tensor) -> None:
    p.grad.view(-1)[0] = float("inf")


def pipeline_grad_scaler(steps: int = 4, inject_at: int = 1) -> dict:
    """fp16 autocast with ``torch.amp.GradScaler`` through a (tp 1, pp 2) pipeline: an inf written into one
    gradient during the last stage's backward, on its rank only (and into the same element of the unsharded
    model's), skips that step on every rank, with the script's own ``scaler.unscale_``/``step``/``update``."""
    ref, args, kwargs = MODELS["nanogpt"]()
    mesh = init_device_mesh("cpu", (2, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    scalers = {m: torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for m in ("pp", "ref")}
    model = copy.deepcopy(ref)
    with torch.autocast("cpu", dtype=torch.float16):
        pipe = autotp.pipeline(model, example_inputs=(args, kwargs), microbatches=2, mesh=mesh,
                               scaler=scalers["pp"])
    opts = {"pp": torch.optim.AdamW(list(pipe.parameters()), lr=1e-3, eps=1e-6),
            "ref": torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)}
    name = "transformer.h.3.mlp.c_fc.weight"  # on the last stage: pipeline rank 1
    mine = dict(pipe.named_parameters())
    out: dict = {"scales": [], "ref_scales": [], "losses": [], "ref_losses": [], "skipped_unchanged": None}
    for step in range(steps):
        before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        for key in ("pp", "ref"):
            opts[key].zero_grad()
            hook = None
            if step == inject_at and key == "pp" and name in mine:  # an overflow in this stage's backward
                hook = mine[name].register_post_accumulate_grad_hook(_overflow)
            with torch.autocast("cpu", dtype=torch.float16):
                if key == "pp":
                    loss = pipe.step(*args, **kwargs)
                else:
                    loss = loss_and_logits(ref(*args, **kwargs))[0]
                    scalers[key].scale(loss).backward()
            if hook is not None:
                hook.remove()
            if step == inject_at and key == "ref":
                ref.get_parameter(name).grad[0, 0] = float("inf")
            scalers[key].unscale_(opts[key])
            scalers[key].step(opts[key])
            scalers[key].update()
            out["losses" if key == "pp" else "ref_losses"].append(loss.item())
        out["scales"].append(scalers["pp"].get_scale())
        out["ref_scales"].append(scalers["ref"].get_scale())
        if step == inject_at:
            out["skipped_unchanged"] = all(torch.equal(p, before[n]) for n, p in pipe.named_parameters())
    out["held_inf_param"] = name in mine
    return out


def _layout_job(name: str, tp: int, pp: int, fsdp: bool, sp: bool):
    """(ctx, model, step, optimizer, batch) at tp × dp × pp (dp the rest of 4 ranks): pipelined at pp > 1,
    FSDP over dp when ``fsdp`` (else DDP), sequence parallel when ``sp``; every replica on the whole batch."""
    from autotp.cli.shard_worker import data_parallel, train_step
    from autotp.distributed.launch import init_distributed

    ctx = init_distributed(tp=tp, pp=pp)
    model, args, kwargs = MODELS[name]()
    if pp > 1:
        pipe = autotp.pipeline(model, example_inputs=(args, kwargs), microbatches=pp, mesh=ctx.mesh,
                               sequence_parallel=sp)
        opt = torch.optim.AdamW(list(pipe.parameters()), lr=1e-3, eps=1e-6)
        return ctx, model, pipe.step, opt, args, kwargs
    where = dict(fsdp=True, mesh=ctx.mesh) if fsdp else dict(fsdp=False, tp_group=ctx.tp_group())
    autotp.parallelize(model, example_inputs=(args, kwargs), sequence_parallel=sp, **where)
    wrapped = data_parallel(model, ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)

    def step(*a, **k):
        return train_step(wrapped, opt, a, k)
    return ctx, model, step, opt, args, kwargs


def layouts_resume_matrix(out: str, name: str) -> dict:
    """Saved at tp 2 × fsdp 2 with sequence parallelism after 3 steps, trained 3 more as the reference;
    resumed with every dimension changed (tp 2 × pp 2 with sequence parallelism; tp 1 × dp 2 × pp 2 under
    DDP; tp 4 plain) for the same 3 steps. Rank 0 returns each run's whole unsharded state."""
    from pathlib import Path

    from autotp.io.ckpt_io import latest_checkpoint, load_training_state, save_training_state

    run = Path(out) / name
    ctx, model, step, opt, args, kwargs = _layout_job(name, 2, 1, True, True)
    _train_steps(step, opt, args, kwargs, 3, own_step=True)
    save_training_state(run, 3, model, opt, ctx)
    _train_steps(step, opt, args, kwargs, 3, own_step=True)
    results: dict = {"reference": _gathered(model, ctx)}
    for tp, pp, sp in ((2, 2, True), (1, 2, False), (4, 1, False)):
        ctx, model, step, opt, args, kwargs = _layout_job(name, tp, pp, False, sp)
        resumed = load_training_state(latest_checkpoint(run), model, opt, ctx)
        _train_steps(step, opt, args, kwargs, 3, own_step=pp == 1)
        results[(tp, pp, sp)] = {"step": resumed.step, "note": resumed.describe(), "state": _gathered(model, ctx)}
    return results if dist.get_rank() == 0 else {}


def _train_steps(step, opt, args, kwargs, steps: int, own_step: bool) -> None:
    """``steps`` optimizer steps; ``own_step``: the step function steps the optimizer itself."""
    for _ in range(steps):
        step(*args, **kwargs)
        if not own_step:
            opt.step()
            opt.zero_grad(set_to_none=True)
