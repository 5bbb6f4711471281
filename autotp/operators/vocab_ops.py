"""Run-time pieces of vocab parallelism: masked embedding lookup, vocab-parallel cross-entropy, and the
logits handed back to the user as a full-shape tensor gathered on first use.

Each is a graph module that the passes insert unbound (then it computes the plain, unsharded op) and the
runtime binds to a rank and a group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from autotp.operators.amp import amp_bwd, amp_fwd
from autotp.operators.collectives import all_reduce, all_reduce_each
from autotp.operators.gathered import GatherOutput
from autotp.shard_spec import VocabRows, vocab_shard, vocab_unshard


class _VocabModule(nn.Module):
    def __init__(self, rows: VocabRows):
        super().__init__()
        self.rows = rows  # the vocabulary's rows per rank
        self.group: dist.ProcessGroup | None = None
        self.rank = 0

    def bind(self, group: dist.ProcessGroup | None, rank: int) -> None:
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.rank = rank

    @property
    def start(self) -> int:
        return self.rows.start(self.rank)

    @property
    def owned(self) -> int:
        return self.rows.owned(self.rank)


class VocabEmbedding(_VocabModule):
    """Lookup of the ids this rank owns; other ids give zero rows (the all-reduce after it fills them)."""

    def forward(self, weight: torch.Tensor, ids: torch.Tensor, padding_idx: int = -1, *rest) -> torch.Tensor:
        if self.group is None:
            return torch.ops.aten.embedding.default(weight, ids, padding_idx, *rest)
        local = ids - self.start
        outside = (local < 0) | (local >= self.owned)
        # the padding row gets no gradient; only the rank that owns it holds it
        pad = padding_idx - self.start if 0 <= padding_idx - self.start < self.owned else -1
        out = torch.ops.aten.embedding.default(weight, local.masked_fill(outside, 0), pad, *rest)  # (b, s, h)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabCE(torch.autograd.Function):
    """Megatron's vocab-parallel cross-entropy: three all-reduces of n (row max, Σ exp, the target term; the
    first and last in flight together). Two passes over the local logits forward (max; exp of the shifted
    logits, kept for backward) and one backward (the kept exps scaled per row into the gradient, in place
    unless the graph is retained)."""

    @staticmethod
    @amp_fwd(cast=torch.float32)
    def forward(ctx, logits, target, group, start, owned, vocab, reduction, ignore_index, smoothing):
        x = logits.float()[:, :owned]  # (n, owned): padding columns never reach the loss
        local_max = x.amax(dim=-1) if owned else x.new_full((x.shape[0],), float("-inf"))
        valid = target != ignore_index
        local_t = target - start
        mine = valid & (local_t >= 0) & (local_t < owned)
        picked = x.gather(1, local_t.clamp(0, max(owned - 1, 0)).unsqueeze(1)).squeeze(1) if owned \
            else x.new_zeros(target.shape)
        # the target logit and the label-smoothing term share one reduction, on unshifted logits so that it
        # needs no row max and travels with it: z = (1-ε)·x_t + ε/V·Σ_j x_j. Σ_j x_j is summed in float64:
        # in float32 the sum of V logits near 1e4 keeps ~1e-3 of the loss; x_t alone is exact either way
        z = torch.where(mine, picked, 0.0)
        if smoothing:
            z = z.double() * (1.0 - smoothing) + x.sum(dim=-1, dtype=torch.float64) * (smoothing / vocab)
        row_max, z = all_reduce_each([(local_max, "max"), (z, "sum")], group)  # (n,), (n,)
        exp = (x - row_max.unsqueeze(-1)).exp_()  # (n, owned)
        sum_exp = all_reduce(exp.sum(dim=-1), group)
        # -Σ_j q_j·log p_j with log p_j = x_j - max - log Σ exp, Σ_j q_j = 1; z - max first, as log_softmax
        # shifts before it subtracts (large logits keep their precision)
        loss = torch.where(valid, sum_exp.log() - (z - row_max).to(sum_exp.dtype), 0.0)  # (n,)
        count = valid.sum()
        ctx.save_for_backward(exp, sum_exp, local_t, mine, valid, count)
        ctx.meta = (logits.shape, logits.dtype, owned, vocab, reduction, smoothing)
        if reduction == 0:
            return loss
        return loss.sum() / count if reduction == 1 else loss.sum()

    @staticmethod
    @amp_bwd
    def backward(ctx, grad):
        exp, sum_exp, local_t, mine, valid, count = ctx.saved_tensors
        shape, dtype, owned, vocab, reduction, smoothing = ctx.meta
        per_row = grad.expand(valid.shape) if reduction != 0 else grad
        if reduction == 1:
            per_row = per_row / count
        per_row = torch.where(valid, per_row, 0.0)  # (n,)
        scale = (per_row / sum_exp).unsqueeze(-1)
        # softmax · dL/dloss, (n, owned): written over the kept exps when no second backward can read them
        # (as Megatron does), saving a b·s·V/t buffer
        reuse = not torch.compiler.is_compiling() and not torch._C._autograd._get_current_graph_task_keep_graph()
        g = exp.mul_(scale) if reuse else exp * scale
        if smoothing:
            g.sub_((per_row * (smoothing / vocab)).unsqueeze(-1))
        if owned:  # minus (1-ε) at the target column, on the rank that owns it (no data-dependent shapes)
            hit = torch.where(mine, (smoothing - 1.0) * per_row, 0.0).unsqueeze(1)
            g.scatter_add_(1, local_t.clamp(0, owned - 1).unsqueeze(1), hit)
        if owned < shape[1]:  # padded vocab rows: zero gradient
            g = torch.cat([g, g.new_zeros(shape[0], shape[1] - owned)], dim=1)
        return g.to(dtype), None, None, None, None, None, None, None, None


class VocabCrossEntropy(_VocabModule):
    """cross_entropy over vocab-sharded logits (n, local), or (b, local, s, ...) with the classes on dim 1, with
    global targets (n,) or (b, s, ...); never gathers logits.
    Only the classes count: rows of a head cropped in the model (``classes``) are padding, as the crop made them."""

    def __init__(self, rows: VocabRows, reduction: int, ignore_index: int, label_smoothing: float):
        super().__init__(rows.logits())
        self.reduction = reduction
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            red = ("none", "mean", "sum")[self.reduction]
            return F.cross_entropy(logits, target, reduction=red, ignore_index=self.ignore_index,
                                   label_smoothing=self.label_smoothing)
        shape = target.shape
        if logits.dim() > 2:  # (b, V/t, s, ...), classes on dim 1 as torch's N-d losses take them: (b·s·…, V/t)
            logits = logits.movedim(1, -1).reshape(-1, logits.shape[1])
            target = target.reshape(-1)
        loss = _VocabCE.apply(logits, target, self.group, self.start, self.owned, self.rows.size,
                              self.reduction, self.ignore_index, self.label_smoothing)
        return loss.view(shape) if self.reduction == 0 else loss  # reduction="none": one loss per target


class VocabOutput(GatherOutput):
    """This rank's logits, handed back as the full (b, s, V) tensor that is gathered only when read
    (:class:`~autotp.operators.gathered.GatheredOnUse`): a training step that only uses the loss moves no b·s·V data.
    Padding rows never reach the user: each rank contributes its owned classes only, so a head cropped in the
    model (``rows.classes``) gives ``classes`` of them, as the unsharded model's crop does."""

    def __init__(self, rows: VocabRows, dim: int):
        classes = rows.logits()
        super().__init__(dim, classes.size,
                         lambda shards, tp: vocab_unshard(shards, dim, classes),
                         lambda grad, rank: vocab_shard(grad, dim, classes, rank))
        self.rows = rows


def bind_vocab(module: nn.Module, group: dist.ProcessGroup | None, rank: int) -> None:
    for m in module.modules():
        if isinstance(m, (_VocabModule, GatherOutput)):
            m.bind(group, rank)
