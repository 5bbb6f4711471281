"""LM heads padded past the vocabulary and cropped in the model, and small gates and routers that are not LM
heads, in small LMs like tests/support/pattern_models.py's (width 64, 4 heads of 16, seq 12, 2 layers). Every model
is ``(idx, targets) -> (logits, loss)``; tests/analysis/test_vocab_gaps.py runs them.

Crops (nanoGPT-style heads padded to a multiple of 64, as modded-nanogpt and Megatron pad them):

- ``crop_slice``: ``lm_head(x)[..., :V]``, 128 rows for V = 100, cross-entropy over ``view(-1, size(-1))``;
- ``crop_index_float``: ``logits[:, :, :V].float()``, with a head bias;
- ``crop_narrow_tied``: ``.float().narrow(-1, 0, V)`` of a head tied to the (padded) embedding, label smoothing;
- ``crop_past_ranks``: 128 rows for V = 60, so that at tp 4 two ranks hold no class (and at tp 2 one),
  ``log_softmax`` + ``nll_loss``.

Cuts that are not vocab padding (the head stays whole, with the reason): ``crop_offset`` (``[..., 10:]``),
``crop_after_log_softmax`` (the log-probabilities of all 128 rows cut to V), ``crop_loss_only`` (the loss sees
V classes, the caller gets all 128 rows).

Gates and routers (kept whole, reported as what they are):

- ``smear_gate``: modded-nanogpt's smear of each token's embedding into the next,
  ``x[:, 1:] + sigmoid(gate(x[:, 1:, :12])) * x[:, :-1]`` with gate = Linear(12, 1);
- ``mix_gate``: a per-token softmax mixing of the residual and the first layer's input, Linear(64, 2);
- ``router_softmax_topk``: an MoE router (Mixtral): Linear(64, 4) -> softmax -> topk 2, dense experts;
- ``router_topk_softmax``: the Mistral reference's: topk of the router's logits, then softmax of the two.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, S, Block, RMSNorm, SwiGLU

PADDED = 128  # head rows: a multiple of 64
CLASSES = {"crop_slice": 100, "crop_index_float": 100, "crop_narrow_tied": 100, "crop_past_ranks": 60}
# spellings that must keep the head whole (structural tests only), and a word of the reason given
NOT_CROPS = {"crop_offset": "only a crop to the first classes", "crop_after_log_softmax": "took part in the softmax",
             "crop_loss_only": "the graph returns .* with all 128 rows"}
# the modules kept whole, and the op their reason names
GATES = {"smear_gate": (["smear_gate"], "sigmoid"), "mix_gate": (["blocks.0.mix", "blocks.1.mix"], "softmax")}
ROUTERS = {kind: (["blocks.0.moe.router", "blocks.1.moe.router"], "topk")
           for kind in ("router_softmax_topk", "router_topk_softmax")}
KINDS = (*CLASSES, *GATES, *ROUTERS)
V = 96  # the gate and router models' vocabulary (unpadded)
EXPERTS, TOP = 4, 2


class MoE(nn.Module):
    """Dense top-2 mixture of 4 small SwiGLU experts: every expert runs on every token, weighted by the
    router's choice (exportable: no data-dependent shapes)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.router = nn.Linear(H, EXPERTS, bias=False)
        self.experts = nn.ModuleList(SwiGLU() for _ in range(EXPERTS))

    def forward(self, x):
        logits = self.router(x)  # (b, s, E)
        if self.kind == "router_softmax_topk":
            w, sel = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), TOP, dim=-1)
            w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        else:
            top, sel = logits.topk(TOP, dim=-1)
            w = top.softmax(-1)
        dense = torch.zeros_like(logits).scatter(-1, sel, w)  # (b, s, E): 0 for the experts not chosen
        return sum(dense[..., e, None] * expert(x) for e, expert in enumerate(self.experts))


class GapBlock(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.inner = Block("plain")
        if kind.startswith("router"):
            self.n = RMSNorm(H)
            self.moe = MoE(kind)
        if kind == "mix_gate":
            self.mix = nn.Linear(H, 2, bias=False)

    def forward(self, x, x0):
        x = self.inner(x)
        if self.kind.startswith("router"):
            x = x + self.moe(self.n(x))
        if self.kind == "mix_gate":  # (b, s, 2) weights of the residual and of the embedding
            w = torch.softmax(self.mix(x), dim=-1)
            x = w[..., :1] * x + w[..., 1:] * x0
        return x


class GapLM(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.classes = CLASSES.get(kind, 100 if kind in NOT_CROPS else V)
        rows = PADDED if kind in CLASSES or kind in NOT_CROPS else V
        self.emb = nn.Embedding(rows if kind == "crop_narrow_tied" else self.classes, H)
        if kind == "smear_gate":
            self.smear_gate = nn.Linear(12, 1, bias=False)
        self.blocks = nn.ModuleList(GapBlock(kind) for _ in range(2))
        self.norm = RMSNorm(H)
        self.head = nn.Linear(H, rows, bias=kind == "crop_index_float")
        if kind == "crop_narrow_tied":  # nanoGPT's tie and its init of the shared table
            self.head.weight = self.emb.weight
            nn.init.normal_(self.emb.weight, std=0.02)

    def forward(self, idx, targets):
        x = x0 = self.emb(idx)
        if self.kind == "smear_gate":  # each position gets a gated share of the previous token's embedding
            g = torch.sigmoid(self.smear_gate(x[:, 1:, :12]))  # (b, s-1, 1)
            x = x0 = torch.cat([x[:, :1], x[:, 1:] + g * x[:, :-1]], dim=1)
        for blk in self.blocks:
            x = blk(x, x0)
        logits = self.head(self.norm(x))
        kind, c = self.kind, self.classes
        if kind == "crop_slice":
            logits = logits[..., :c]
            return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        if kind == "crop_index_float":
            logits = logits[:, :, :c].float()
            return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        if kind == "crop_narrow_tied":
            logits = logits.float().narrow(-1, 0, c)
            loss = F.cross_entropy(logits.reshape(-1, c), targets.reshape(-1), label_smoothing=0.1)
            return logits, loss
        if kind == "crop_past_ranks":
            logits = logits[..., :c]
            return logits, F.nll_loss(F.log_softmax(logits, dim=-1).flatten(0, 1), targets.flatten())
        if kind == "crop_offset":  # not a crop to the first classes
            logits = logits[..., 10:]
            return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        if kind == "crop_after_log_softmax":  # the rows past V take part in the normalisation: not padding
            logp = F.log_softmax(logits, dim=-1)[..., :c]
            return logits, F.nll_loss(logp.flatten(0, 1), targets.flatten())
        if kind == "crop_loss_only":  # the loss sees V classes, the caller all 128 rows
            return logits, F.cross_entropy(logits[..., :c].flatten(0, 1), targets.flatten())
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(kind: str):
    torch.manual_seed(0)
    model = GapLM(kind)
    g = torch.Generator().manual_seed(1)
    classes = model.classes
    return model, (torch.randint(0, classes, (2, S), generator=g), torch.randint(0, classes, (2, S), generator=g)), {}


def gap_parity(kinds: list[str], gathered: list[str]) -> dict:
    """Inside each gloo rank: tests/support/parity_workers.py's ``pattern_parity`` of ``kinds`` (3 AdamW steps against
    the unsharded model), and for ``gathered`` the returned logits read whole and generate-style, and the
    full state dict after an AdamW step with weight decay (the rows past the classes get no gradient, but
    decay moves them)."""
    import autotp
    from parity_workers import _max_diff, pattern_parity

    out: dict = {"parity": pattern_parity(kinds, 3, False, "vocab_gap_models"), "gathered": {}}
    for kind in gathered:
        ref, args, _ = build(kind)
        model = autotp.parallelize(build(kind)[0], example_inputs=args)
        initial = ref.head.weight.detach().clone()
        for m in (model, ref):  # decay 1.0: the rows past the classes shrink by lr·1.0 of their values
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6, weight_decay=1.0)
            m(*args)[1].backward()
            opt.step()
        with torch.no_grad():
            logits, rlogits = model(*args)[0], ref(*args)[0]
            local = list(logits.to_local().shape)
            last = logits[:, -1, :]  # sampling's read: gathers the logits once
            full = logits.full_tensor()
        sd, rsd = autotp.full_state_dict(model), ref.state_dict()
        out["gathered"][kind] = {
            "shape": list(full.shape), "ref_shape": list(rlogits.shape), "logits_diff": _max_diff(full, rlogits),
            "last_shape": list(last.shape), "last_diff": _max_diff(last, rlogits[:, -1, :]), "local": local,
            "head_local": list(model.head.weight.shape),
            "state_shapes": {k: list(v.shape) for k, v in sd.items() if k in ("head.weight", "emb.weight")},
            "state_diff": max(_max_diff(sd[k], rsd[k]) for k in rsd),
            "dead_rows_moved": _max_diff(rsd["head.weight"][CLASSES[kind]:], initial[CLASSES[kind]:]),
        }
    return out
