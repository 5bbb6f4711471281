"""Sampling loops that feed a model's own tokens back, run inside each gloo rank of tests/runtime/test_sampling.py.

Two model spellings whose causal mask is a registered buffer sliced to the sequence, as nanoGPT's
non-flash path (``bias[:, :, :T, :T]`` of a (1, 1, block, block) buffer) and the "GPT from scratch"
lecture script (``tril[:T, :T]``) write it, next to nanoGPT's flash spelling (tests/scripts). Export tells
``T == block_size`` (the whole buffer) from shorter sequences, so a loop whose context grows to block_size
meets a size the first graph of its call signature is guarded against. Each loop runs on the unsharded
model and on the parallelized copy from the same seed and returns both token lists.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import autotp

BLOCK = 8  # small, so that contexts reach it and get cropped


@dataclass
class MaskConfig:
    block_size: int = BLOCK
    vocab_size: int = 96
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32


# -- nanoGPT's non-flash spelling: (1, 1, block, block) mask buffer, logits of the last position ------
class MaskedAttention(nn.Module):
    def __init__(self, config: MaskConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                             .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MaskedBlock(nn.Module):
    def __init__(self, config: MaskConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = MaskedAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class MaskedGPT(nn.Module):
    def __init__(self, config: MaskConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([MaskedBlock(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


# -- the lecture script's spelling: per-head modules, (block, block) tril buffer, full logits ----------
class Head(nn.Module):
    def __init__(self, n_embd: int, head_size: int, block_size: int):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))

    def forward(self, x):
        B, T, C = x.shape
        k, q = self.key(x), self.query(x)  # (B, T, hs)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5  # (B, T, T)
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        return F.softmax(wei, dim=-1) @ self.value(x)


class MultiHeadAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int):
        super().__init__()
        self.heads = nn.ModuleList([Head(n_embd, n_embd // n_head, block_size) for _ in range(n_head)])
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


class LectureBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int):
        super().__init__()
        self.sa = MultiHeadAttention(n_embd, n_head, block_size)
        self.ffwd = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.ReLU(), nn.Linear(4 * n_embd, n_embd))
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)

    def forward(self, x):
        x = x + self.sa(self.ln1(x))
        return x + self.ffwd(self.ln2(x))


class LectureGPT(nn.Module):
    def __init__(self, vocab_size: int = 65, n_embd: int = 32, n_head: int = 4, n_layer: int = 2,
                 block_size: int = BLOCK):
        super().__init__()
        self.block_size = block_size
        self.token_embedding_table = nn.Embedding(vocab_size, n_embd)
        self.position_embedding_table = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[LectureBlock(n_embd, n_head, block_size) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        tok_emb = self.token_embedding_table(idx)  # (B, T, C)
        pos_emb = self.position_embedding_table(torch.arange(T, device=idx.device))  # (T, C)
        x = self.ln_f(self.blocks(tok_emb + pos_emb))
        logits = self.lm_head(x)  # (B, T, vocab): every position
        if targets is None:
            loss = None
        else:
            B, T, C = logits.shape
            logits = logits.view(B * T, C)
            targets = targets.view(B * T)
            loss = F.cross_entropy(logits, targets)
        return logits, loss

    def generate(self, idx, max_new_tokens):  # no torch.no_grad: the lecture's loop runs with autograd on
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.block_size:]
            logits, loss = self(idx_cond)
            logits = logits[:, -1, :]
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


def _nanogpt_flash() -> nn.Module:
    from nanogpt_model import GPT, GPTConfig  # tests/scripts: scaled_dot_product_attention, no mask buffer

    return GPT(GPTConfig(block_size=BLOCK, vocab_size=128, n_layer=2, n_head=4, n_embd=32))


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "masked": lambda: MaskedGPT(MaskConfig()),
    "lecture": LectureGPT,
    "flash": _nanogpt_flash,
}


# -- loops written outside the model ------------------------------------------------------------------
def _call(model: nn.Module, idx: torch.Tensor, call: str) -> torch.Tensor:
    if call == "none":
        logits, _ = model(idx, None)
    elif call == "keyword":
        logits, _ = model(idx=idx)
    else:
        logits, _ = model(idx)
    return logits


def sample_loop(model: nn.Module, idx: torch.Tensor, steps: int, *, temperature: float = 1.0,
                top_k: int | None = None, crop: bool = True, call: str = "positional") -> torch.Tensor:
    """Temperature and top-k sampling; ``crop=False`` lets the context grow (to block_size at most)."""
    for _ in range(steps):
        idx_cond = idx[:, -BLOCK:] if crop else idx
        logits = _call(model, idx_cond, call)[:, -1, :] / temperature  # (B, vocab)
        if top_k is not None:
            v, _ = torch.topk(logits, top_k)
            logits[logits < v[:, [-1]]] = -float("inf")
        idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
        idx = torch.cat((idx, idx_next), dim=1)
    return idx


@dataclass(frozen=True)
class Case:
    model: str
    batch: int
    prompt: int
    steps: int
    mode: str = "eval"  # or "train"
    grad: bool = False  # run the loop with autograd on
    own: bool = False  # the model's own generate()
    temperature: float = 1.0
    top_k: int | None = None
    crop: bool = True
    call: str = "positional"
    train_first: bool = False  # a training forward with targets before sampling


# every growing loop ends on a context of exactly BLOCK; every cropped loop crosses it
CASES: dict[str, Case] = {
    "masked/own/temperature/b1/p1": Case("masked", 1, 1, 12, own=True, temperature=0.8),
    "masked/own/top_k/b2/p3": Case("masked", 2, 3, 10, own=True, top_k=5),
    "masked/own/train/b2/p5": Case("masked", 2, 5, 7, mode="train", own=True, temperature=1.3),
    "masked/grow/none/grad/train/b1/p3": Case("masked", 1, 3, BLOCK - 2, mode="train", grad=True, crop=False,
                                              call="none"),
    "masked/top_k/b2/p1": Case("masked", 2, 1, 11, top_k=4, temperature=0.7),
    "lecture/own/grad/train/b1/p1": Case("lecture", 1, 1, 12, mode="train", grad=True, own=True),
    "lecture/own/b2/p5": Case("lecture", 2, 5, 6, own=True),
    "lecture/top_k/b2/p3": Case("lecture", 2, 3, 9, top_k=3, temperature=0.5),
    "lecture/grow/after_training/b2/p3": Case("lecture", 2, 3, BLOCK - 2, mode="train", grad=True, crop=False,
                                              train_first=True),
    "flash/own/temperature/b1/p5": Case("flash", 1, 5, 8, own=True, temperature=0.8),
    "flash/own/top_k/train/b2/p1": Case("flash", 2, 1, 10, mode="train", own=True, top_k=6),
    "flash/grow/keyword/b2/p3": Case("flash", 2, 3, BLOCK - 2, crop=False, call="keyword"),
}


def _run(model: nn.Module, case: Case, idx: torch.Tensor, seed: int) -> torch.Tensor:
    getattr(model, case.mode)()
    if case.train_first:
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randint(0, 60, (2, BLOCK), generator=g)
        _, loss = model(x, torch.randint(0, 60, (2, BLOCK), generator=g))
        loss.backward()  # gradients only: the weights stay those of the reference
    torch.manual_seed(seed)
    with torch.set_grad_enabled(case.grad):
        if case.own and case.model == "lecture":
            return model.generate(idx, case.steps)
        if case.own:
            return model.generate(idx, case.steps, temperature=case.temperature, top_k=case.top_k)
        return sample_loop(model, idx, case.steps, temperature=case.temperature, top_k=case.top_k,
                           crop=case.crop, call=case.call)


def sampling_loops(names: list[str]) -> dict:
    """Each case's tokens from the unsharded model and from its parallelized copy (one per model, reused
    by every case, as a script would), the same seed before each loop; and per model how many graphs were
    captured for a signature whose first graph rejected a size (``(key, "guards", n)``)."""
    # one thread per rank, as `autotp run` gives gloo ranks: these models are tiny, and ranks whose thread
    # pools outnumber the cores spend most of a step waiting (282 s against 42 s for the tp 2 set on 2 cores)
    torch.set_num_threads(1)
    refs: dict[str, nn.Module] = {}
    tps: dict[str, nn.Module] = {}
    out: dict = {"cases": {}, "guarded": {}, "tp": None}
    for i, name in enumerate(names):
        case = CASES[name]
        if case.model not in refs:
            torch.manual_seed(0)
            refs[case.model] = BUILDERS[case.model]()
            tps[case.model] = autotp.parallelize(copy.deepcopy(refs[case.model]))
        idx = torch.randint(0, 60, (case.batch, case.prompt), generator=torch.Generator().manual_seed(100 + i))
        ref = _run(refs[case.model], case, idx, 1000 + i)
        got = _run(tps[case.model], case, idx, 1000 + i)
        assert not isinstance(got, autotp.GatheredOnUse)
        out["cases"][name] = {"ref": ref.tolist(), "tp": got.tolist()}
    for model_name, tpm in tps.items():
        st = autotp.tp_state(tpm)
        out["tp"] = st.tp
        out["guarded"][model_name] = sum(1 for k in st.graphs if isinstance(k, tuple) and k[1:2] == ("guards",))
    return out
