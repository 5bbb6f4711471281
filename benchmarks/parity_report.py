"""Parity, collectives and parallelize() time per model and tp (gloo on CPU), as a markdown table.

    python benchmarks/parity_report.py            # writes benchmarks/results/parity.{json,md}

For each model and tp: max |Δ| of loss, logits (as the user reads them), gradients (each rank's against
its slice of the reference) and parameters after 3 AdamW steps; collectives of one training step counted
in forward and backward; and the wall time of ``autotp.parallelize`` (capture + plan + rewrite + slicing).
Also per-rank parameter bytes of a GPT-2-small-shaped model (meta device) at tp 1/2/4.
"""
from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "support"), os.path.join(HERE, "..", "examples")]


def worker(name: str) -> dict:
    import copy

    import torch

    import autotp
    from ranks import CollectiveLog
    from small_models import MODELS, loss_and_logits
    from parity_workers import _local, _max_diff

    ref, args, kwargs = MODELS[name]()
    model = copy.deepcopy(ref)
    t0 = time.perf_counter()
    tpm = autotp.parallelize(model, example_inputs=(args, kwargs))
    seconds = time.perf_counter() - t0
    log = CollectiveLog()
    with log:
        raw = tpm(*args, **kwargs)
    n_fwd = len(log.calls)
    loss, logits = loss_and_logits(raw)
    with log:
        loss.backward()
    rloss, rlogits = loss_and_logits(ref(*args, **kwargs))
    rloss.backward()
    rp = dict(ref.named_parameters())
    out = {
        "parallelize_s": seconds, "loss": _max_diff(loss, rloss), "logits": _max_diff(logits, rlogits),
        "grad": max(_max_diff(p.grad, _local(rp[n].grad, n, tpm)) for n, p in tpm.named_parameters()),
        "fwd": log.calls[:n_fwd], "bwd": log.calls[n_fwd:],
    }
    opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (tpm, ref))
    for _ in range(3):
        for o, m in ((opt, tpm), (ropt, ref)):
            o.zero_grad()
            loss_and_logits(m(*args, **kwargs))[0].backward()
            o.step()
    out["param"] = max(_max_diff(p, _local(rp[n], n, tpm)) for n, p in tpm.named_parameters())
    return out


def gpt2_small_bytes() -> dict[int, int]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from autotp.capture.tracer import capture
    from autotp.plan.planner import make_plan
    from autotp.reports.sharding import build_report

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config())
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    gm = capture(model, (), {"input_ids": ids, "labels": ids, "use_cache": False})[0]
    out = {}
    for tp in (1, 2, 4):
        rep = build_report(make_plan(gm, tp), model.named_parameters(remove_duplicate=False), 8, 1024)
        out[tp] = sum(r.local_bytes for r in rep.params)
    return out


def _summary(calls: list) -> str:
    from collections import Counter

    c = Counter(f"{op}:{n}" for _, op, n in calls)
    return ", ".join(f"{k}×{v}" for k, v in sorted(c.items()))


def main() -> None:
    from ranks import launch

    rows = []
    for name in ("nanogpt", "gpt2", "gpt2_50257", "llama"):
        for tp in (1, 2, 4):
            r = max(launch(worker, tp, name).values(), key=lambda x: x["grad"])
            rows.append({"model": name, "tp": tp, **r})
            print(name, tp, {k: v for k, v in r.items() if k not in ("fwd", "bwd")}, flush=True)
    sizes = gpt2_small_bytes()
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "parity.json"), "w") as f:
        json.dump({"rows": rows, "gpt2_small_param_bytes_per_rank": sizes}, f, indent=1)
    lines = ["| model | tp | loss | logits | grads | params (3 AdamW) | fwd collectives (op:elements×n) | "
             "bwd collectives | parallelize() s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tp']} | {r['loss']:.1e} | {r['logits']:.1e} | {r['grad']:.1e} | "
                     f"{r['param']:.1e} | {_summary(r['fwd'])} | {_summary(r['bwd'])} | {r['parallelize_s']:.2f} |")
    lines += ["", "| GPT-2 small | tp 1 | tp 2 | tp 4 |", "|---|---|---|---|",
              "| parameter bytes per rank | " + " | ".join(f"{sizes[t] / 2**20:.1f} MiB" for t in (1, 2, 4)) + " |"]
    with open(os.path.join(HERE, "results", "parity.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
