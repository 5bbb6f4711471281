"""Ranks of tests/io/test_weights.py: models built on meta, parallelized, loaded straight into their shards
from each checkpoint format, checked against the unsharded model loaded the ordinary way."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import autotp
from small_models import gpt2, llama, loss_and_logits, nanogpt

# name -> builder; GPT-2 with vocab 97: padded at tp 2 (49 rows per rank) and 4 (25), Conv1D, tied head;
# Llama: 2 kv heads, replicated over pairs of ranks at tp 4; nanoGPT: fused c_attn and a tied head
MODELS = {"nanogpt": nanogpt, "gpt2": lambda: gpt2(vocab=97), "llama": llama}
HF = {"gpt2", "llama"}
TOL = 1e-5


def build(name: str, seed: int = 0):
    torch.manual_seed(seed)
    model, args, kwargs = MODELS[name]()
    return model, args, kwargs


def ordinary(name: str, root: str, state: str = "state.pt"):
    """The unsharded model loaded the ordinary way: ``from_pretrained`` for Hugging Face models, else
    ``load_state_dict(torch.load(...))``; built with another seed, so nothing is equal by accident."""
    model, args, kwargs = build(name, seed=1)
    if name in HF and state == "state.pt":
        model = type(model).from_pretrained(os.path.join(root, name, "hf"))
    else:
        model.load_state_dict(torch.load(os.path.join(root, name, state), weights_only=True))
    return model.eval(), args, kwargs


def _scramble(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # a load that misses anything shows up as NaN


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item()


def _outputs(model, ref, args, kwargs) -> float:
    with torch.no_grad():
        (loss, logits), (rloss, rlogits) = loss_and_logits(model(*args, **kwargs)), \
            loss_and_logits(ref(*args, **kwargs))
    return max(_diff(loss, rloss), _diff(logits, rlogits))


def _same(full: dict, want: dict) -> list[str]:
    """Names whose tensors are not bit-identical (or missing)."""
    return sorted(k for k in want if k not in full or not torch.equal(full[k], want[k])) + \
        sorted(k for k in full if k not in want)


def _step(model, ref, args, kwargs) -> dict:
    """One AdamW step on both; the next loss and every parameter (this rank's slice of the reference's)."""
    model.train(), ref.train()
    opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (model, ref))
    for o, m in ((opt, model), (ropt, ref)):
        o.zero_grad()
        loss_and_logits(m(*args, **kwargs))[0].backward()
        o.step()
    model.eval(), ref.eval()
    full = autotp.full_state_dict(model)
    rstate = ref.state_dict()
    return {"loss": _outputs(model, ref, args, kwargs), "params": max(_diff(full[k], rstate[k]) for k in rstate)}


def _meta_model(name: str, args, kwargs, group=None):
    with autotp.empty_weights():
        model = build(name)[0]
    return autotp.parallelize(model, example_inputs=(args, kwargs), tp_group=group).eval()


def load_formats(root: str) -> dict:
    """tp = world: every format into a meta-built model, then one training step, then the exports and an
    autotp checkpoint (for the next launch to load at another tp)."""
    from autotp.io.checkpoint import save_checkpoint
    from autotp.distributed.launch import init_distributed

    ctx = init_distributed(tp=dist.get_world_size())
    out = {}
    for name in MODELS:
        ref, args, kwargs = ordinary(name, root)
        model = _meta_model(name, args, kwargs)
        st = autotp.tp_state(model)
        held = sum(p.numel() for p in model.parameters())  # allocated by parallelize, before any load
        r = {"tp": st.tp, "held": held, "full": sum(p.numel() for p in ref.parameters()), "formats": {},
             "kv_replicated": sorted(n for n, s in st.shards.items() if s.replicated_blocks(st.tp))}
        try:  # uninitialised memory until a load: refused, not computed with
            model(*args, **kwargs)
            r["refused"] = ""
        except autotp.ShardingError as exc:
            r["refused"] = str(exc)
        files = {fmt: path for fmt, path in _formats(root, name) if fmt != "dcp"}
        before = {fmt: _digest(path) for fmt, path in files.items()}
        # the mapped loads last: the training step below writes to the views of the files' mappings
        for fmt, path in [*_formats(root, name), *((f"{fmt}-mmap", path) for fmt, path in files.items())]:
            _scramble(model)
            loaded = autotp.load_weights(model, path, mmap=fmt.endswith("-mmap"))
            r["formats"][fmt] = {"kind": loaded.kind, "bytes": loaded.bytes_read, "mapped": loaded.mapped,
                                 "tensors": loaded.tensors,
                                 "differ": _same(autotp.full_state_dict(model), ref.state_dict()),
                                 "outputs": _outputs(model, ref, args, kwargs)}
        r["step"] = _step(model, ref, args, kwargs)
        r["files_unchanged"] = before == {fmt: _digest(path) for fmt, path in files.items()}
        base = os.path.join(root, name)
        save_checkpoint(model, ctx, os.path.join(base, "autotp"))
        autotp.save_weights(model, os.path.join(base, "export"), max_shard_bytes=64 << 10)
        autotp.save_weights(model, os.path.join(base, "export.pt"), format="torch")
        trained = autotp.full_state_dict(model)  # what the exports must hold, bit for bit
        if dist.get_rank() == 0:
            torch.save(trained, os.path.join(base, "trained.pt"))
        out[name] = r
    return out


def _digest(path: str) -> str:
    """A SHA-256 of a checkpoint file, or of every file of a folder."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(os.listdir(path)) if os.path.isdir(path) else [""]:
        with open(os.path.join(path, f) if f else path, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


def _formats(root: str, name: str) -> list[tuple[str, str]]:
    base = os.path.join(root, name)
    safetensors = os.path.join(base, "hf") if name in HF else os.path.join(base, "model.safetensors")
    return [("safetensors", safetensors), ("torch", os.path.join(base, "state.pt")), ("dcp", os.path.join(base, "dcp"))]


def reload_exports(root: str) -> dict:
    """tp = world (another than the saving job's): the autotp checkpoint and both exports of the trained
    model load bit-identically; and at tp 1 (a group of one per rank) for the fused nanoGPT."""
    out = {}
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
    for name in MODELS:
        ref, args, kwargs = ordinary(name, root, "trained.pt")
        want = ref.state_dict()
        for tp, group in ((None, None), (1, singles[dist.get_rank()])):
            if tp == 1 and name != "nanogpt":
                continue
            model = _meta_model(name, args, kwargs, group)
            for fmt in ("autotp", "export", "export.pt"):
                _scramble(model)
                loaded = autotp.load_weights(model, os.path.join(root, name, fmt))
                out[(name, autotp.tp_state(model).tp, fmt)] = {
                    "kind": loaded.kind, "differ": _same(autotp.full_state_dict(model), want),
                    "outputs": _outputs(model, ref, args, kwargs)}
    return out
