"""A training script written for one device (nanoGPT's train.py, cut down)."""
import json
import sys
import time

import torch

from nanogpt_model import GPT, GPTConfig

torch.manual_seed(1337)
config = GPTConfig()
model = GPT(config)
data = torch.randint(0, config.vocab_size, (4096,), generator=torch.Generator().manual_seed(0))


def get_batch(batch_size=4):
    ix = torch.randint(len(data) - config.block_size, (batch_size,))
    x = torch.stack([data[i:i + config.block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + config.block_size] for i in ix])
    return x, y


X, Y = get_batch()
optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
losses = []
for it in range(5):
    t0 = time.time()
    logits, loss = model(X, Y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    losses.append(loss.item())
    mfu = model.estimate_mfu(4, time.time() - t0)
    X, Y = get_batch()
model.eval()
sample = model.generate(torch.zeros((1, 1), dtype=torch.long), max_new_tokens=12, temperature=0.8, top_k=20)
result = {"losses": losses, "sample": sample[0].tolist(), "block_size": model.config.block_size,
          "is_gpt": isinstance(model, GPT), "params": model.get_num_params(), "mfu": mfu > 0}
print("RESULT " + json.dumps(result), flush=True)
