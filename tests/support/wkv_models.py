"""RWKV-4's time mixing in a small LM (width 64, vocab 96, sequence 12), and Hugging Face's RWKV built tiny.
Each block mixes the current and the previous token per channel (``x * mix + shift(x) * (1 - mix)``, ``mix``
``(h,)``; Hugging Face's ``(1, 1, h)``) into key, value and receptance projections, runs the WKV recurrence per channel (a Python loop
over time, with the decay ``-exp(time_decay)`` read at every step) and projects ``sigmoid(r) * wkv`` out.
Megatron's channel cut: key, value and receptance column-parallel, the recurrence on each rank's channels (the
decay and ``time_first`` cut with them), the output projection row-parallel; the mixing scales read the whole
input and stay whole. Every hand-written model is ``(idx, targets) -> (logits, loss)``.

- ``written``: the recurrence writes each step into ``out[:, t]`` of ``out = torch.zeros_like(k)`` (Hugging
  Face's CPU path);
- ``stacked``: the steps are collected in a list and ``torch.stack``-ed, the decay spelled
  ``self.decay.exp().neg()``;
- ``gated``: the ``written`` mixer with RWKV's feed-forward (its channel mixing) written as one expression,
  ``sigmoid(r(x)) * v(relu(k(x)) ** 2)``: key (h -> 4h) column-parallel, value (4h -> h) row-parallel, the
  receptance whole on every rank, its sigmoid gating the value's all-reduced output;
- ``shifted``: the ``stacked`` mixer with the feed-forward as a module that mixes the current and the previous
  token (``nn.ZeroPad2d`` time shift, ``(1, 1, h)`` scales) into the key's and the receptance's inputs, the gate
  multiplied on the right (``v * sigmoid(r)``);
- ``rwkv``: Hugging Face's RWKV (2 layers) on ``input_ids`` and ``labels``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, RMSNorm
from tiny_lm import TinyLM, hf_build, lm_build


class TimeMix(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        g = torch.Generator().manual_seed(3)
        self.decay = nn.Parameter(torch.randn(H, generator=g) * 0.5)
        self.first = nn.Parameter(torch.randn(H, generator=g) * 0.5)
        self.mix_k, self.mix_v, self.mix_r = (nn.Parameter(torch.rand(H, generator=g)) for _ in range(3))
        self.key, self.value, self.receptance = (nn.Linear(H, H, bias=False) for _ in range(3))
        self.output = nn.Linear(H, H, bias=False)

    def forward(self, x):
        shifted = F.pad(x, (0, 0, 1, -1))  # the previous token, zeros before the first
        k = self.key(x * self.mix_k + shifted * (1 - self.mix_k))
        v = self.value(x * self.mix_v + shifted * (1 - self.mix_v))
        r = torch.sigmoid(self.receptance(x * self.mix_r + shifted * (1 - self.mix_r)))
        w = -torch.exp(self.decay) if self.kind == "written" else self.decay.exp().neg()
        num, den = torch.zeros_like(k[:, 0]), torch.zeros_like(k[:, 0])
        top = torch.zeros_like(k[:, 0]) - 1e38
        out, steps = torch.zeros_like(k), []
        for t in range(k.shape[1]):
            kt, vt = k[:, t], v[:, t]
            m = torch.maximum(top, kt + self.first)
            e1, e2 = torch.exp(top - m), torch.exp(kt + self.first - m)
            y = (e1 * num + e2 * vt) / (e1 * den + e2)
            if self.kind == "written":
                out[:, t] = y
            else:
                steps.append(y)
            m = torch.maximum(top + w, kt)
            e1, e2 = torch.exp(top + w - m), torch.exp(kt - m)
            num, den, top = e1 * num + e2 * vt, e1 * den + e2, m
        if self.kind != "written":
            out = torch.stack(steps, dim=1)
        return self.output(r * out)


class ChannelMix(nn.Module):
    """RWKV's feed-forward: ``sigmoid(receptance) * value(relu(key) ** 2)``, with (``shifted``) or without the
    mix of the previous token into the key's and the receptance's inputs."""

    def __init__(self, shifted: bool):
        super().__init__()
        self.shifted = shifted
        self.key, self.value = nn.Linear(H, 4 * H, bias=False), nn.Linear(4 * H, H, bias=False)
        self.receptance = nn.Linear(H, H, bias=False)
        if shifted:
            self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))  # (b, s, h): the previous token, zeros before the first
            g = torch.Generator().manual_seed(4)
            self.mix_k, self.mix_r = (nn.Parameter(torch.rand(1, 1, H, generator=g)) for _ in range(2))

    def forward(self, x):
        if not self.shifted:
            return torch.sigmoid(self.receptance(x)) * self.value(torch.relu(self.key(x)) ** 2)
        shifted = self.time_shift(x)
        k = x * self.mix_k + shifted * (1 - self.mix_k)
        r = x * self.mix_r + shifted * (1 - self.mix_r)
        return self.value(torch.square(torch.relu(self.key(k)))) * torch.sigmoid(self.receptance(r))


# the feed-forward spellings, each over one of the mixers
_FFN_MIXER = {"gated": "written", "shifted": "stacked"}


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.n1, self.n2 = RMSNorm(H), RMSNorm(H)
        self.mix = TimeMix(_FFN_MIXER.get(kind, kind))
        if kind in _FFN_MIXER:
            self.ffn = ChannelMix(kind == "shifted")
        else:
            self.fc1, self.fc2 = nn.Linear(H, 4 * H, bias=False), nn.Linear(4 * H, H, bias=False)

    def forward(self, x):
        x = x + self.mix(self.n1(x))
        if hasattr(self, "ffn"):
            return x + self.ffn(self.n2(x))
        return x + self.fc2(torch.square(torch.relu(self.fc1(self.n2(x)))))


def _lm(kind: str) -> TinyLM:
    """Two blocks of the time mix then the channel mix."""
    return TinyLM(lambda: Block(kind))


KINDS = ("written", "stacked", "gated", "shifted", "rwkv")


def _rwkv():
    from transformers import RwkvConfig

    cfg = RwkvConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, attention_hidden_size=64,
                     intermediate_size=128, context_length=64, use_cache=False, bos_token_id=0, eos_token_id=0)
    return hf_build(cfg)


def build(kind: str):
    if kind == "rwkv":
        return _rwkv()
    return lm_build(lambda: _lm(kind))
