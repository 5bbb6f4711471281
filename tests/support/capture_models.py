"""Small GPTs written in the styles that break a deep-copy capture: each one exports only from the real
object. Every model is ``(idx, targets) -> (logits, loss)`` with 2 layers, width 64, 4 heads."""
from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

V, H, NH, S = 96, 64, 4, 16
HD = H // NH

# a module-level tensor, read by the forward of every block (not a buffer, not an attribute)
CAUSAL = torch.tril(torch.ones(S, S, dtype=torch.bool))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, mask: str):
        super().__init__()
        self.c_attn = nn.Linear(H, 3 * H)
        self.c_proj = nn.Linear(H, H)
        self.mask = mask
        if mask == "attribute":
            # a plain tensor attribute, as many public models keep their rotary tables and masks
            self.bias = torch.tril(torch.ones(S, S)).view(1, 1, S, S)
            inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
            freqs = torch.outer(torch.arange(S).float(), inv)
            self.cos, self.sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.c_attn(x).split(H, dim=2)
        q, k, v = (t.view(b, s, NH, HD).transpose(1, 2) for t in (q, k, v))  # (b, nh, s, hd)
        if self.mask == "attribute":
            cos, sin = self.cos[:s], self.sin[:s]
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HD))
        if self.mask == "attribute":
            att = att.masked_fill(self.bias[:, :, :s, :s] == 0, float("-inf"))
        else:
            att = att.masked_fill(~CAUSAL[:s, :s], float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, H))


class Block(nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.attn = Attention("attribute" if style == "attribute" else "global")
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(H, 4 * H), act=nn.GELU(), c_proj=nn.Linear(4 * H, H),
                                      dropout=nn.Dropout(0.0)))
        m = self.mlp
        # minGPT's spelling: a lambda closing over the submodules
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))
        self.style = style
        if style == "buffer_write":
            self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.long))
            self.register_buffer("act_mean", torch.zeros(H))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        if self.style == "buffer_write":
            # statistics written in forward, as running-stat and counter buffers are
            self.tokens_seen += x.shape[0] * x.shape[1]
            self.act_mean.mul_(0.9).add_(0.1 * x.detach().mean(dim=(0, 1)))
        return x + self.mlpf(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, style: str = "lambda"):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, H), nn.Embedding(S, H)
        self.h = nn.ModuleList([Block(style) for _ in range(2)])
        self.ln_f = nn.LayerNorm(H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.wte.weight = self.lm_head.weight
        if style == "partial":
            # a forward bound at construction: functools.partial of another method
            self.forward = functools.partial(self.run, temperature=1.0)
        if style == "hooks":
            self.seen: list[tuple[int, ...]] = []
            self.register_forward_pre_hook(lambda mod, args: (args[0] % V, *args[1:]))
            self.register_forward_hook(lambda mod, args, out: (out[0], out[1] * 2.0))
            self.h[0].register_forward_hook(lambda mod, args, out: out * 0.5)
            self.h[1].register_forward_pre_hook(lambda mod, args: self.seen.append(tuple(args[0].shape)))

    def run(self, idx, targets, temperature: float = 1.0):
        b, s = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(s, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x)) / temperature
        return logits, F.cross_entropy(logits.view(-1, V), targets.view(-1))

    def forward(self, idx, targets):
        return self.run(idx, targets)


class BoundForward(GPT):
    """The forward is another object's bound method, set on the instance."""

    def __init__(self):
        super().__init__("lambda")
        self.forward = self.run


STYLES = {
    "lambda": lambda: GPT("lambda"),
    "attribute": lambda: GPT("attribute"),
    "global": lambda: GPT("global"),
    "hooks": lambda: GPT("hooks"),
    "partial": lambda: GPT("partial"),
    "bound": BoundForward,
    "buffer_write": lambda: GPT("buffer_write"),
}


def build(style: str) -> tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    model = STYLES[style]()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (2, S), generator=g)
    return model, (idx, torch.randint(0, V, (2, S), generator=g)), {}
