"""A Hugging Face Llama trained by ``transformers.Trainer``, sharded by autotp.

    autotp run examples/hf_trainer.py --tp 2                 # 2 ranks, tensor parallel
    autotp run examples/hf_trainer.py --tp 2 --dp 2          # 4 ranks: TP inside, DDP across
    autotp run examples/hf_trainer.py --tp 2 --dp 2 --fsdp   # ... FSDP2 across instead of DDP
    python examples/hf_trainer.py --unsharded --batch 8      # plain Trainer, one process: the same losses

``autotp.integrations.Trainer`` is ``transformers.Trainer`` with what tensor parallelism needs: each
data-parallel replica draws its own batches and the ranks of one tensor-parallel group the same ones
(Trainer alone splits the data over every rank), and gradients are averaged over the data-parallel group
only (Trainer alone wraps the model in DDP over every rank). ``--batch`` is per replica, so the unsharded
run with ``--batch`` = dp × batch takes the same samples per step. ``--json`` prints each rank's losses,
gradient norms and the dataset indices it drew, for the tests.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
try:
    from transformers import Trainer, TrainingArguments
except ImportError as exc:
    need = (f"{__file__} trains with Hugging Face's Trainer and needs transformers and accelerate: "
            "pip install 'autotp[hf]'")
    if __name__ == "__main__":  # run as a script: one line, not a traceback
        sys.exit(f"error: {need}")
    raise ImportError(need) from exc

import autotp
from autotp.integrations import Trainer as TPTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama import build_model  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--batch", type=int, default=4, help="sequences per step per data-parallel replica")
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--unsharded", action="store_true", help="plain transformers.Trainer on one process")
parser.add_argument("--save", metavar="DIR", help="save the trained model (the full, unsharded one) here")
parser.add_argument("--json", action="store_true")
args = parser.parse_args()


class Tokens(Dataset):
    """Random token sequences; remembers which indices this process drew."""

    def __init__(self, n: int = 64, seq: int = 32, vocab: int = 256):
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))
        self.drawn: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        self.drawn.append(int(i))
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


model = build_model()  # the same initial weights on every rank
if not args.unsharded:
    model = autotp.parallelize(model)  # under `autotp run`: the layout's tp group (and FSDP2 with --fsdp)
device = next(model.parameters()).device
scratch = tempfile.TemporaryDirectory()  # Trainer makes its output_dir; nothing is written there (save_strategy="no")
training = TrainingArguments(
    output_dir=scratch.name, max_steps=args.steps, per_device_train_batch_size=args.batch,
    learning_rate=args.lr, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
    seed=0, data_seed=0, use_cpu=device.type == "cpu")
data = Tokens()
trainer = (Trainer if args.unsharded else TPTrainer)(model=model, args=training, train_dataset=data)
trainer.train()
if args.save:
    trainer.save_model(args.save)  # with autotp: every rank gathers, rank 0 writes

steps = [h for h in trainer.state.log_history if "loss" in h]
rank = dist.get_rank() if dist.is_initialized() else 0
if args.json:
    print("RESULT " + json.dumps({"rank": rank, "dp_rank": autotp.dp_rank(),
                                  "losses": [h["loss"] for h in steps],
                                  "grad_norms": [h["grad_norm"] for h in steps],
                                  "batch": args.batch, "drawn": data.drawn}), flush=True)
elif rank == 0:
    for h in steps:
        print(f"step {h['step']}: loss {h['loss']:.6f} grad norm {h['grad_norm']:.6f}", flush=True)
