"""nanoGPT trained with Lightning Fabric's ``ModelParallelStrategy``, autotp as its ``parallelize_fn``.

    python examples/fabric_train.py --tp 2                  # Fabric starts 2 CPU processes: tensor parallel
    python examples/fabric_train.py --tp 2 --dp 2           # 4: TP inside, FSDP2 across (Fabric's mesh)
    python examples/fabric_train.py --tp 2 --dp 2 --ddp     # ... DDP across instead
    python examples/fabric_train.py --unsharded --batch 8   # one process, Fabric's single-device strategy

The strategy builds a ("data_parallel", "tensor_parallel") device mesh and hands it, with the model, to
``parallelize_fn``; ``autotp.integrations.fabric_parallelize_fn()`` shards the model over the
"tensor_parallel" dim and, with more than one data-parallel rank, over "data_parallel" with FSDP2. Fabric's
own ``setup_dataloaders`` splits the data over the data-parallel ranks only. ``--batch`` is per replica.
Under ``autotp run`` (torchelastic's environment) Fabric uses the ranks already started instead.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from autotp.distributed.job import job_from_env
from autotp.integrations import fabric_parallelize_fn

try:  # the `lightning` package, or the smaller `lightning-fabric`
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
except ImportError:
    try:
        from lightning_fabric import Fabric
        from lightning_fabric.strategies import ModelParallelStrategy
    except ImportError as exc:
        need = f"{__file__} trains with Lightning Fabric: pip install 'autotp[lightning]'"
        if __name__ == "__main__":  # run as a script: one line, not a traceback
            sys.exit(f"error: {need}")
        raise ImportError(need) from exc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nanogpt import GPT, GPTConfig  # noqa: E402

parser = argparse.ArgumentParser()
_job = job_from_env()  # under `autotp run`: its sizes are the defaults
parser.add_argument("--tp", type=int, default=2 if _job is None else _job.grid.tp)
parser.add_argument("--dp", type=int, default=1 if _job is None else _job.grid.dp)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--batch", type=int, default=4, help="sequences per step per data-parallel replica")
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--ddp", action="store_true", help="DDP across the data-parallel ranks instead of FSDP2")
parser.add_argument("--unsharded", action="store_true", help="one process, no parallelize_fn")
parser.add_argument("--json", action="store_true")
args = parser.parse_args()

if args.unsharded:
    fabric = Fabric(accelerator="cpu", devices=1)
else:
    strategy = ModelParallelStrategy(parallelize_fn=fabric_parallelize_fn(fsdp=not args.ddp),
                                     data_parallel_size=args.dp, tensor_parallel_size=args.tp)
    fabric = Fabric(accelerator="cpu", devices=args.tp * args.dp, strategy=strategy)
fabric.launch()

config = GPTConfig()
torch.manual_seed(1337)  # the same initial weights on every rank
model = fabric.setup_module(GPT(config))  # ModelParallelStrategy calls parallelize_fn(model, device_mesh) here
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=args.lr))  # the shards

tokens = torch.randint(0, config.vocab_size, (64, config.block_size + 1), generator=torch.Generator().manual_seed(0))
# Fabric replaces the sampler by a DistributedSampler over the data-parallel ranks (seed 0); one process keeps
# this one, which draws the same first permutation
sampler = RandomSampler(range(len(tokens)), generator=torch.Generator().manual_seed(0))
loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(len(tokens))), batch_size=args.batch,
                                             sampler=sampler))

losses, norms, drawn = [], [], []
batches = iter(loader)
for step in range(args.steps):
    (ix,) = next(batches)
    x, y = tokens[ix, :-1], tokens[ix, 1:]
    _, loss = model(x, y)
    fabric.backward(loss)
    norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the full model's norm, as on one device
    optimizer.step()
    optimizer.zero_grad()
    loss = fabric.all_reduce(loss.detach(), reduce_op="mean")  # over every rank: the data-parallel mean
    losses.append(loss.item())
    norms.append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
    drawn += ix.tolist()
    if fabric.global_rank == 0 and not args.json:
        print(f"step {step + 1}: loss {losses[-1]:.6f} grad norm {norms[-1]:.6f}", flush=True)

if args.json:
    print("RESULT " + json.dumps({"rank": fabric.global_rank, "losses": losses, "grad_norms": norms,
                                  "drawn": drawn}), flush=True)
