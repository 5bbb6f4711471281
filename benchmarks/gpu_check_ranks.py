"""What benchmarks/gpu_check.py runs inside its ranks: the exactness rows (tp 2, gloo, both ranks on one
device), gloo's all-reduce curve on that device, and the nccl launch at world 1.

Every row is a dict: ``check`` (what), ``value`` (the measured number), ``bound`` (the largest value that
passes; None: recorded only), ``ok``, ``note``, ``seconds``. A row that raises becomes a failed row with the
error, so one broken path does not hide the others (both ranks run the same rows, so both raise alike).
"""
from __future__ import annotations

import copy
import datetime
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "tests", "support"), os.path.join(ROOT, "examples")]

import autotp  # noqa: E402
from small_models import MODELS, loss_and_logits  # noqa: E402
from parity_workers import _local  # noqa: E402

FP32_BOUND = 1e-5
STEPS = 3


def exact_settings() -> dict:
    """fp32 stays fp32: TF32 off for matmuls and convolutions (torch's matmul default, cudnn's is on)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return {"cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda.matmul.allow_bf16_reduced_precision_reduction":
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            "cuda.matmul.allow_fp16_reduced_precision_reduction":
                torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction}


def _row(check: str, fn: Callable[[], tuple[float, str]], bound: float | None) -> dict:
    t0 = time.perf_counter()
    trace = None
    try:
        value, note = fn()
        ok = bound is None or value <= bound
    except Exception as exc:  # recorded, not raised: the other rows still run
        value, note, ok = float("nan"), f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}", False
        trace = traceback.format_exc()
    return {"check": check, "value": value, "bound": bound, "ok": ok, "note": note,
            "seconds": round(time.perf_counter() - t0, 2), "trace": trace}


def _build(name: str, device: torch.device):
    ref, args, kwargs = MODELS[name]()
    ref.to(device)
    move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return ref, tuple(map(move, args)), {k: move(v) for k, v in kwargs.items()}


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b|: the error in units of the tensor's scale."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0


def _grads(tpm, ref, measure=_diff) -> float:
    rp = dict(ref.named_parameters())
    return max(measure(p.grad, _local(rp[n].grad, n, tpm)) for n, p in tpm.named_parameters())


def _params(tpm, ref) -> float:
    rp = dict(ref.named_parameters())
    return max(_diff(p, _local(rp[n], n, tpm)) for n, p in tpm.named_parameters())


def fp32_parity(name: str, device: torch.device, compile: object = False, user_compile: dict | None = None
                ) -> tuple[float, str]:
    """Loss, gradients and 3 AdamW steps in fp32 against the unsharded model: max |Δ| over all of them."""
    ref, args, kwargs = _build(name, device)
    tpm = autotp.parallelize(copy.deepcopy(ref), example_inputs=(args, kwargs), compile=compile)
    run = torch.compile(tpm, **user_compile) if user_compile is not None else tpm
    loss = loss_and_logits(run(*args, **kwargs))[0]
    loss.backward()
    rloss = loss_and_logits(ref(*args, **kwargs))[0]
    rloss.backward()
    d_loss, d_grad = _diff(loss, rloss), _grads(tpm, ref)
    opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (tpm, ref))
    for _ in range(STEPS):
        for o, m in ((opt, run), (ropt, ref)):
            o.zero_grad()
            loss_and_logits(m(*args, **kwargs))[0].backward()
            o.step()
    d_param = _params(tpm, ref)
    return max(d_loss, d_grad, d_param), f"loss {d_loss:.1e}, grad {d_grad:.1e}, params after {STEPS} steps {d_param:.1e}"


def autocast_parity(name: str, device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """Loss and gradients under ``torch.autocast(dtype)`` against the unsharded model under the same autocast,
    relative to each tensor's scale; autocast's own error (that model against itself in fp32) beside it."""
    ref, args, kwargs = _build(name, device)
    ref32 = copy.deepcopy(ref)
    tpm = autotp.parallelize(copy.deepcopy(ref), example_inputs=(args, kwargs))
    with torch.autocast(device.type, dtype=dtype):
        loss = loss_and_logits(tpm(*args, **kwargs))[0]
        rloss = loss_and_logits(ref(*args, **kwargs))[0]
    loss.backward()
    rloss.backward()
    loss_and_logits(ref32(*args, **kwargs))[0].backward()
    l_rel, g_rel = _rel(loss, rloss), _grads(tpm, ref, _rel)
    own = max(_rel(p.grad, q.grad) for p, q in zip(ref.parameters(), ref32.parameters()))
    return max(l_rel, g_rel), f"loss {l_rel:.1e}, grad {g_rel:.1e} (autocast's own grad error {own:.1e})"


def scaler_parity(name: str, device: torch.device) -> tuple[float, str]:
    """fp16 autocast with ``torch.amp.GradScaler``, 3 steps: the parameter updates against the unsharded
    model's (‖Δ update‖ / ‖update‖) and the same scale after each step."""
    ref, args, kwargs = _build(name, device)
    start = copy.deepcopy(ref)
    tpm = autotp.parallelize(copy.deepcopy(ref), example_inputs=(args, kwargs))
    models = {"tp": tpm, "ref": ref}
    scalers = {k: torch.amp.GradScaler(device.type, init_scale=2.0 ** 12) for k in models}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for k, m in models.items()}
    scales = {k: [] for k in models}
    for _ in range(STEPS):
        for k, m in models.items():
            opts[k].zero_grad()
            with torch.autocast(device.type, dtype=torch.float16):
                loss = loss_and_logits(m(*args, **kwargs))[0]
            scalers[k].scale(loss).backward()
            scalers[k].unscale_(opts[k])
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scalers[k].step(opts[k])
            scalers[k].update()
            scales[k].append(scalers[k].get_scale())
    rp, sp = dict(ref.named_parameters()), dict(start.named_parameters())
    num = den = 0.0
    for n, p in tpm.named_parameters():
        want = _local(rp[n] - sp[n], n, tpm).double()
        got = (p - _local(sp[n], n, tpm)).double()
        num += ((got - want) ** 2).sum().item()
        den += (want ** 2).sum().item()
    rel = (num / den) ** 0.5
    if scales["tp"] != scales["ref"]:
        return float("inf"), f"scales differ: {scales['tp']} vs {scales['ref']}"
    return rel, f"update ‖Δ‖/‖update‖ {rel:.1e}, scales {scales['tp']} as unsharded"


def decode_tokens(name: str, device: torch.device) -> tuple[float, str]:
    """Greedy ``generate`` with the KV cache: the number of tokens that differ from the unsharded model's."""
    ref, _, _ = _build(name, device)
    model = autotp.parallelize(copy.deepcopy(ref))
    prompt = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(3)).to(device)
    kw = dict(max_new_tokens=8, do_sample=False, use_cache=True, attention_mask=torch.ones_like(prompt),
              pad_token_id=0)
    got, want = model.generate(prompt, **kw), ref.generate(prompt, **kw)
    if got.shape != want.shape:
        return float("inf"), f"{tuple(got.shape)} tokens vs {tuple(want.shape)}"
    return float((got != want).sum().item()), f"{got.shape[1] - prompt.shape[1]} new tokens × {got.shape[0]} sequences"


def allreduce_curve(device: torch.device, max_bytes: int) -> list[dict]:
    """gloo's all-reduce of fp32 tensors on ``device``, 1 KiB up to ``max_bytes``: median of 5 after 2
    warm-ups; bus bandwidth 2(n−1)/n · bytes / time (n ranks)."""
    n, out, size = dist.get_world_size(), [], 1024
    while size <= max_bytes:
        x = torch.ones(size // 4, device=device)
        times = []
        for i in range(7):
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            _sync(device)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        out.append({"bytes": size, "seconds": t, "bus_GBps": 2 * (n - 1) / n * size / t / 1e9})
        size *= 8
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def exactness(device_name: str, compile_backend: str, curve_bytes: int, every_row: tuple[str, ...],
              only: tuple[str, ...] = ()) -> dict:
    """One rank of the tp-2 exactness job: every row for the models in ``every_row``, fp32 and decoding for
    the Llama, then the all-reduce curve. ``only``: the rows whose name holds one of these words."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    try:
        device = torch.device(device_name)
        settings = exact_settings()
        eps = {dt: torch.finfo(dt).eps for dt in (torch.bfloat16, torch.float16)}
        backend = {"backend": compile_backend}
        rows = []
        table = []
        for name in ("nanogpt", "llama"):
            table.append((f"{name} fp32", lambda name=name: fp32_parity(name, device), FP32_BOUND))
            if name not in every_row:
                continue
            table += [
                (f"{name} bf16 autocast", lambda name=name: autocast_parity(name, device, torch.bfloat16),
                 4 * eps[torch.bfloat16]),
                (f"{name} fp16 autocast + GradScaler", lambda name=name: scaler_parity(name, device), 0.02),
                (f"{name} compile=True ({compile_backend})",
                 lambda name=name: fp32_parity(name, device, compile=backend), FP32_BOUND),
                (f"{name} torch.compile(model) ({compile_backend})",
                 lambda name=name: fp32_parity(name, device, user_compile=backend), FP32_BOUND),
            ]
        table.append(("llama KV-cache greedy decode: tokens differing", lambda: decode_tokens("llama", device), 0))
        for check, fn, bound in table:
            if not only or any(word in check for word in only):
                torch.manual_seed(0)
                rows.append(_row(check, fn, bound))
        curve = allreduce_curve(device, curve_bytes) if not only else []
        return {"rows": rows, "settings": settings, "allreduce": curve, "rank": dist.get_rank()}
    finally:
        dist.destroy_process_group()


def world_one() -> dict:
    """Launched by autotp's launcher at world 1 with the device left to it: the backend it chose, the mesh's
    device type, where a model built inside ``autotp.empty_weights()`` is placed once its weights load, and
    a training step there against the same model built the plain way."""
    import tempfile

    from safetensors.torch import save_file

    from autotp.distributed.launch import init_from_env
    from nanogpt import GPT, GPTConfig, example_batch

    ctx = init_from_env()
    torch.manual_seed(0)
    ref = GPT(GPTConfig())
    with autotp.empty_weights():
        model = GPT(GPTConfig())
    idx, targets = (t.to(ctx.device) for t in example_batch())
    tpm = autotp.parallelize(model, example_inputs=(idx, targets))
    with tempfile.TemporaryDirectory() as tmp:
        save_file({k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"},
                  f"{tmp}/model.safetensors")
        autotp.load_weights(tpm, tmp)
    ref.to(ctx.device)
    _, loss = tpm(idx, targets)
    loss.backward()
    _, rloss = ref(idx, targets)
    devices = sorted({str(p.device) for p in tpm.parameters()} | {str(p.grad.device) for p in tpm.parameters()})
    return {"backend": ctx.backend, "mesh_device": ctx.mesh.device_type, "devices": devices,
            "loss_diff": abs(loss.item() - rloss.item())}
