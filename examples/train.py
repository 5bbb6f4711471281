"""A training script written for one device, plus the one line that shards it.

    autotp run examples/train.py --tp 2 -- --steps 5              # 2 ranks, tensor parallel
    autotp run examples/train.py --tp 2 --dp 2 --fsdp -- --lr 3e-4 # 4 ranks: TP inside, FSDP2 across

Under ``autotp run`` the process group and the rank grid are already set up; ``autotp.parallelize`` reads
them (with ``--fsdp`` it also shards over the data-parallel ranks). Each data-parallel replica draws its own
batches; the ranks of one tensor-parallel group draw the same ones.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import autotp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nanogpt import GPT, GPTConfig  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--batch", type=int, default=4)
args = parser.parse_args()

torch.manual_seed(1337)  # the same initial weights on every rank
config = GPTConfig()
model = GPT(config)
model = autotp.parallelize(model)  # the one added line
optimizer = model.configure_optimizers(0.1, args.lr, (0.9, 0.95), "cuda" if torch.cuda.is_available() else "cpu")

data = torch.randint(0, config.vocab_size, (8192,), generator=torch.Generator().manual_seed(0))
draw = torch.Generator().manual_seed(autotp.dp_rank())  # one stream per data-parallel replica


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - config.block_size, (args.batch,), generator=draw)
    x = torch.stack([data[i:i + config.block_size] for i in ix])  # (b, s)
    y = torch.stack([data[i + 1:i + 1 + config.block_size] for i in ix])
    return x, y


for step in range(args.steps):
    x, y = get_batch()
    _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    if torch.distributed.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f} grad norm {norm.item():.3f}", flush=True)
