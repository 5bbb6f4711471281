"""Rank functions for tests/runtime/test_context_parallel.py: a captured forward run on each rank's sequence chunk
against the whole model on one device."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ranks import CollectiveLog


def _nanogpt_sdpa(layers: int):
    """nanoGPT's flash path (``F.scaled_dot_product_attention(..., is_causal=True)``), tests/scripts."""
    from nanogpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=layers, n_head=4, n_embd=64, block_size=64, vocab_size=128))


def context_parity(cp_steps: int = 3, seq: int = 32, ignore: bool = False) -> dict:
    """The graph rewritten for the world as one cp group: the loss, the logits (gathered), the parameter
    gradients (summed over the group in the graph's backward) and ``cp_steps`` AdamW steps, against one device."""
    from autotp.analysis.context import find_context
    from autotp.capture.tracer import capture
    from autotp.operators.collectives import bind_collectives
    from autotp.operators.gathered import bind_outputs
    from autotp.plan.context_planner import context_plan
    from autotp.plan.plan import Plan
    from autotp.passes.context_parallel import context_parallel

    cp, group = dist.get_world_size(), dist.group.WORLD
    model = _nanogpt_sdpa(2)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 128, (2, seq), generator=g), torch.randint(0, 128, (2, seq), generator=g))
               for _ in range(cp_steps)]
    if ignore:  # some targets not counted: the mean is over the counted ones of the whole group
        for _, t in batches:
            t[:, : seq // 3] = -1
    gm, _ = capture(model, batches[0], {})
    plan = context_plan(gm, find_context(gm, cp), cp)
    gm = context_parallel(gm, Plan(1, context=plan))
    gm.graph.lint()
    gm.recompile()
    bind_collectives(gm, group, axis="cp")
    bind_outputs(gm, group, dist.get_rank(group), axis="cp")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (gm, ref))
    errors = {"loss": 0.0, "logits": 0.0, "grads": 0.0, "params": 0.0}
    calls = None
    for step, (idx, targets) in enumerate(batches):
        with CollectiveLog() as log:
            logits, loss = gm(idx, targets)
            loss.backward()
        if step == 0:
            calls = log.calls
        want_logits, want = ref(idx, targets)
        want.backward()
        errors["loss"] = max(errors["loss"], abs(loss.item() - want.item()))
        errors["logits"] = max(errors["logits"], (logits - want_logits).abs().max().item())
        mine, theirs = dict(gm.named_parameters()), dict(ref.named_parameters())
        errors["grads"] = max(errors["grads"], max((mine[k].grad - theirs[k].grad).abs().max().item() for k in mine))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        errors["params"] = max(errors["params"], max((mine[k] - theirs[k]).abs().max().item() for k in mine))
    return {"errors": errors, "calls": calls, "plan": plan}


def context_parities(steps: int = 3, seq: int = 32) -> dict[bool, dict]:
    """:func:`context_parity` without and with ignored targets, in one launch."""
    return {ignore: context_parity(steps, seq, ignore) for ignore in (False, True)}


def _build(kind: str):
    """(model, args, kwargs) of a spelling: tests/support/context_models.py's, examples/nanogpt.py
    (attention written out), Hugging Face Llama from a config (SDPA with a mask made from positions, labels
    shifted inside its loss), or pattern_models' interleaved rotary and baddbmm over (b·h, s, d)."""
    import context_models

    if kind == "nanogpt_example":
        from nanogpt import GPT, GPTConfig

        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=128))
        return model, tuple(torch.randint(0, 128, (2, 32), generator=g) for _ in range(2)), {}
    if kind == "hf_llama":
        import llama

        torch.manual_seed(0)
        return llama.build_model(), (), llama.example_batch()
    if kind == "hf_llama_padded":  # a padding mask: SDPA given a mask that is not causal
        import llama

        torch.manual_seed(0)
        batch = llama.example_batch()
        mask = torch.ones_like(batch["input_ids"])
        mask[0, :5], mask[1, :12] = 0, 0  # left padding, as batched generation and fine-tuning pad
        labels = batch["input_ids"].masked_fill(mask == 0, -100)
        return llama.build_model(), (), {**batch, "attention_mask": mask, "labels": labels}
    if kind in ("hf_gpt2_eager", "hf_gemma2"):  # Hugging Face's eager attention: one mask for every layer
        import transformers

        torch.manual_seed(0)
        if kind == "hf_gpt2_eager":
            config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                             eos_token_id=0, attn_implementation="eager")
        else:  # tanh soft-capping of the scores and the logits, a sliding window on every other layer
            config = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=16, sliding_window=8, attn_implementation="eager")
        ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
        return transformers.AutoModelForCausalLM.from_config(config), (), {"input_ids": ids, "labels": ids,
                                                                          "use_cache": False}
    if kind.startswith("moe:"):  # tests/support/moe_models.py: experts read by a loop, by W[ids] with bmm, ...
        import moe_models

        return moe_models.build(kind[4:])
    if kind.startswith("hf_moe:"):  # tests/support/hf_moe_models.py: Hugging Face's, on 16 tokens
        import hf_moe_models

        model, args, kwargs = hf_moe_models.build(kind[7:])
        ids = torch.randint(0, hf_moe_models.V, (2, 16), generator=torch.Generator().manual_seed(1))
        return model, args, {**kwargs, "input_ids": ids, "labels": ids}
    if kind in ("rope_interleaved", "baddbmm", "alibi", "softcap"):  # baddbmm: heads folded into the batch
        import pattern_models

        return pattern_models.build(kind)
    return context_models.build(kind)


def _loss(out) -> torch.Tensor:
    return out[1] if isinstance(out, tuple) else out.loss


def _logits(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out.logits


def parallelize_parity(kinds: list[str], steps: int = 3, tp: int = 1, **options) -> dict[str, dict]:
    """Each spelling under ``autotp.parallelize(model, context_parallel=world / tp)`` (with tp > 1 on a
    (cp, tp) mesh): the loss, the logits (read after the step), the gradients (tp 1) and ``steps`` AdamW steps
    against the unsharded model; the collectives of a step that reads only the loss; the error a sequence
    length 2·cp does not divide gets before any rank computes."""
    import autotp
    from autotp.errors import ShardingError
    from torch.distributed.device_mesh import init_device_mesh

    cp, out = dist.get_world_size() // tp, {}
    mesh = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp")) if tp > 1 else None
    for kind in kinds:
        model, args, kwargs = _build(kind)
        ref = copy.deepcopy(model)
        autotp.parallelize(model, example_inputs=(args, kwargs), context_parallel=cp, mesh=mesh, **options)
        # eps 1e-5: Adam's first step divides each gradient by its own size plus eps, so the fp32 rounding of
        # the summed gradients (4e-8) on Gemma-2's smallest ones (tied embedding rows, 4e-7) moved parameters by
        # up to lr·4e-8/eps: 4e-6 with eps 1e-6, and the logits after the steps by 1.1e-5
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-5) for m in (model, ref))
        errors, calls = {"loss": 0.0, "logits": 0.0, "grads": 0.0, "params": 0.0}, None
        for step in range(steps):
            with CollectiveLog() as log:
                got = model(*args, **kwargs)
                loss = _loss(got)
                loss.backward()
            calls = calls if calls is not None else log.calls
            want = ref(*args, **kwargs)
            _loss(want).backward()
            errors["loss"] = max(errors["loss"], abs(loss.item() - _loss(want).item()))
            errors["logits"] = max(errors["logits"], (_logits(got) - _logits(want)).abs().max().item())
            mine, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
            if tp == 1:  # whole parameters: compared as they are (with tp, the steps' losses compare them)
                errors["grads"] = max(errors["grads"], max((mine[k].grad - theirs[k].grad).abs().max().item()
                                                           for k in mine))
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
            if tp == 1:
                errors["params"] = max(errors["params"], max((mine[k] - theirs[k]).abs().max().item()
                                                             for k in mine))
        st = autotp.tp_state(model)
        short = [t[:, : 2 * cp + 2] if isinstance(t, torch.Tensor) else t for t in args]
        short_kw = {k: t[:, : 2 * cp + 2] if isinstance(t, torch.Tensor) else t for k, t in kwargs.items()}
        try:
            model(*short, **short_kw)
            refused = ""
        except ShardingError as e:
            refused = str(e)
        out[kind] = {"errors": errors, "calls": calls, "context": st.plan.context, "refused": refused,
                     "sequence": st.plan.sequence is not None, "experts": [(x.module, x.count) for x in st.plan.experts]}
    return out


def sequence_parity(kinds: list[str], steps: int = 3, tp: int = 2) -> dict[str, dict]:
    """:func:`parallelize_parity` with sequence parallelism: the tp group's norm and residual regions split
    the cp chunk further, ``(b, s/(cp·tp), h)`` per rank."""
    return parallelize_parity(kinds, steps, tp, sequence_parallel=True)


def expert_parity(kinds: list[str], steps: int = 3, tp: int = 2) -> dict[str, dict]:
    """:func:`parallelize_parity` with expert parallelism: E/tp whole experts per tp rank, each computing what
    the router sends them of the cp chunk's tokens."""
    return parallelize_parity(kinds, steps, tp, expert_parallel=True)


def context_dropout(tp: int = 1) -> dict:
    """Dropout on the embeddings and residual branches under ``context_parallel=world / tp``: each cp rank
    draws its chunk's masks from a stream of its own (the chunks' masks differ), the tp ranks of a chunk the
    same ones (the activations dropped are replicated over tp), and the default generator stays in step
    everywhere."""
    import context_models

    import autotp
    from autotp.operators.rng import RegionRandom
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    cp = world // tp
    mesh = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp")) if tp > 1 else None
    model, args, _ = context_models.build("bool_sdpa_mask", dropout=0.3)
    torch.manual_seed(5)
    autotp.parallelize(model, example_inputs=args, context_parallel=cp, mesh=mesh)
    masks: list[torch.Tensor] = []
    streams = []
    for gm in (c.module for c in autotp.tp_state(model).graphs.values()):
        for m in gm.modules():
            if isinstance(m, RegionRandom):
                streams.append(m.stream)
                m.register_forward_hook(lambda mod, inp, o: masks.append(((o == 0) & (inp[0] != 0)).to(torch.uint8)))
    _, loss = model(*args)
    loss.backward()
    cp_group, tp_group = (mesh["cp"].get_group(), mesh["tp"].get_group()) if mesh is not None else (dist.group.WORLD,
                                                                                                     None)

    def gathered(t: torch.Tensor, group) -> list[torch.Tensor]:
        got = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(got, t.contiguous(), group=group)
        return got

    return {
        "streams": streams,
        "dropped": [m.float().mean().item() for m in masks],
        "chunks_differ": all(not torch.equal(*gathered(m, cp_group)[:2]) for m in masks),
        "tp_identical": tp_group is None or all(all(torch.equal(g, m) for g in gathered(m, tp_group))
                                                for m in masks),
        "default_in_step": all(torch.equal(g, torch.get_rng_state()) for g in gathered(torch.get_rng_state(),
                                                                                          dist.group.WORLD)),
        "loss": loss.item(),
    }


def context_fsdp_parity(kinds: list[str], tp: int = 1, steps: int = 3, replicas: int = 1) -> dict[str, dict]:
    """Each spelling under ``parallelize(model, fsdp=True, context_parallel=2)`` on a (dp, cp, tp) mesh of the
    world, each data-parallel replica on its share of the batch: FSDP shards over the dp and cp ranks together
    and its reduce-scatter sums the chunks' gradients (averaging over dp only). The losses, the clipped
    gradient norm and the parameters after ``steps`` AdamW steps against the unsharded model on the whole batch;
    the collectives of a step. ``replicas`` > 1: HSDP, its replica groups splitting dp."""
    from fsdp_workers import _full, _replica, _side_by_side
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    from autotp.distributed.data_parallel import FSDPConfig

    cp = 2
    dp = dist.get_world_size() // (cp * tp)
    out = {}
    for kind in kinds:
        mesh = init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
        ref, args, kwargs = _build(kind)
        la, lk = _replica((args, kwargs), mesh["dp"].get_local_rank(), dp)
        model = autotp.parallelize(copy.deepcopy(ref), example_inputs=(la, lk), context_parallel=cp, mesh=mesh,
                                   fsdp=FSDPConfig(replicas=replicas) if replicas > 1 else True)
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (model, ref))
        errors, calls = {"loss": 0.0, "norm": 0.0, "params": 0.0}, None
        for _ in range(steps):
            with CollectiveLog() as log:
                loss = _loss(model(*la, **lk))
                loss.backward()
            calls = calls if calls is not None else log.calls
            norm = _full(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=mesh["dp"].get_group())
            want = _loss(ref(*args, **kwargs))
            want.backward()
            want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            errors["loss"] = max(errors["loss"], abs(mean.item() / dp - want.item()))
            errors["norm"] = max(errors["norm"], abs(norm.item() - want_norm.item()))
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        theirs = dict(ref.named_parameters())
        errors["params"] = max((_full(p).detach() - _side_by_side(theirs[n].detach(), n, model)).abs().max().item()
                               for n, p in model.named_parameters())
        st = autotp.tp_state(model)
        out[kind] = {"errors": errors, "calls": calls, "grads_in_graph": len(st.plan.context.grads),
                     "rings": len(st.plan.context.attention)}
    return out


def context_script_parity(steps: int = 3) -> dict:
    """What GPU training scripts do, at ``context_parallel=world``: layers under ``torch.utils.checkpoint``
    (non-reentrant and reentrant; the ring's collectives run again in the recomputation) against the model
    without it, fp32; and the example under ``torch.autocast`` (bf16, and fp16 with a GradScaler) for
    ``steps`` AdamW steps against the unsharded model under the same autocast, with the unsharded fp32 run
    giving the scale of autocast's own error."""
    import recompute_models

    import autotp

    cp, out = dist.get_world_size(), {}
    for style in ("layer", "reentrant"):
        model, args = recompute_models.build(style, True)
        ref, _ = recompute_models.build(style, False)
        autotp.parallelize(model, example_inputs=args, context_parallel=cp)
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (model, ref))
        loss_diff = 0.0
        for _ in range(steps):
            loss, want = (recompute_models.loss_of(m, style, *args) for m in (model, ref))
            loss.backward(), want.backward()
            loss_diff = max(loss_diff, abs(loss.item() - want.item()))
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        theirs = dict(ref.named_parameters())
        out[style] = {"loss": loss_diff, "params": max((p - theirs[n]).abs().max().item()
                                                       for n, p in model.named_parameters())}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        model, args, kwargs = _build("nanogpt_example")
        ref, ref32 = copy.deepcopy(model), copy.deepcopy(model)
        autotp.parallelize(model, example_inputs=(args, kwargs), context_parallel=cp)
        runs = ((model, True), (ref, True), (ref32, False))
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m, _ in runs]
        scalers = [torch.amp.GradScaler("cpu", enabled=dtype == torch.float16 and on) for _, on in runs]
        losses = []
        for _ in range(steps):
            for (m, on), opt, scaler in zip(runs, opts, scalers):
                with torch.autocast("cpu", dtype=dtype, enabled=on):
                    loss = _loss(m(*args, **kwargs))
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                losses.append(loss.item())
        got, want, fp32 = losses[0::3], losses[1::3], losses[2::3]
        theirs, theirs32 = dict(ref.named_parameters()), dict(ref32.named_parameters())
        out[name] = {"loss": max(abs(a - b) for a, b in zip(got, want)),
                     "autocast_loss": max(abs(a - b) for a, b in zip(want, fp32)),
                     "params": max((p - theirs[n]).abs().max().item() for n, p in model.named_parameters()),
                     "autocast_params": max((theirs[n] - p).abs().max().item() for n, p in theirs32.items()),
                     "scale": scalers[0].get_scale() if dtype == torch.float16 else None}
    return out


def context_sampling(new_tokens: int = 9) -> dict:
    """A sampling loop under ``torch.no_grad()`` at ``context_parallel=world``: the context grows one token at a
    time, so most lengths are not multiples of 2·cp; those run the whole sequence on every rank, the others
    as rings. The tokens drawn equal one device's (the same seed), and a training step after it is exact; a
    training call of such a length is refused, naming the numbers."""
    import warnings

    import autotp
    from autotp.errors import ShardingError

    cp = dist.get_world_size()
    model, (idx, targets), _ = _build("nanogpt_example")
    ref = copy.deepcopy(model)
    autotp.parallelize(model, example_inputs=(idx, targets), context_parallel=cp)
    drawn = []
    import autotp.parallel.parallelize as par

    build, builds = par._build, []

    def counted(*args, **kwargs):  # every capture the loop's calls make
        builds.append(args[4])
        return build(*args, **kwargs)

    par._build = counted
    try:
        with warnings.catch_warnings(record=True) as said, torch.no_grad():
            warnings.simplefilter("always")
            for m in (model, ref):
                torch.manual_seed(3)
                drawn.append(m.generate(idx[:, :3], new_tokens, top_k=8))
    finally:
        par._build = build
    loss, want = _loss(model(idx, targets)), _loss(ref(idx, targets))
    try:
        _loss(model(idx[:, :5], targets[:, :5])).backward()
        refused = ""
    except ShardingError as e:
        refused = str(e)
    return {"same_tokens": torch.equal(*drawn), "loss": abs(loss.item() - want.item()), "refused": refused,
            "graphs": sorted(str(k[-1]) for k in autotp.tp_state(model).graphs if isinstance(k[-1], str)),
            "warned": [str(w.message) for w in said if "autotp" in str(w.message)], "captures": len(builds)}


def context_compile(kinds: list[str], steps: int = 3, backend: str = "inductor") -> dict[str, dict]:
    """Each spelling under ``parallelize(model, context_parallel=world, compile={"backend": backend})``:
    dynamo's graphs and breaks of the compiled graph (the ring one opaque op, ``autotp::ring_attention``, and
    its backward), and the loss, logits, gradients and ``steps`` AdamW steps of the compiled model against the
    unsharded eager model."""
    import torch._dynamo

    import autotp
    from autotp.operators.compile import DYNAMO_CONFIG, uncompiled
    from autotp.operators.gathered import local_outputs

    cp, out = dist.get_world_size(), {}
    for kind in kinds:
        model, args, kwargs = _build(kind)
        ref = copy.deepcopy(model)
        autotp.parallelize(model, example_inputs=(args, kwargs), context_parallel=cp, compile={"backend": backend})
        (compiled,) = (c.module for c in autotp.tp_state(model).graphs.values())
        gm = uncompiled(compiled)
        rings = sum(1 for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("autotp_cp_attention"))
        torch._dynamo.reset()
        with torch._dynamo.config.patch(**DYNAMO_CONFIG):  # as compile=True traces it
            explained = torch._dynamo.explain(local_outputs(gm)[0])(*args, **kwargs)
        torch._dynamo.reset()
        traced = sum(n.target is torch.ops.autotp.ring_attention.default
                     for g in explained.graphs for n in g.graph.nodes)
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-5) for m in (model, ref))
        errors = {"loss": 0.0, "logits": 0.0, "grads": 0.0, "params": 0.0}
        for _ in range(steps):
            got = model(*args, **kwargs)
            loss = _loss(got)
            loss.backward()
            want = ref(*args, **kwargs)
            _loss(want).backward()
            errors["loss"] = max(errors["loss"], abs(loss.item() - _loss(want).item()))
            errors["logits"] = max(errors["logits"], (_logits(got) - _logits(want)).abs().max().item())
            mine, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
            errors["grads"] = max(errors["grads"], max((mine[k].grad - theirs[k].grad).abs().max().item()
                                                       for k in mine))
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
            errors["params"] = max(errors["params"], max((mine[k] - theirs[k]).abs().max().item() for k in mine))
        out[kind] = {"errors": errors, "rings": rings, "graphs": explained.graph_count, "traced": traced,
                     "breaks": explained.graph_break_count, "reasons": [str(r) for r in explained.break_reasons]}
    return out
