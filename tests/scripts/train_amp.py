"""A training script written for one GPU, as nanoGPT's train.py writes it: the forward under
``ctx = torch.autocast(...)``, a GradScaler that is only enabled for float16, gradients unscaled and
clipped, then sampling with the model's own ``generate()`` under the same context. ``AMP_DTYPE`` picks
bfloat16 or float16 (on CPU here; the script reads the device from ``torch.cuda.is_available()``)."""
import json
import os

import torch

from nanogpt_model import GPT, GPTConfig

dtype = os.environ.get("AMP_DTYPE", "bfloat16")
device_type = "cuda" if torch.cuda.is_available() else "cpu"
ptdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = torch.autocast(device_type=device_type, dtype=ptdtype)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))

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
optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), device_type)
losses, scales = [], []
for it in range(5):
    with ctx:
        logits, loss = model(X, Y)
    X, Y = get_batch()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss.item())
    scales.append(scaler.get_scale())
model.eval()
with torch.no_grad(), ctx:
    sample = model.generate(torch.zeros((1, 1), dtype=torch.long), max_new_tokens=12, temperature=0.8, top_k=20)
result = {"losses": losses, "scales": scales, "sample": sample[0].tolist()}
print("RESULT " + json.dumps(result), flush=True)
