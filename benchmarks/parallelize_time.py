"""Wall time of ``autotp.parallelize`` (capture + plan + rewrite + slicing) for a 24-layer GPT, tp 2.

    python benchmarks/parallelize_time.py [--layers 24] [--out benchmarks/results/parallelize_time.json]

Two gloo ranks on this machine; each rank times ``parallelize`` of its own model and the first training
call; the report is rank 0's (median of ``--repeat`` runs in fresh processes would be better on a quiet
machine; the number moves with machine load).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "examples"), os.path.join(HERE, "..", "tests", "support")]


def worker(layers: int) -> dict:
    import torch

    import autotp
    from nanogpt import GPT, GPTConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=layers, n_embd=256, n_head=8, vocab_size=8192, block_size=128))
    idx = torch.randint(0, 8192, (4, 128))
    t0 = time.perf_counter()
    model = autotp.parallelize(model, example_inputs=(idx, idx))
    t1 = time.perf_counter()
    _, loss = model(idx, idx)
    loss.backward()
    t2 = time.perf_counter()
    return {"layers": layers, "parallelize_s": t1 - t0, "first_step_s": t2 - t1}


def main() -> None:
    from ranks import launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    r = launch(worker, 2, a.layers)[0]
    print(json.dumps(r))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
