"""Functions that run inside each gloo rank of the parity tests and return what the test asserts on."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import autotp
from ranks import CollectiveLog
from small_models import MODELS, PARITY_ONLY, loss_and_logits


def dense_step_collectives(bsh: int, tokens: int, layers: int = 2) -> tuple[list, list]:
    """Megatron's all-reduces of one training step of a dense LM with a vocab-parallel embedding, head and loss,
    sorted: forward the embedding and 2 per layer (b·s·h) and the loss's max and two sums (b·s); backward
    entering attention and the MLP per layer, and the LM head (b·s·h)."""
    forward = [("all_reduce", "sum", bsh)] * (2 * layers + 1) + [
        ("all_reduce", "max", tokens), ("all_reduce", "sum", tokens), ("all_reduce", "sum", tokens)]
    return sorted(forward), [("all_reduce", "sum", bsh)] * (2 * layers + 1)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item() if a.numel() else 0.0


def _local(ref: torch.Tensor, name: str, tpm) -> torch.Tensor:
    shard = autotp.tp_state(tpm).plan.param(name) or _alias_shard(tpm, name)
    if shard is None:
        return ref
    return shard.shard(ref, autotp.tp_state(tpm).tp, autotp.tp_state(tpm).rank)


def _alias_shard(tpm, name: str):
    """The plan names a tied parameter once; find it under its other names."""
    p = tpm.get_parameter(name)
    for other, q in tpm.named_parameters(remove_duplicate=False):
        if q is p and autotp.tp_state(tpm).plan.param(other) is not None:
            return autotp.tp_state(tpm).plan.param(other)
    return None


def training_parity(model_name: str, steps: int = 3, sequence_parallel: bool = False) -> dict:
    """Loss, logits, gradients, AdamW steps and collectives of a parallelized model vs the original."""
    if model_name in MODELS or model_name in PARITY_ONLY:
        ref, args, kwargs = {**MODELS, **PARITY_ONLY}[model_name]()
    else:
        from toy_models import toy

        ref, args, kwargs = toy(model_name)
    model = copy.deepcopy(ref)
    tpm = autotp.parallelize(model, example_inputs=(args, kwargs), sequence_parallel=sequence_parallel)
    out: dict = {"tp": autotp.tp_state(tpm).tp, "rank": autotp.tp_state(tpm).rank, "plan": autotp.tp_state(tpm).plan.to_dict()}

    log = CollectiveLog()
    with log:
        raw = tpm(*args, **kwargs)
    n_fwd = len(log.calls)
    loss, logits = loss_and_logits(raw)  # reading the full logits gathers them, outside the step
    with log:
        loss.backward()
    out["forward_collectives"] = log.calls[:n_fwd]
    out["backward_collectives"] = log.calls[n_fwd:]
    rloss, rlogits = loss_and_logits(ref(*args, **kwargs))
    rloss.backward()
    out["loss_diff"] = _max_diff(loss, rloss)
    out["logits_diff"] = _max_diff(logits, rlogits)
    ref_params = dict(ref.named_parameters())
    out["grad_diff"] = max(_max_diff(p.grad, _local(ref_params[n].grad, n, tpm)) for n, p in tpm.named_parameters())
    out["local_numel"] = {n: p.numel() for n, p in tpm.named_parameters(remove_duplicate=False)}
    out["full_numel"] = {n: p.numel() for n, p in ref.named_parameters(remove_duplicate=False)}
    out["names_match"] = [n for n, _ in tpm.named_parameters()] == [n for n, _ in ref.named_parameters()]

    # eps 1e-6, not 1e-8: some gradients are zero analytically (a key bias cannot change a softmax) and
    # are fp32 noise (~1e-9) in both runs; Adam would scale that noise up to ±lr at eps 1e-8.
    opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (tpm, ref))
    for _ in range(steps):
        for o, m in ((opt, tpm), (ropt, ref)):
            o.zero_grad()
            loss_and_logits(m(*args, **kwargs))[0].backward()
            o.step()
    out["param_diff"] = max(_max_diff(p, _local(ref_params[n], n, tpm)) for n, p in tpm.named_parameters())
    out.update(_coverage(ref, tpm, autotp.tp_state(tpm)))
    return out


def other_calls(model_name: str = "nanogpt") -> dict:
    """A second input structure, other batch and sequence sizes, and eval mode, after training."""
    ref, args, kwargs = MODELS[model_name]()
    tpm = autotp.parallelize(copy.deepcopy(ref), example_inputs=(args, kwargs))
    idx, targets = args
    out = {}
    with torch.no_grad():
        out["no_targets"] = _max_diff(tpm(idx)[0].full_tensor(), ref(idx)[0])
        g = torch.Generator().manual_seed(5)
        idx2 = torch.randint(0, 256, (3, 20), generator=g)
        t2 = torch.randint(0, 256, (3, 20), generator=g)
        out["other_shape"] = _max_diff(tpm(idx2, t2)[1], ref(idx2, t2)[1])
        idx1 = idx2[:1, :5]
        out["batch_one"] = _max_diff(tpm(idx1)[0].full_tensor(), ref(idx1)[0])
        tpm.eval(), ref.eval()
        out["eval_mode"] = (tpm.training, _max_diff(tpm(idx, targets)[1], ref(idx, targets)[1]))
    out["graphs"] = len(autotp.tp_state(tpm).graphs)
    out["shared_params"] = all(
        gm.get_parameter("transformer.h.0.attn.c_attn.weight") is tpm.transformer.h[0].attn.c_attn.weight
        for gm in (c.module for c in autotp.tp_state(tpm).graphs.values())
    )
    # a retained graph run backward twice: the loss's backward must not reuse what the second one reads
    tpm.train(), ref.train()
    for m in (tpm, ref):
        m.zero_grad()
        loss = m(idx, targets)[1]
        loss.backward(retain_graph=True)
        loss.backward()
    ref_params = dict(ref.named_parameters())
    out["retained_graph"] = max(_max_diff(p.grad, _local(ref_params[n].grad, n, tpm)) for n, p in tpm.named_parameters())
    return out


def large_logits_cross_entropy() -> dict:
    """Vocab-parallel cross-entropy of logits near 1e4 (rows of 100, ranks own 50 each) vs F.cross_entropy:
    the loss of each row and the gradient, with and without label smoothing."""
    import torch.nn.functional as F

    from autotp.operators.vocab_ops import _VocabCE

    g = torch.Generator().manual_seed(0)
    full = torch.randn(64, 100, generator=g) * 3 + 1e4
    target = torch.randint(0, 100, (64,), generator=g)
    rank, per = dist.get_rank(), 100 // dist.get_world_size()
    out = {}
    for smoothing in (0.0, 0.1):
        ref_in = full.clone().requires_grad_()
        ref = F.cross_entropy(ref_in, target, reduction="none", label_smoothing=smoothing)
        ref.sum().backward()
        local = full[:, rank * per:(rank + 1) * per].clone().requires_grad_()
        loss = _VocabCE.apply(local, target, dist.group.WORLD, rank * per, per, 100, 0, -100, smoothing)
        loss.sum().backward()
        out[smoothing] = (_max_diff(loss, ref), _max_diff(local.grad, ref_in.grad[:, rank * per:(rank + 1) * per]))
    return out


def dropout_streams() -> dict:
    """With dropout, replicated activations stay identical across ranks; sharded-region masks differ."""
    import torch.distributed as dist

    from autotp.operators.collectives import EnterTP
    from autotp.operators.rng import RegionRandom

    ref, args, _ = MODELS["nanogpt"](dropout=0.1)
    torch.manual_seed(1234)
    tpm = autotp.parallelize(ref, example_inputs=args)
    masks, replicated = [], []
    for gm in (c.module for c in autotp.tp_state(tpm).graphs.values()):
        for m in gm.modules():
            if isinstance(m, RegionRandom):
                m.register_forward_hook(lambda mod, inp, o: masks.append(((o == 0) & (inp[0] != 0), inp[0] != 0)))
            if isinstance(m, EnterTP):  # every input of a column-parallel matmul is a replicated activation
                m.register_forward_hook(lambda mod, inp, o: replicated.append(inp[0].detach().clone()))
    _, loss = tpm(*args)
    loss.backward()
    world = dist.get_world_size()

    def same_everywhere(t: torch.Tensor) -> bool:
        got = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(got, t.contiguous())
        return all(torch.equal(got[0], g) for g in got)

    dropped, live = masks[0]
    return {
        "random_region_ops": len(masks),
        "replicated_checked": len(replicated),
        "replicated_identical": all(same_everywhere(x) for x in replicated),
        "default_stream_identical": same_everywhere(torch.get_rng_state()),
        "region_masks_differ": not same_everywhere(dropped.to(torch.uint8)),
        "dropped_fraction": (dropped.sum() / live.sum()).item(),
    }


def checkpoint_round_trip(model_name: str) -> dict:
    """full_state_dict -> unsharded model -> same numbers; and back into a fresh parallelized model."""
    ref, args, kwargs = MODELS[model_name]()
    tpm = autotp.parallelize(copy.deepcopy(ref), example_inputs=(args, kwargs))
    opt = torch.optim.AdamW(tpm.parameters(), lr=1e-2)
    for _ in range(2):  # move away from the initial weights so a no-op load would be caught
        opt.zero_grad()
        loss_and_logits(tpm(*args, **kwargs))[0].backward()
        opt.step()
    full = autotp.full_state_dict(tpm)
    unsharded = copy.deepcopy(ref)
    result = unsharded.load_state_dict(full, strict=True)
    with torch.no_grad():
        loss, logits = loss_and_logits(tpm(*args, **kwargs))
        uloss, ulogits = loss_and_logits(unsharded(*args, **kwargs))
        fresh = autotp.parallelize(copy.deepcopy(ref), example_inputs=(args, kwargs))
        before = _max_diff(loss_and_logits(fresh(*args, **kwargs))[0], loss)
        autotp.load_full_state_dict(fresh, full)
        floss, flogits = loss_and_logits(fresh(*args, **kwargs))
    return {
        "keys_match": sorted(full) == sorted(ref.state_dict()),
        "shapes_match": all(full[k].shape == v.shape for k, v in ref.state_dict().items()),
        "missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys),
        "unsharded_loss_diff": _max_diff(loss, uloss), "unsharded_logits_diff": _max_diff(logits, ulogits),
        "fresh_differed_before": before, "reloaded_loss_diff": _max_diff(loss, floss),
        "reloaded_logits_diff": _max_diff(logits, flogits),
    }


def replicated_block() -> dict:
    """A block autotp cannot shard exactly: replicated with a warning naming the op, numbers unchanged."""
    import warnings

    from toy_models import toy

    ref, args, kwargs = toy("head_mixing")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tpm = autotp.parallelize(copy.deepcopy(ref), example_inputs=(args, kwargs))
    loss, _ = loss_and_logits(tpm(*args))
    return {"warnings": [str(w.message) for w in caught], "loss_diff": _max_diff(loss, ref(*args)[1]),
            "block_sharded": any(n.startswith("block.") for n, _ in autotp.tp_state(tpm).plan.params)}


def _hf(kind: str):
    from small_models import gpt2, llama

    model, _, kw = (gpt2 if kind == "gpt2" else llama)()
    ids = kw["input_ids"]
    return model, lambda m: m(input_ids=ids, labels=ids).loss  # use_cache as configured: a cache comes back


def _test_transformer():
    import torch.nn.functional as F
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(n_layers=2, vocab_size=64, max_seq_len=16, dim=64, n_heads=4, dropout_p=0.0))
    g = torch.Generator().manual_seed(1)
    ids, tgt = (torch.randint(0, 64, (2, 16), generator=g) for _ in range(2))
    return model, lambda m: F.cross_entropy(m(ids).flatten(0, 1), tgt.flatten())


def default_call_parity(kind: str, steps: int = 3) -> dict:
    """``parallelize(model)`` with no example, then the user's own training call: 3 AdamW steps."""
    ref, step_loss = _test_transformer() if kind == "test_transformer" else _hf(kind)
    model = autotp.parallelize(copy.deepcopy(ref))
    st = autotp.tp_state(model)
    opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (model, ref))
    losses = []
    for _ in range(steps):
        for o, m in ((opt, model), (ropt, ref)):
            o.zero_grad()
            loss = step_loss(m)
            loss.backward()
            o.step()
            losses.append(loss.item())
    ref_params = dict(ref.named_parameters())
    return {
        "tp": st.tp, "loss_diff": max(abs(a - b) for a, b in zip(losses[::2], losses[1::2])),
        "param_diff": max(_max_diff(p, _local(ref_params[n], n, model)) for n, p in model.named_parameters()),
        "replicated": [list(r) for c in st.graphs.values() for r in c.plan.replicated],
        "sharded": len(st.shards), "calls": len(st.graphs), "same_class": isinstance(model, type(ref)),
    }


def default_calls(kinds: list[str]) -> dict:
    return {kind: default_call_parity(kind) for kind in kinds}


def capture_styles(styles: list[str], steps: int = 3) -> dict:
    """Each capture style (tests/support/capture_models.py) trained 3 AdamW steps against the unsharded model."""
    from capture_models import build

    out = {}
    for style in styles:
        ref, args, _ = build(style)
        # a second instance, not a deep copy: a copied lambda still calls the original's submodules
        model = autotp.parallelize(build(style)[0], example_inputs=args)
        opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (model, ref))
        loss_diff = 0.0
        for _ in range(steps):
            got, want = model(*args), ref(*args)
            loss_diff = max(loss_diff, _max_diff(got[1], want[1]), _max_diff(got[0], want[0]))
            for o, (_, loss) in ((opt, got), (ropt, want)):
                o.zero_grad()
                loss.backward()
                o.step()
        ref_params = dict(ref.named_parameters())
        rbuf = dict(ref.named_buffers())
        st = autotp.tp_state(model)
        out[style] = {
            "loss_diff": loss_diff,
            "param_diff": max(_max_diff(p, _local(ref_params[n], n, model)) for n, p in model.named_parameters()),
            "buffer_diff": max([_max_diff(b.float(), rbuf[n].float()) for n, b in model.named_buffers()] or [0.0]),
            "replicated": [list(r) for r in st.plan.replicated],
            "sharded_fraction": sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in ref.parameters()),
        }
    return out


def hf_generate(kinds: list[str], use_cache: bool, tmp: str | None = None) -> dict:
    """Greedy ``generate`` of a parallelized Hugging Face model against the unsharded one; and
    ``save_pretrained`` -> ``from_pretrained`` of the sharded model."""
    import os

    import torch.distributed as dist

    out = {}
    for kind in kinds:
        ref, _ = _hf(kind)
        model = autotp.parallelize(copy.deepcopy(ref))
        prompt = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(3))
        mask = torch.ones_like(prompt)
        kw = dict(max_new_tokens=8, do_sample=False, use_cache=use_cache, attention_mask=mask, pad_token_id=0)
        gathers = []
        full = autotp.GatheredOnUse._gathered

        def counted(self):  # what each step gathers: the last position's logits, never the cache
            if self._full is None:
                gathers.append(tuple(self.shape))
            return full(self)

        autotp.GatheredOnUse._gathered = counted
        try:
            got = model.generate(prompt, **kw)
        finally:
            autotp.GatheredOnUse._gathered = full
        want = ref.generate(prompt, **kw)
        r = {"same_tokens": torch.equal(got, want), "new": got.shape[1] - prompt.shape[1], "gathers": gathers}
        if tmp is not None:
            path = os.path.join(tmp, kind)
            model.save_pretrained(path)
            back = type(ref).from_pretrained(path)
            sd, rsd = back.state_dict(), ref.state_dict()
            r["round_trip"] = sorted(sd) == sorted(rsd) and all(torch.equal(sd[k], rsd[k]) for k in sd)
            r["files"] = sorted(os.listdir(path))
            dist.barrier()
        out[kind] = r
    return out


def pattern_parity(kinds: list[str], steps: int = 3, sequence_parallel: bool = False,
                   models: str = "pattern_models", expert_parallel: bool = False) -> dict:
    """Each spelling of ``models``'s ``build(kind)`` (tests/support/pattern_models.py by default): 3 AdamW steps
    against the unsharded model, the collectives of one step, how much of each weight this rank holds, and
    the 2-D parameters left whole with the plan's reason (``whole``) or without one (``unexplained``)."""
    import importlib

    import torch.distributed as dist

    build = importlib.import_module(models).build

    tp = dist.get_world_size()
    out = {}
    for kind in kinds:
        ref, args, kwargs = build(kind)
        model = autotp.parallelize(build(kind)[0], example_inputs=(args, kwargs) if kwargs else args,
                                   sequence_parallel=sequence_parallel, expert_parallel=expert_parallel)
        log = CollectiveLog()
        with log:
            loss = loss_and_logits(model(*args, **kwargs))[0]
        n_fwd = len(log.calls)
        with log:
            loss.backward()
        rloss = loss_and_logits(ref(*args, **kwargs))[0]
        rloss.backward()
        ref_params = dict(ref.named_parameters())
        grad_diff = max(_max_diff(p.grad, _local(ref_params[n].grad, n, model)) if p.grad is not None
                        else float(ref_params[n].grad is not None) for n, p in model.named_parameters())
        opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (model, ref))
        diffs = [_max_diff(loss, rloss)]
        for _ in range(steps):  # the loss of each step's forward, after the previous step's update
            losses = []
            for o, m in ((opt, model), (ropt, ref)):
                o.zero_grad()
                losses.append(loss_and_logits(m(*args, **kwargs))[0])
                losses[-1].backward()
                o.step()
            diffs.append(_max_diff(*losses))
        st = autotp.tp_state(model)
        local = {n: p.numel() for n, p in model.named_parameters()}
        out[kind] = {
            "loss_diff": max(diffs), "grad_diff": grad_diff,
            "param_diff": max(_max_diff(p, _local(ref_params[n], n, model)) for n, p in model.named_parameters()),
            "replicated": [list(r) for r in st.plan.replicated],
            "forward": log.calls[:n_fwd], "backward": log.calls[n_fwd:],
            # 2-D weights not at 1/tp, and those whose kv heads are held by several ranks (fewer than tp)
            "quarter": sorted(n for n, p in ref.named_parameters() if p.dim() == 2 and local[n] * tp != p.numel()),
            "kv_replicated": sorted(n for n, sh in st.shards.items() if any(g.parts < tp for g in sh.segments)),
            **_coverage(ref, model, st),
            "fraction": sum(local.values()) / sum(p.numel() for p in ref.parameters()),  # of the model, per rank
            "experts": {n: sh.role for n, sh in st.shards.items() if sh.role == "experts"},
        }
    return out


def _coverage(ref, model, st) -> dict:
    """The 2-D parameters this rank holds whole and the plan does not cut (kv heads held whole by design are
    cut by the plan): with the plan's reason, and without one (a gap)."""
    local = {n: p.numel() for n, p in model.named_parameters()}
    listed = {w.name: w.reason for w in getattr(st.plan, "whole", ())}
    kept = sorted(n for n, p in ref.named_parameters()
                  if p.dim() >= 2 and local.get(n) == p.numel() and n not in st.shards)
    return {"whole": {n: listed[n] for n in kept if n in listed}, "unexplained": [n for n in kept if n not in listed]}


def cache_parity(kinds: list[str], prompt_len: int = 5, steps: int = 6) -> dict:
    """KV caches in module buffers written in place (tests/support/cache_models.py): a prefill call and one-token
    decode calls under no_grad against the unsharded model: logits, greedy tokens, the cache's local
    shape and the collectives of one decode call."""
    import torch.distributed as dist

    from cache_models import B, build, generate

    out = {}
    prompt = torch.randint(0, 96, (B, prompt_len), generator=torch.Generator().manual_seed(3))
    for kind in kinds:
        ref = build(kind)
        model = autotp.parallelize(build(kind), example_inputs=(prompt, torch.arange(prompt_len)))
        ref_logits, ref_tokens = generate(ref, prompt, steps)
        logits, tokens = generate(model, prompt, steps)
        log = CollectiveLog()
        with torch.no_grad(), log:
            model(tokens[:, -1:], torch.tensor([prompt_len + steps])).full_tensor()
        out[kind] = {
            "logits_diff": max(_max_diff(a, b) for a, b in zip(logits, ref_logits)),
            "tokens_equal": bool(torch.equal(tokens, ref_tokens)),
            "cache_shape": list(model.attn[0].kv_cache.k_cache.shape),
            "replicated": [list(r) for r in autotp.tp_state(model).plan.replicated],
            "decode": log.calls,
            "tp": dist.get_world_size(),
        }
    return out


def sequence_parallel_parity(models: list[str], extras: bool = True) -> dict:
    """``sequence_parallel=True``: training parity and collectives of each model (one launch for all), then
    (``extras``) on nanoGPT, calls that need the whole sequence or whose length tp does not divide, and
    dropout streams."""
    import warnings

    out = {name: training_parity(name, sequence_parallel=True) for name in models}
    if not extras:
        return out
    ref, (idx, targets), _ = MODELS["nanogpt"]()
    tpm = autotp.parallelize(copy.deepcopy(ref), example_inputs=(idx, targets), sequence_parallel=True)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        last = _max_diff(tpm(idx)[0].full_tensor(), ref(idx)[0])  # x[:, [-1]] before the LM head
        short = (idx[:, :-1].contiguous(), targets[:, :-1].contiguous())  # 31 positions
        log = CollectiveLog()
        with log:
            odd = tpm(*short)[1]
        odd_diff = _max_diff(odd, ref(*short)[1])
    st = autotp.tp_state(tpm)
    plans = [c.plan for c in st.graphs.values()]
    out["other_calls"] = {
        "last_position_diff": last, "odd_length_diff": odd_diff, "odd_length_calls": log.calls,
        "gathers": [g.reason for p in plans if p.sequence is not None for g in p.sequence.gathers],
        "warnings": [str(w.message) for w in caught], "graphs": len(st.graphs),
    }
    out["dropout"] = _sequence_dropout()
    out["patterns"] = pattern_parity(SEQUENCE_PATTERNS, sequence_parallel=True)
    return out


# attention spellings whose pairs sequence parallelism must find the sequence of: rotary as complex numbers,
# heads folded under the batch with ALiBi, q/k norms with grouped kv heads, attention and MLP side by side
SEQUENCE_PATTERNS = ["rope_complex", "baddbmm_alibi", "gqa_qk_norm", "parallel"]


def _sequence_dropout() -> dict:
    """With sequence parallelism every dropout outside the pairs draws from the per-rank stream (each rank
    holds other positions); the default generator stays in step across the group."""
    import torch.distributed as dist

    from autotp.operators.rng import RegionRandom

    ref, args, _ = MODELS["nanogpt"](dropout=0.1)
    torch.manual_seed(1234)
    tpm = autotp.parallelize(ref, example_inputs=args, sequence_parallel=True)
    masks = []
    gm = next(iter(autotp.tp_state(tpm).graphs.values())).module
    split = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), RegionRandom):
            if len(node.meta["val"].shape) == 3:  # (b, s/t, h): the split regions (attention's are 4-D)
                split.append(node.target)
                gm.get_submodule(node.target).register_forward_hook(
                    lambda mod, inp, o: masks.append(((o == 0) & (inp[0] != 0)).to(torch.uint8)))
    tpm(*args)[1].backward()
    world = dist.get_world_size()

    def same_everywhere(t: torch.Tensor) -> bool:
        got = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(got, t.contiguous())
        return all(torch.equal(got[0], g) for g in got)

    return {"split_random_ops": len(split), "random_nodes": len(autotp.tp_state(tpm).plan.random_nodes),
            "masks_differ": not same_everywhere(masks[0]),
            "default_stream_identical": same_everywhere(torch.get_rng_state()),
            "dropped_fraction": masks[0].float().mean().item()}


def preloaded() -> dict:
    """What this rank found imported when it started: the fork server's preload (tests/support/rank_preload.py)."""
    import sys

    return {"preload": "rank_preload" in sys.modules, "passes": "autotp.passes" in sys.modules,
            "analysis": "autotp.analysis.result" in sys.modules}
