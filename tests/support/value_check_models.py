"""Small GPTs whose forward branches on the real value of its own state, in the spellings public model files
use: a rotary table (buffers in each attention) re-initialised when its first entry is zero
(``if self.freqs_cos[0, 0] == 0: self._init_rope()``), the same read with ``.item()``, a flag buffer
(``if not bool(self.initialized)``) set in place by the forward, and a plain tensor attribute read with
``.sum() > 0`` that the forward sets after its first call.
Every model is ``(idx, targets=None) -> (logits, loss)`` with 2 blocks, width 32, 4 heads."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

V, H, NH, S = 64, 32, 4, 8
HD = H // NH


def _angles(n: int) -> torch.Tensor:
    freqs = 1.0 / (10000.0 ** (torch.arange(0, HD, 2).float() / HD))
    return torch.outer(torch.arange(n).float(), freqs).repeat(1, 2)  # (n, HD)


class Attention(nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.style = style
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(H, H, bias=False) for _ in range(4))
        # zeros until the first forward fills them (a checkpoint loaded without them leaves them so too)
        self.register_buffer("freqs_cos", torch.zeros(S, HD), persistent=False)
        self.register_buffer("freqs_sin", torch.zeros(S, HD), persistent=False)
        self.register_buffer("initialized", torch.tensor(False), persistent=False)

    def _init_rope(self) -> None:
        ang = _angles(S).to(self.freqs_cos.device)
        if self.style == "zero_check":  # filled in place
            self.freqs_cos.copy_(ang.cos())
            self.freqs_sin.copy_(ang.sin())
        else:  # re-registered
            self.freqs_cos, self.freqs_sin = ang.cos(), ang.sin()

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        cos, sin = self.freqs_cos[:n, None, :], self.freqs_sin[:n, None, :]
        a, b = x.chunk(2, -1)
        return x * cos + torch.cat((-b, a), -1) * sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "zero_check":
            if self.freqs_cos[0, 0] == 0:
                self._init_rope()
        elif self.style == "item_check":
            if self.freqs_cos[0, 0].item() == 0.0:
                self._init_rope()
        elif self.style == "flag":
            if not bool(self.initialized):
                self._init_rope()
                self.initialized.fill_(True)
        b, n, _ = x.shape
        q, k, v = (w(x).view(b, n, NH, HD) for w in (self.wq, self.wk, self.wv))
        q, k = self._rope(q), self._rope(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1) / math.sqrt(HD)).masked_fill(
            ~torch.ones(n, n, dtype=torch.bool, device=x.device).tril(), float("-inf"))
        return self.wo((F.softmax(att, -1) @ v).transpose(1, 2).reshape(b, n, H))


class Block(nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.attn = Attention(style)
        self.up, self.down = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class GPT(nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.style = style
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList([Block(style) for _ in range(2)])
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)
        self.step_buf = torch.zeros(1)  # a plain tensor attribute: ones once called
        if style == "step_sum":
            for blk in self.blocks:  # this spelling's tables are filled at construction
                blk.attn._init_rope()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.emb(idx)
        if self.style == "step_sum":
            if self.step_buf.sum() > 0:  # after the first call: the embeddings scaled
                x = x * 0.5
            self.step_buf = torch.ones(1)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, V), targets.view(-1))
        return logits, loss


STYLES = ["zero_check", "item_check", "flag", "step_sum"]


def build(style: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(style)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (2, S), generator=g)
    return model, (x, torch.randint(0, V, (2, S), generator=g))
