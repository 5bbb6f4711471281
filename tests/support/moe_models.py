"""Mixture-of-experts spellings from public model code, each in a small LM of its own (width 64, 4 heads,
4 experts of 32 features, vocab 96): the expert suite of tests/runtime/test_moe.py. Every model is
``(idx, targets) -> (logits, loss)``; the loss adds the router's load-balancing loss where the kind has one.

- ``list_dense``: a ModuleList of SwiGLU experts, every expert on every token, weighted by a dense routing matrix;
- ``list_masked``: the same, weights read per expert with ``where(sel == e)`` (top-1, Switch style, with aux loss);
- ``fused_loop``: experts fused as 3-D parameters ``w1 [E, I, H]``, ``w2 [E, H, I]``, ``w3``, a loop over ``w[e]``;
- ``fused_loop_t``: the same stored ``[E, H, I]`` / ``[E, I, H]`` and read ``x @ w[e]`` (no transpose);
- ``gathered_bmm``: per-token weights ``w[ids]`` and ``bmm`` (Hugging Face's batched_mm, gate|up fused);
- ``gathered_einsum``: per-token weights and ``einsum`` (gpt-fast's ConditionalFeedForward);
- ``shared_sigmoid``: routed experts plus a shared expert scaled by ``sigmoid(gate(x))`` (Qwen2-MoE);
- ``top1_aux``: top-1 routing with the Switch load-balancing loss, fused loop;
- ``capacity``: top-1 with an expert capacity (Switch, GShard): each expert takes at most ``CAP`` tokens in
  order, the rest are dropped (their MoE output is 0, the residual carries them);
- ``mla_cat``, ``mla_copy``: multi-head latent attention (DeepSeek-V2/V3) before a fused-loop MoE: q and kv
  through low-rank down-projections and norms, up-projections per head into a non-rotary and a rotary part, one
  rotary key head shared by all heads, the key built by ``cat`` with that head expanded, or written into a
  ``new_empty`` buffer slice by slice;
- ``fused_loop_odd``: a fused loop whose last expert normalises its hidden features (a softmax over them): that
  expert cannot be cut, and its weights are the other experts' too, so all stay whole (with the reason).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import HD, H, NH, V, Attention, RMSNorm, rope_tables

S, E, I = 12, 4, 32  # sequence, experts, expert features
KINDS = ("list_dense", "list_masked", "fused_loop", "fused_loop_t", "gathered_bmm", "gathered_einsum",
         "shared_sigmoid", "top1_aux", "capacity", "mla_cat", "mla_copy")
CAP = 4  # tokens per expert in ``capacity`` (24 tokens, 4 experts: some are dropped)
QR, KR, DN, DR = 24, 16, 16, 8  # latent ranks of q and kv; per-head non-rotary and rotary dims (v: HD)
# what enters f once per layer for the router's weights of the experts' partial sums: (T, k) routing weights,
# or the dense (T, E) matrix; the shared expert's (T, 1) sigmoid gate beside them
ROUTER_GRAD = {"list_dense": E, "capacity": E}
GATE_GRAD = {"shared_sigmoid": 1}
TOP = {"list_masked": 1, "top1_aux": 1, "capacity": 1}
AUX = {"list_masked", "top1_aux", "shared_sigmoid", "capacity"}


def collectives(kind: str, layers: int = 2) -> tuple[list, list, list]:
    """What one training step of ``kind`` (not the latent-attention kinds) all-reduces: ``(forward,
    backward, router)``. Forward: b·s·h once for the embedding and per attention and MoE layer, and the
    loss's three statistics (b·s); backward: b·s·h entering each, plus ``router``: the routing weights'
    gradient once per layer (b·s·k, or b·s·E for a dense routing matrix) and a shared expert's gate (b·s)."""
    bsh, rows = 2 * S * H, 2 * S
    loss = [("all_reduce", "max", rows), ("all_reduce", "sum", rows), ("all_reduce", "sum", rows)]
    router = [("all_reduce", "sum", rows * ROUTER_GRAD.get(kind, TOP.get(kind, 2)))] * layers
    gate = [("all_reduce", "sum", rows * GATE_GRAD[kind])] * layers if kind in GATE_GRAD else []
    forward = [("all_reduce", "sum", bsh)] * (2 * layers + 1) + loss
    return forward, [("all_reduce", "sum", bsh)] * (2 * layers + 1) + router + gate, router


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def balance_loss(probs: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss: E · Σ_e (fraction of tokens routed to e) · (mean prob of e)."""
    frac = F.one_hot(sel, E).float().sum(-2).mean(0)  # (E,) (top-k picks per token summed)
    return E * (frac * probs.mean(0)).sum()


class MoE(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.k = kind, TOP.get(kind, 2)
        self.router = nn.Linear(H, E, bias=False)
        if kind.startswith("list"):
            self.experts = nn.ModuleList(Expert() for _ in range(E))
        elif kind == "gathered_bmm":  # gate | up stacked on dim 1, as Hugging Face stores them
            self.gate_up = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
            self.down = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        elif kind == "fused_loop_t":
            self.w1, self.w3 = (nn.Parameter(torch.randn(E, H, I) * H ** -0.5) for _ in range(2))
            self.w2 = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        else:
            self.w1, self.w3 = (nn.Parameter(torch.randn(E, I, H) * H ** -0.5) for _ in range(2))
            self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        if kind == "shared_sigmoid":
            self.shared = Expert()
            self.shared_gate = nn.Linear(H, 1, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        x = x.reshape(-1, h)  # (T, h)
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)  # (T, E)
        w, sel = torch.topk(probs, self.k, dim=-1)  # (T, k)
        if self.k > 1:
            w = w / w.sum(-1, keepdim=True)
        w = w.to(x.dtype)
        out = self.routed(x, w, sel)
        if self.kind == "shared_sigmoid":
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        aux = balance_loss(probs, sel) if self.kind in AUX else x.new_zeros(())
        return out.view(b, s, h), aux

    def routed(self, x, w, sel):
        kind = self.kind
        if kind in ("list_dense", "shared_sigmoid_list"):
            dense = torch.zeros(x.shape[0], E, dtype=x.dtype).scatter(-1, sel, w)  # (T, E)
            return sum(dense[:, e, None] * expert(x) for e, expert in enumerate(self.experts))
        if kind == "list_masked":
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                we = torch.where(sel == e, w, torch.zeros_like(w)).sum(-1, keepdim=True)  # (T, 1)
                out = out + we * expert(x)
            return out
        if kind in ("fused_loop", "shared_sigmoid", "top1_aux", "fused_loop_odd"):
            out = x.new_zeros(x.shape)
            for e in range(E):
                we = (w * (sel == e)).sum(-1, keepdim=True)  # (T, 1)
                hidden = F.silu(x @ self.w1[e].t()) * (x @ self.w3[e].t())  # (T, I)
                if kind == "fused_loop_odd" and e == E - 1:
                    hidden = hidden.softmax(-1)
                out = out + we * F.linear(hidden, self.w2[e])
            return out
        if kind == "capacity":
            mask = F.one_hot(sel[:, 0], E)  # (T, E)
            place = torch.cumsum(mask, dim=0) * mask  # 1-based place of each token in its expert's queue
            dense = w * (mask * (place <= CAP)).to(w.dtype)  # (T, E): 0 for dropped tokens
            out = x.new_zeros(x.shape)
            for e in range(E):
                hidden = F.silu(x @ self.w1[e].t()) * (x @ self.w3[e].t())
                out = out + dense[:, e:e + 1] * F.linear(hidden, self.w2[e])
            return out
        if kind == "fused_loop_t":
            out = x.new_zeros(x.shape)
            for e in range(E):
                we = (w * (sel == e)).sum(-1, keepdim=True)
                out = out + we * ((F.silu(x @ self.w1[e]) * (x @ self.w3[e])) @ self.w2[e])
            return out
        if kind == "gathered_bmm":  # Hugging Face's batched_mm: one (token, k) slot per row
            ids = sel.reshape(-1)  # (T·k,)
            xs = x.repeat_interleave(self.k, dim=0)  # (T·k, h)
            gate, up = torch.bmm(self.gate_up[ids], xs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)  # (T·k, I)
            y = torch.bmm(self.down[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # (T·k, h)
            return (y * w.reshape(-1, 1)).view(-1, self.k, x.shape[-1]).sum(1)
        if kind == "gathered_einsum":  # gpt-fast: (T, k, out, in) weights per token
            w1, w3, w2 = self.w1[sel], self.w3[sel], self.w2[sel]
            hidden = F.silu(torch.einsum("ti,taoi->tao", x, w1)) * torch.einsum("ti,taoi->tao", x, w3)
            y = torch.einsum("tao,taio->tai", hidden, w2)  # (T, k, h)
            return torch.einsum("tai,ta->ti", y, w)
        raise ValueError(kind)


def rotate_half(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * torch.cat([cos, cos], -1) + torch.cat([-x2, x1], -1) * torch.cat([sin, sin], -1)


class LatentAttention(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q_down, self.q_norm = nn.Linear(H, QR, bias=False), RMSNorm(QR)
        self.q_up = nn.Linear(QR, NH * (DN + DR), bias=False)
        self.kv_down, self.kv_norm = nn.Linear(H, KR + DR, bias=False), RMSNorm(KR)
        self.kv_up = nn.Linear(KR, NH * (DN + HD), bias=False)
        self.o = nn.Linear(NH * HD, H, bias=False)
        cos, sin = rope_tables(DR)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        cos, sin = self.cos[:s], self.sin[:s]
        q = self.q_up(self.q_norm(self.q_down(x))).view(b, s, NH, DN + DR).transpose(1, 2)
        q_nope, q_rot = torch.split(q, [DN, DR], dim=-1)
        latent, k_rot = self.kv_down(x).split([KR, DR], dim=-1)
        kv = self.kv_up(self.kv_norm(latent)).view(b, s, NH, DN + HD).transpose(1, 2)
        k_nope, v = kv.split([DN, HD], dim=-1)
        k_rot = rotate_half(k_rot.view(b, 1, s, DR), cos, sin)  # one head, shared by all
        q = torch.cat([q_nope, rotate_half(q_rot, cos, sin)], dim=-1)
        if self.kind == "mla_cat":
            k = torch.cat([k_nope, k_rot.expand(-1, NH, -1, -1)], dim=-1)
        else:
            k = k_nope.new_empty(b, NH, s, DN + DR)
            k[..., :DN] = k_nope
            k[..., DN:] = k_rot
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, n, s, HD)
        return self.o(y.transpose(1, 2).reshape(b, s, NH * HD))


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.n1, self.n2 = RMSNorm(H), RMSNorm(H)
        self.attn = LatentAttention(kind) if kind.startswith("mla") else Attention("plain")
        self.moe = MoE("fused_loop" if kind.startswith("mla") else kind)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        y, aux = self.moe(self.n2(x))
        return x + y, aux


class LM(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList([Block(kind) for _ in range(2)])
        self.norm = RMSNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx, targets):
        x, aux = self.emb(idx), 0.0
        for blk in self.blocks:
            x, a = blk(x)
            aux = aux + a
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + 0.01 * aux


def build(kind: str):
    torch.manual_seed(0)
    model = LM(kind)
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, V, (2, S), generator=g), torch.randint(0, V, (2, S), generator=g)
    return model, (idx, targets), {}
