"""Small GPTs whose forward keeps state on the model, in the spellings public model files use: buffers
registered or grown on first use, one rotary / ALiBi module shared by every block, a tied head that holds the
embedding module itself, plain tensor attributes beside a Python-side cache. Capture (meta runs, export)
must leave every one of them exactly as it was. Every model is ``(idx, targets=None) -> (logits, loss)``
with 3 blocks (so capture copies blocks), width 64, 4 heads."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

V, H, NH, S = 96, 64, 4, 16
HD = H // NH


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _inv_freq(device=None) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, HD, 2, device=device).float() / HD))


# -- rotary tables, four ways ----------------------------------------------------------------------------
class GrownRotary(nn.Module):
    """Buffers registered on first use and grown when a longer sequence comes (registered in forward)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", _inv_freq(), persistent=False)
        self.register_buffer("cos_cached", None, persistent=False)
        self.register_buffer("sin_cached", None, persistent=False)

    def forward(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos_cached is None or self.cos_cached.shape[0] < n:
            freqs = torch.outer(torch.arange(n, device=x.device, dtype=torch.float32), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos_cached, self.sin_cached = emb.cos(), emb.sin()  # still buffers: the names are registered
        return self.cos_cached[:n], self.sin_cached[:n]


class PlainCacheRotary(nn.Module):
    """GPT-NeoX's old spelling: ``inv_freq`` a plain tensor attribute (neither parameter nor buffer) and a
    Python-side cache (``seq_len_cached``, ``cos_cached``) written in forward."""

    def __init__(self):
        super().__init__()
        self.inv_freq = _inv_freq()
        self.seq_len_cached = 0
        self.cos_cached = self.sin_cached = None

    def forward(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n > self.seq_len_cached:
            self.seq_len_cached = n
            t = torch.arange(n, device=x.device).type_as(self.inv_freq)
            freqs = torch.einsum("i,j->ij", t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos_cached, self.sin_cached = emb.cos(), emb.sin()
        return self.cos_cached[:n], self.sin_cached[:n]


class TableRotary(nn.Module):
    """A plain buffer table, built in ``__init__`` (used shared by every block)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("theta", _inv_freq())
        freqs = torch.outer(torch.arange(S).float(), self.theta)
        self.register_buffer("cache", torch.stack((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache[:n]
        cos, sin = c[..., 0], c[..., 1]
        return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)


class Alibi(nn.Module):
    """ALiBi slopes as a buffer, the bias matrix built on first use and kept as a buffer (shared by every block)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("slopes", torch.tensor([2.0 ** (-8.0 * (i + 1) / NH) for i in range(NH)]))
        self.register_buffer("bias", None, persistent=False)

    def forward(self, n: int, device: torch.device) -> torch.Tensor:
        if self.bias is None or self.bias.shape[-1] != n:
            pos = torch.arange(n, device=device)
            rel = (pos[None, :] - pos[:, None]).float()  # (n, n)
            causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            bias = (self.slopes[:, None, None] * rel).masked_fill(~causal, float("-inf"))
            self.bias = bias  # assigning to a registered buffer name keeps it a buffer
        return self.bias  # (nh, n, n)


# -- attention ---------------------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, style: str, shared: nn.Module | None):
        super().__init__()
        self.style = style
        self.wq, self.wk, self.wv = (nn.Linear(H, H, bias=False) for _ in range(3))
        self.wo = nn.Linear(H, H, bias=False)
        if style == "lazy_mask":
            self.register_buffer("mask", None, persistent=False)  # the causal mask, made on first use
        elif style == "lazy_mask_grow":
            self.register_buffer("mask", torch.ones(1, 1, dtype=torch.bool), persistent=False)
        elif style in ("grown_rotary",):
            self.rotary = GrownRotary()
        elif style == "plain_cache":
            self.rotary = PlainCacheRotary()
        elif style == "dict_cache":
            self._masks: dict[str, torch.Tensor] = {}  # a Python dict of masks, filled (and grown) in forward
        elif shared is not None:
            self.shared = shared  # one module, registered under every block's path

    def _mask(self, n: int, device: torch.device) -> torch.Tensor:
        if self.style == "lazy_mask":
            if self.mask is None or self.mask.shape[-1] < n:
                self.register_buffer("mask", torch.ones(n, n, device=device, dtype=torch.bool).tril(),
                                     persistent=False)
            return self.mask[:n, :n]
        if self.mask.shape[-1] < n:  # lazy_mask_grow: a registered placeholder replaced by a larger one
            self.mask = torch.tril(torch.ones(n, n, device=device)).bool()
        return self.mask[:n, :n]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (w(x).view(b, n, NH, HD).transpose(1, 2) for w in (self.wq, self.wk, self.wv))  # (b, nh, n, hd)
        bias = None
        if self.style in ("grown_rotary", "plain_cache", "shared_rotary"):
            cos, sin = (self.rotary if self.style != "shared_rotary" else self.shared)(x, n)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if self.style == "shared_alibi":
            bias = self.shared(n, x.device)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(HD)  # (b, nh, n, n)
        if bias is not None:
            att = att + bias
        elif self.style in ("lazy_mask", "lazy_mask_grow"):
            att = att.masked_fill(~self._mask(n, x.device), float("-inf"))
        elif self.style == "dict_cache":
            if "causal" not in self._masks or self._masks["causal"].shape[-1] < n:
                self._masks["causal"] = torch.full((n, n), float("-inf"), device=x.device).triu(1)
            att = att + self._masks["causal"][:n, :n]
        else:
            att = att.masked_fill(torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.wo(y.transpose(1, 2).reshape(b, n, H))


class Block(nn.Module):
    def __init__(self, style: str, shared: nn.Module | None):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.attn = Attention(style, shared)
        self.up, self.down = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


# -- a tied head that holds the embedding module itself --------------------------------------------------
class TiedHead(nn.Module):
    """Not a forward: ``__call__`` reads the embedding's weight, the embedding held as a child module."""

    def __init__(self, emb: nn.Embedding):
        super().__init__()
        self.tied_module = emb  # the embedding module, registered here too

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.tied_module.weight)


class TiedForward(nn.Module):
    """The same, spelled as a forward over the embedding module it holds."""

    def __init__(self, emb: nn.Embedding):
        super().__init__()
        self.emb = emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.emb.weight)


class GPT(nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.style = style
        self.tok_embeddings = nn.Embedding(V, H)
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)  # as GPTs do: logits of order 1 through a tied head
        shared = {"shared_rotary": TableRotary, "shared_alibi": Alibi}.get(style)
        self.shared = shared() if shared is not None else None  # built once, passed to every block
        self.layers = nn.ModuleList([Block(style, self.shared) for _ in range(3)])
        self.norm = nn.LayerNorm(H)
        if style == "tied_module":
            self.output = TiedHead(self.tok_embeddings)
        elif style == "tied_forward":
            self.output = TiedForward(self.tok_embeddings)
        else:
            self.output = nn.Linear(H, V, bias=False)
        self.pos = None if style != "lazy_mask" else nn.Embedding(S, H)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.tok_embeddings(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        logits = self.output(self.norm(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, V), targets.view(-1))
        return logits, loss


STYLES = ["lazy_mask", "lazy_mask_grow", "grown_rotary", "plain_cache", "dict_cache", "shared_rotary",
          "shared_alibi", "tied_module", "tied_forward"]


def build(style: str) -> tuple[nn.Module, tuple]:
    """The model (seeded) and an example ``(idx, targets)`` batch of (2, S)."""
    torch.manual_seed(0)
    model = GPT(style)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randint(0, V, (2, S), generator=g), torch.randint(0, V, (2, S), generator=g))


def snapshot(model: nn.Module) -> dict:
    """Every module's ``__dict__`` as comparable data: tensors by device, dtype, shape, values and identity;
    nested dicts and lists walked; other Python values by equality (objects by identity)."""

    def value(x: object, depth: int = 0) -> object:
        if isinstance(x, torch.Tensor):
            data = None if x.is_meta else x.detach().clone()
            return ("tensor", id(x), type(x).__name__, str(x.device), x.dtype, tuple(x.shape), x.requires_grad, data)
        if isinstance(x, dict) and depth < 3:
            return ("dict", type(x).__name__, tuple((k, value(v, depth + 1)) for k, v in x.items()))
        if isinstance(x, (list, tuple, set)) and depth < 3:
            items = sorted(x, key=repr) if isinstance(x, set) else x
            return (type(x).__name__, tuple(value(v, depth + 1) for v in items))
        if isinstance(x, (int, float, str, bool, type(None), torch.dtype, torch.device)):
            return ("atom", x)
        return ("object", type(x).__name__, id(x))

    return {name: value(dict(m.__dict__)) for name, m in model.named_modules(remove_duplicate=False)}


def diff(before: dict, after: dict, skip: tuple[str, ...] = ()) -> list[str]:
    """Where two snapshots differ (``skip``: top-level ``__dict__`` keys left out, e.g. ``_parameters``)."""

    def same(a: object, b: object) -> bool:
        if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and a and a[0] == "tensor":
            if a[:-1] != b[:-1]:
                return False
            return (a[-1] is None) == (b[-1] is None) and (a[-1] is None or torch.equal(a[-1], b[-1]))
        if isinstance(a, tuple) and isinstance(b, tuple):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    out = []
    for name in sorted(set(before) | set(after)):
        if name not in before or name not in after:
            out.append(f"module {name!r} {'added' if name not in before else 'removed'}")
            continue
        a, b = dict(before[name][2]), dict(after[name][2])
        for key in sorted(set(a) | set(b)):
            if key in skip:
                continue
            if key not in a or key not in b or not same(a[key], b[key]):
                out.append(f"{name or '<root>'}.{key}: {str(a.get(key))[:160]} -> {str(b.get(key))[:160]}")
    return out
