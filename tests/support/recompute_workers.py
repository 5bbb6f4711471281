"""What runs inside each gloo rank of the activation-checkpointing tests (tests/support/recompute_models.py)."""
from __future__ import annotations

import copy

import torch

import autotp
from parity_workers import _local
from recompute_models import build, loss_of


def _example(style: str, idx: torch.Tensor, targets: torch.Tensor):
    if style == "hf_llama":
        return (), {"input_ids": idx, "labels": targets, "use_cache": False}
    return (idx, targets), {}


def recompute_parity(styles: list[str], steps: int = 3) -> dict:
    """Per style: loss, gradients and AdamW steps of the parallelized checkpointing model against the unsharded
    one (checkpointing too; no dropout) or, with dropout, against the parallelized model without checkpointing
    on the same seed (the recomputation must draw the forward's masks); the regions recomputed."""
    out = {}
    for style in styles:
        ref, (idx, targets) = build(style, recompute=style != "dropout")
        model, _ = build(style, recompute=True)
        tpm = autotp.parallelize(model, example_inputs=_example(style, idx, targets))
        if style == "dropout":  # the same sharded model without checkpointing is the reference
            ref = autotp.parallelize(copy.deepcopy(build(style, recompute=False)[0]),
                                     example_inputs=_example(style, idx, targets))
        regions = sum(1 for c in autotp.tp_state(tpm).graphs.values()
                      for name, _ in c.module.named_children() if name.startswith("autotp_recompute_"))
        opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (tpm, ref))
        diffs = {"loss": 0.0, "grad": 0.0}
        for step in range(steps):
            torch.manual_seed(100 + step)  # the same dropout draws for both models
            loss = loss_of(tpm, style, idx, targets)
            loss.backward()
            torch.manual_seed(100 + step)
            rloss = loss_of(ref, style, idx, targets)
            rloss.backward()
            rp = dict(ref.named_parameters())
            local = (lambda n, t: t) if style == "dropout" else (lambda n, t: _local(t, n, tpm))
            diffs["loss"] = max(diffs["loss"], (loss - rloss).abs().item())
            diffs["grad"] = max([diffs["grad"]] + [(p.grad - local(n, rp[n].grad)).abs().max().item()
                                                   for n, p in tpm.named_parameters()])
            for o in (opt, ropt):
                o.step()
                o.zero_grad()
        rp = dict(ref.named_parameters())
        local = (lambda n, t: t) if style == "dropout" else (lambda n, t: _local(t, n, tpm))
        diffs["param"] = max((p - local(n, rp[n])).abs().max().item() for n, p in tpm.named_parameters())
        out[style] = {**diffs, "regions": regions}
    return out


def _regions(model) -> list:
    """The graphs of every Recompute region of ``model``'s captured calls (FSDP units' and pipeline stages'
    pieces included, compiled ones through their graph module)."""
    from autotp.operators.compile import uncompiled
    from autotp.operators.recompute import Recompute
    from autotp.operators.pieces import PieceCall

    found = []
    for c in autotp.tp_state(model).graphs.values():
        graphs = [uncompiled(c.module)] + [uncompiled(m.piece) for m in uncompiled(c.module).modules()
                                           if isinstance(m, PieceCall)]
        for g in graphs:
            found += [m.region for m in g.modules() if isinstance(m, Recompute)]
    return list({id(r): r for r in found}.values())


def _full_or_local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p


def _expected(ref: torch.Tensor, name: str, model, fsdp: bool) -> torch.Tensor:
    """The unsharded model's ``ref`` as this rank sees it: its tp shard, or under FSDP (whose DTensor over tp
    puts the shards side by side) every tp rank's shard side by side."""
    st = autotp.tp_state(model)
    shard = st.shards.get(name)
    if shard is None:
        return ref
    if fsdp:
        return torch.cat([shard.shard(ref, st.tp, r) for r in range(st.tp)], shard.dim)
    return shard.shard(ref, st.tp, st.rank)


def recompute_in_pieces(style: str, tp: int, pp: int = 1, fsdp: bool = False, compile: bool = False,
                        microbatches: int = 2, schedule: str = "1F1B", steps: int = 3,
                        sequence_parallel: bool = False, context_parallel: int = 1) -> dict:
    """A checkpointing model (tests/support/recompute_models.py) under FSDP units (tp × dp, fsdp) or pipeline
    stages (pp × dp × tp): loss, gradients and parameters after AdamW steps against the unsharded checkpointing
    model on the whole batch (each data-parallel replica on its share; with dropout, against the same layout
    without checkpointing, on the same seeds), and per step how often the regions' graphs ran in the forward
    and in the backward (recomputed): as often in both where every region recomputes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.distributed.data_parallel import FSDPConfig

    cp = context_parallel
    dp = dist.get_world_size() // (tp * pp * cp)
    dims, names = ((pp, dp, tp), ("pp", "dp", "tp")) if pp > 1 else ((dp, cp, tp), ("dp", "cp", "tp")) if cp > 1 \
        else ((dp, tp), ("dp", "tp"))
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
    d = mesh["dp"].get_local_rank()
    _, (idx, targets) = build(style)
    copies = max(1, microbatches * dp // idx.shape[0])  # a micro-batch of at least one sample per replica
    idx, targets = idx.repeat(copies, 1), targets.repeat(copies, 1)
    la = (idx.chunk(dp)[d], targets.chunk(dp)[d])
    dropout = style == "dropout"

    def make(recompute: bool):
        model = build(style, recompute)[0]
        if pp > 1:
            pipe = autotp.pipeline(model, example_inputs=la, microbatches=microbatches, schedule=schedule,
                                   mesh=mesh, compile=compile, fsdp=fsdp, sequence_parallel=sequence_parallel)
            return model, pipe.step, list(pipe.parameters()), dict(pipe.named_parameters())
        extra = {"context_parallel": cp} if cp > 1 else {}
        model = autotp.parallelize(model, example_inputs=la, mesh=mesh, compile=compile,
                                   fsdp=FSDPConfig() if fsdp else False, sequence_parallel=sequence_parallel,
                                   **extra)
        return model, lambda *a: loss_of(model, style, *a), list(model.parameters()), dict(model.named_parameters())

    model, step, params, named = make(True)
    if dropout:  # the reference: the same layout without checkpointing, its parameters this rank's as well
        ref, ref_step, ref_params, ref_named = make(False)
    else:
        ref = build(style, recompute=True)[0]
        ref_params, ref_named = list(ref.parameters()), dict(ref.named_parameters())

        def ref_step(*a):
            return loss_of(ref, style, idx, targets)
    regions = _regions(model)
    runs = []  # per run of a region's graph: whether it ran inside the backward (a recomputation)
    for r in regions:
        r.register_forward_pre_hook(lambda *a: runs.append(torch._C._current_graph_task_id() != -1))
    opt, ropt = (torch.optim.AdamW(p, lr=1e-3, eps=1e-6) for p in (params, ref_params))
    out = {"regions": len(regions), "runs": [], "loss": 0.0, "grad": 0.0}
    for s in range(steps):
        runs.clear()
        torch.manual_seed(100 + s)
        loss = step(*la)
        if pp == 1:
            loss.backward()
        out["runs"].append((runs.count(False), runs.count(True)))  # (forward, recomputed)
        loss = loss.detach().clone()
        if not dropout:  # each replica's share of the batch: their mean is the whole batch's loss
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            loss /= dp
        torch.manual_seed(100 + s)
        rloss = ref_step(*la)
        if pp == 1 or not dropout:
            rloss.backward()
        out["loss"] = max(out["loss"], (loss - rloss.detach()).abs().item())
        for n, p in named.items():
            want = ref_named[n].grad if dropout else _expected(ref_named[n].grad, n, model, fsdp)
            got = p.grad
            if dropout or fsdp:
                got, want = _full_or_local(got), _full_or_local(want)
            out["grad"] = max(out["grad"], (got - want).abs().max().item())
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    out["param"] = max(
        (_full_or_local(p) - (_full_or_local(ref_named[n]) if dropout else _expected(ref_named[n], n, model, fsdp)))
        .abs().max().item() for n, p in named.items())
    return out
