"""Rank functions of tests/capture/test_call_matrix.py: how training scripts really call a model, each call sequence run
on a parallelized model and on the unsharded one, every loss and every generated token compared.

A case is ``model:example:sequence:mode``:
- model: ``nanogpt`` (tests/scripts/nanogpt_model.py, nanoGPT's own file) or ``llama`` (Hugging Face, from a config);
- example: what ``example_inputs`` parallelize gets: ``none``, ``tuple`` (positional), ``argskw``
  (``(args, kwargs)``) or ``dict`` (keyword);
- sequence: the calls, in order (see :data:`SEQUENCES`);
- mode: ``eager``, ``compile`` (``parallelize(compile=...)``) or ``user`` (the user's own
  ``torch.compile(model)`` after parallelize, every call through it). Both compile with aot_eager: dynamo and
  AOTAutograd over autotp's graphs, which is where a call sequence can break (guards, recompiles, graph breaks);
  Inductor's code generation is tests/runtime/test_compile.py's (a cold C++ build per graph costs seconds on 2 cores).
"""
from __future__ import annotations

import sys

import torch

import autotp
from parity_workers import _local, _max_diff

V, S = 1003, 16
_AOT = {"backend": "aot_eager"}


def _nanogpt():
    from nanogpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=64, vocab_size=V, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=True))


def _llama():
    from small_models import llama

    return llama()[0]


def _batches(n: int, b: int = 4, s: int = S, vocab: int = V, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (b, s), generator=g), torch.randint(0, vocab, (b, s), generator=g))
            for _ in range(n)]


class Run:
    """One model's side of a case: every loss and every token it produced, in order."""

    def __init__(self, model: torch.nn.Module, call: torch.nn.Module, llama: bool):
        self.model, self.call, self.llama = model, call, llama
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
        self.losses: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.llama:
            return self.call(input_ids=x, labels=y, use_cache=False).loss
        return self.call(x, y)[1]

    def train(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = self.loss(x, y)
        self.losses.append(loss.detach())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def evaluate(self, x: torch.Tensor, y: torch.Tensor, inference: bool = False) -> None:
        self.model.eval()
        with torch.inference_mode() if inference else torch.no_grad():
            self.losses.append(self.loss(x, y).clone())
        self.model.train()

    def generate(self, prompt: torch.Tensor, steps: int, use_cache: bool = True) -> None:
        self.model.eval()
        if self.llama:
            out = self.model.generate(prompt, max_new_tokens=steps, do_sample=False, use_cache=use_cache,
                                      attention_mask=torch.ones_like(prompt), pad_token_id=0)
        else:
            out = self.model.generate(prompt, steps, top_k=1)  # nanoGPT's own loop, greedy
        self.tokens.append(out)
        self.model.train()


def _train_eval_generate_train(r: Run, vocab: int) -> None:
    b = _batches(3, vocab=vocab)
    r.train(*b[0])
    r.train(*b[1])
    r.evaluate(*b[2])
    r.generate(b[2][0][:2, :4], 3)  # targets=None: another call signature
    r.train(*b[2])


def _generate_first(r: Run, vocab: int) -> None:
    b = _batches(2, vocab=vocab)
    r.generate(b[0][0][:2, :5], 3)
    r.train(*b[0])
    r.train(*b[1])


def _shapes(r: Run, vocab: int) -> None:
    """Batch and length change from call to call; an inference-mode evaluation; a sampling loop after."""
    r.train(*_batches(1, 4, 16, vocab)[0])
    r.train(*_batches(1, 2, 8, vocab, seed=6)[0])
    r.train(*_batches(1, 3, 12, vocab, seed=7)[0])
    r.evaluate(*_batches(1, 1, 5, vocab, seed=8)[0], inference=True)
    r.generate(_batches(1, 1, 3, vocab, seed=9)[0][0], 4)


def _hf_cache(r: Run, vocab: int) -> None:
    """Hugging Face ``generate`` with its KV cache and without, between training steps."""
    b = _batches(2, vocab=vocab)
    r.train(*b[0])
    r.generate(b[1][0][:2, :5], 4, use_cache=True)
    r.generate(b[1][0][:2, :5], 4, use_cache=False)
    r.train(*b[1])


SEQUENCES = {"train_eval_generate_train": _train_eval_generate_train, "generate_first": _generate_first,
             "shapes": _shapes, "hf_cache": _hf_cache}


def _example(kind: str, llama: bool) -> object:
    x, y = _batches(1)[0] if not llama else _batches(1, vocab=128)[0]
    if llama:
        kw = {"input_ids": x, "labels": y, "use_cache": False}
        return {"none": None, "dict": kw, "argskw": ((), kw)}[kind]
    return {"none": None, "tuple": (x, y), "argskw": ((x, y), {}), "dict": {"idx": x, "targets": y}}[kind]


def call_case(case: str) -> dict:
    model_name, example, sequence, mode = case.split(":")
    llama = model_name == "llama"
    build = _llama if llama else _nanogpt
    vocab = 128 if llama else V
    ref, model = build(), build()
    model = autotp.parallelize(model, example_inputs=_example(example, llama), compile=mode == "compile" and _AOT)
    call = torch.compile(model, **_AOT) if mode == "user" else model
    got, want = Run(model, call, llama), Run(ref, ref, llama)
    for r in (got, want):
        torch.manual_seed(11)
        SEQUENCES[sequence](r, vocab)
    rparams = dict(ref.named_parameters())
    return {
        "losses": len(want.losses),
        "loss_diff": max(_max_diff(a, b) for a, b in zip(got.losses, want.losses)),
        "param_diff": max(_max_diff(p, _local(rparams[n], n, model)) for n, p in model.named_parameters()),
        "same_tokens": len(got.tokens) == len(want.tokens) and all(
            torch.equal(a, b) for a, b in zip(got.tokens, want.tokens)),
        "generated": [t.shape[1] for t in want.tokens],
        "graphs": len(autotp.tp_state(model).graphs),
    }


def call_matrix(cases: list[str]) -> dict:
    import warnings

    out = {}
    for case in cases:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out[case] = call_case(case)
        # what a user would see: autotp's own warnings and dynamo's graph-break warnings
        out[case]["warnings"] = sorted({str(w.message).splitlines()[0][:200] for w in seen
                                        if "autotp" in str(w.message) or "graph break" in str(w.message).lower()
                                        or "Dynamo" in str(w.message)})
        out[case]["compiled_graphs"] = 0
        if "torch._dynamo" in sys.modules:
            from torch._dynamo.utils import counters

            out[case]["compiled_graphs"] = counters["stats"]["unique_graphs"]
            counters.clear()
            torch._dynamo.reset()
    return out
