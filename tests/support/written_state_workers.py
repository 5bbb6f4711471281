"""Rank functions of tests/runtime/test_written_state.py: each spelling of tests/support/written_state_models.py parallelized,
trained with the loss the forward keeps on the model, sampled, and its whole ``__dict__`` state compared with the
unsharded model's after each phase."""
from __future__ import annotations

import torch
import torch.distributed as dist

import autotp
from autotp.operators.gathered import GatheredOnUse
from parity_workers import _local, _max_diff
from written_state_models import S, build

# what parallelize documents it changes (parameters: this rank's shards; its own state on the root)
SKIP = {"_parameters", "_autotp", "_modules", "forward"}


def _plain(x: object) -> object:
    if isinstance(x, GatheredOnUse):
        x = x.full_tensor()
    return x.detach() if isinstance(x, torch.Tensor) else x


def _close(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.is_floating_point() or x.is_complex():
        return x.numel() == 0 or (x - y).abs().max().item() <= 1e-5
    return torch.equal(x, y)


def state_diff(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Where two models' ``__dict__`` state differs, recursively (buffers, plain attributes, dicts, lists):
    tensors by shape, dtype and values (1e-5), other values by equality."""
    out: list[str] = []

    def cmp(x: object, y: object, at: str, depth: int = 0) -> None:
        x, y = _plain(x), _plain(y)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.shape != y.shape \
                    or x.dtype != y.dtype or not _close(x, y):
                out.append(f"{at}: {type(x).__name__} {getattr(x, 'shape', x)} vs {type(y).__name__} "
                           f"{getattr(y, 'shape', y)}")
        elif isinstance(x, dict) and isinstance(y, dict) and depth < 4:
            if set(x) != set(y):
                out.append(f"{at}: keys {sorted(map(str, x))} vs {sorted(map(str, y))}")
            for k in set(x) & set(y):
                cmp(x[k], y[k], f"{at}[{k!r}]", depth + 1)
        elif isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and depth < 4:
            if len(x) != len(y):
                out.append(f"{at}: length {len(x)} vs {len(y)}")
            for i, (p, q) in enumerate(zip(x, y)):
                cmp(p, q, f"{at}[{i}]", depth + 1)
        elif isinstance(x, (int, float, str, bool, type(None))) or isinstance(y, (int, float, str, bool, type(None))):
            if x != y:
                out.append(f"{at}: {x!r} vs {y!r}")

    mods = dict(b.named_modules())
    for name, m in a.named_modules():
        other = mods.get(name)
        if other is None:
            out.append(f"module {name} missing")
            continue
        keys = (set(m.__dict__) | set(other.__dict__)) - SKIP
        for k in sorted(keys):
            cmp(m.__dict__.get(k, "<absent>"), other.__dict__.get(k, "<absent>"), f"{name or '<root>'}.{k}")
    return out


def _greedy(model: torch.nn.Module, idx: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(steps):
            logits = model(idx[:, -S:])
            idx = torch.cat((idx, logits[:, -1, :].argmax(-1, keepdim=True)), dim=1)
    return idx


def written_state_parity(styles: list[str], steps: int = 3, blocks: int = 2) -> dict:
    out = {}
    for style in styles:
        ref, (x, y) = build(style, blocks)
        model = autotp.parallelize(build(style, blocks)[0], example_inputs=(x, y))
        opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (model, ref))
        r = {"logits": 0.0, "loss": 0.0, "grad": 0.0, "state": []}
        for step in range(steps):
            got, want = model(x, y), ref(x, y)
            r["logits"] = max(r["logits"], _max_diff(got, want))
            # the training script reads the loss off the model, as llama2.c's does
            r["loss"] = max(r["loss"], _max_diff(model.last_loss, ref.last_loss))
            r["state"] += [f"step {step}: {d}" for d in state_diff(model, ref)]
            for o, m in ((opt, model), (ropt, ref)):
                o.zero_grad()
                m.last_loss.backward()
            rg = {n: p.grad for n, p in ref.named_parameters()}
            r["grad"] = max(r["grad"], max(_max_diff(p.grad, _local(rg[n], n, model))
                                           for n, p in model.named_parameters()))
            opt.step()
            ropt.step()
        rparams = dict(ref.named_parameters())
        r["param"] = max(_max_diff(p, _local(rparams[n], n, model)) for n, p in model.named_parameters())
        r["tokens"] = torch.equal(_greedy(model, x[:, :3], 5), _greedy(ref, x[:, :3], 5))
        r["state"] += [f"sampled: {d}" for d in state_diff(model, ref)]
        if style == "lazy_caches":  # a method of the model reads what its forward cached
            model.reset_cache()
            ref.reset_cache()
            r["state"] += [f"reset: {d}" for d in state_diff(model, ref)]
        r["fraction"] = sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in ref.parameters())
        r["graphs"] = len(autotp.tp_state(model).graphs)
        r["copied"] = [c.copied for c in autotp.tp_state(model).graphs.values()]
        out[style] = r
    return out


def _written(model: torch.nn.Module, ref: torch.nn.Module) -> dict[str, list[str]]:
    """The attributes (``module.name``) whose state differs between the two models: state_diff's entries by
    the piece they name."""
    out: dict[str, list[str]] = {}
    for d in state_diff(model, ref):
        at = d.split(":")[0].split("[")[0].removeprefix("<root>.")
        out.setdefault(at, []).append(d)
    return out


def pipeline_written_state(styles: list[str], tp: int = 1, steps: int = 3) -> dict:
    """Each spelling cut into 2 pipeline stages (1F1B, 2 micro-batches; ``tp`` ranks per stage), trained from
    its step's loss (the one the forward keeps on the model), then evaluated: per phase, the pieces of
    ``__dict__`` state where this rank's model differs from the unsharded model's, and the numbers."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1, tp), mesh_dim_names=("pp", "dp", "tp"))
    out = {}
    for style in styles:
        ref, (x, y) = build(style)
        model = build(style)[0]
        pipe = autotp.pipeline(model, example_inputs=(x, y), microbatches=2, mesh=mesh)
        st = autotp.tp_state(model)
        opt = torch.optim.AdamW(list(pipe.parameters()), lr=1e-3, eps=1e-6)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
        r = {"loss": 0.0, "phases": [], "stages": list(pipe.stage_indices)}
        for _ in range(steps):
            loss = pipe.step(x, y)
            ref(x, y)
            r["loss"] = max(r["loss"], abs(loss.item() - ref.last_loss.item()))
            r["phases"].append(_written(model, ref))
            ref.last_loss.backward()
            for o in (opt, ropt):
                o.step()
                o.zero_grad(set_to_none=True)
        refs = dict(ref.named_parameters())
        r["param"] = max(_max_diff(p, _local(refs[n], n, model)) for n, p in pipe.named_parameters())
        ref.eval()
        with torch.no_grad():
            ref(x, y)
        ref.train()  # eval_step runs the eval-mode graph; the model keeps its mode
        r["eval"] = abs(pipe.eval_step(x, y).item() - ref.last_loss.item())
        r["phases"].append(_written(model, ref))
        r["written"] = sorted(".".join(p for p in at[:2] if p) for at in st.written)
        out[style] = r
    return out
