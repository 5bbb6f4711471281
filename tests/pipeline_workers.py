"""Functions that run inside each gloo rank of the pipeline tests and return what the test asserts on."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autotp
from models import loss_and_logits
from pipeline_models import MODELS


def _replica(batch, d: int, dp: int):
    def cut(x):
        return x.chunk(dp, 0)[d] if isinstance(x, torch.Tensor) and x.dim() >= 1 else x
    args, kwargs = batch
    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def pipeline_parity(model_name: str, tp: int, pp: int, schedule: str, microbatches: int,
                    virtual_stages: int | None = None, steps: int = 3) -> dict:
    """Losses and parameters after AdamW steps of the pipelined model (each data-parallel replica on its
    share of the batch) against the unsharded model on the whole batch."""
    ref, args, kwargs = MODELS[model_name]()
    dp = dist.get_world_size() // (tp * pp)
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    d = mesh["dp"].get_local_rank()
    la, lk = _replica((args, kwargs), d, dp)
    model = copy.deepcopy(ref)
    pipe = autotp.pipeline(model, example_inputs=(la, lk), microbatches=microbatches, schedule=schedule,
                           virtual_stages=virtual_stages, mesh=mesh)
    st = autotp.tp_state(model)
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=1e-2, eps=1e-6)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    out: dict = {"losses": [], "ref_losses": [], "stages": list(pipe.stage_indices),
                 "blocks": [list(s.blocks) for s in st.plan.stages], "same_class": isinstance(model, type(ref))}
    for _ in range(steps):
        loss = pipe.step(*la, **lk)
        dist.all_reduce(loss, group=mesh.get_group("dp"))
        out["losses"].append(loss.item() / dp)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rloss = loss_and_logits(ref(*args, **kwargs))[0]
        rloss.backward()
        ropt.step()
        ropt.zero_grad(set_to_none=True)
        out["ref_losses"].append(rloss.item())
    refs = dict(ref.named_parameters())
    worst, names, sums = 0.0, [], {}
    for name, p in pipe.named_parameters():
        shard = st.shards.get(name)
        want = refs[name].detach()
        want = shard.shard(want, st.tp, st.rank) if shard is not None else want
        worst = max(worst, (p.detach() - want).abs().max().item())
        names.append(name)
        sums[name] = p.detach().double().sum().item()
    out.update(param_diff=worst, held=names, sums=sums, eval_loss=pipe.eval_step(*la, **lk).item(),
               ref_eval=loss_and_logits(ref(*args, **kwargs))[0].item() if dp == 1 else None,
               dropped=len(st.dropped))
    try:
        model(*la, **lk)
        out["direct_call"] = "ran"
    except autotp.ShardingError as e:
        out["direct_call"] = str(e)
    return out


def debug(fn_name: str, *args):
    import traceback
    try:
        return globals()[fn_name](*args)
    except BaseException:
        with open(f"/tmp/notes/err{dist.get_rank()}.txt", "w") as f:
            f.write(traceback.format_exc())
        raise
