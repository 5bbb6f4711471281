"""Attention written out by hand, and masks proven causal: when ``softmax(q·kᵀ·c + mask)·v`` is exactly
``scaled_dot_product_attention(q, k, v, is_causal=..., scale=c)``.

A model written for one device often spells attention itself (nanoGPT's slow path, GPT-2, most teaching code)::

    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))   # (b, h, s, s)
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    y = F.softmax(att, dim=-1) @ v                                      # (b, h, s, d)

The chain is recognised on the captured graph from the ops alone: the ·v matmul (or ``bmm`` with the heads
folded into the batch, ``(b·h, s, d)``, GPT-2's and BLOOM's spelling, with ``baddbmm(·, q, kᵀ, beta=0,
alpha=c)`` for the scores) reads a softmax over the last dim (through casts to the same dtype, and dropout that drops nothing: p = 0, or not training), whose
input is the q·kᵀ matmul (k transposed in its last two dims) scaled by constants and masked at most once
(``masked_fill`` / ``where`` with -inf, or an added bias of 0 and -inf, or a very negative number as Hugging
Face writes it). Each op is needed by the chain alone: probabilities the model also returns keep it whole.

A mask is *causal* when what it lets through is ``tril(ones(T, T))``. That is proven by computing it: its
ops may read sizes, constants and buffers (never the batch's data), and it is evaluated at several sequence
lengths, the capture's own among them (up to 4096 tokens); each must give the lower triangle, the same for
every batch row and head. A mask read from a buffer of a model built on meta has no values to compute: it is not proven.

Read-only, as every analysis: the facts name nodes; the context pass rewrites them.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from autotp.errors import own_bug

aten = torch.ops.aten

_MATMUL = (aten.matmul.default, aten.bmm.default)
_SCORES = (*_MATMUL, aten.baddbmm.default)
_FOLDS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_SOFTMAX = (aten.softmax.int, aten._softmax.default)
_CASTS = (aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.type_as.default)
_FILL = (aten.masked_fill.Scalar, aten.masked_fill.Tensor)
# an additive bias this negative is -inf to a softmax in any float dtype: exp(x - max) is 0
_NEGATIVE = -1e30
_LONGEST = 4096  # the longest sequence a mask is computed at: 16M entries per batch row and head


@dataclass(frozen=True)
class Written:
    """A hand-written attention the rewrite can run as SDPA."""

    out: str  # the ·v matmul: attention's output, (b, h, s, d)
    q: str
    k: str
    v: str
    scale: float  # what multiplies q·kᵀ
    mask: str | None  # the node whose value the scores are masked by (None: no mask, full attention)
    how: str  # how the mask applies: "fill" (masked where True), "keep" (kept where True), "add" (a bias)
    chain: tuple[str, ...]  # the scores' nodes up to the softmax's output (replaced with the output)
    folded: bool = False  # heads folded into the batch: ``out`` is (b·h, s, d), q, k and v are (b, h, s, d)


class _Unknown(Exception):
    """A value the mask's evaluation cannot compute (the batch's data, a meta buffer)."""


def written_attention(gm: fx.GraphModule) -> list[Written]:
    """Every ``softmax(q·kᵀ·c [masked])·v`` of ``gm`` whose chain is what SDPA computes."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _MATMUL:
            w = _chain(gm, node)
            if w is not None:
                found.append(w)
    return found


def _only_user(node: fx.Node, user: fx.Node) -> bool:
    return list(node.users) == [user]


def _chain(gm: fx.GraphModule, out: fx.Node) -> Written | None:
    probs, v = out.args[0], out.args[1]
    folded = out.target is aten.bmm.default
    if folded:  # bmm over (b·h, s, ·): v is a (b, h, s, d) value with its heads folded into the batch
        v, fold_v = _unfolded(v), v
    if not isinstance(probs, fx.Node) or v is None or _rank(out) != (3 if folded else 4) or _rank(v) != 4:
        return None
    chain, x = [], probs
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target not in _SOFTMAX:
        if not (_passes_through(x) or _refolds(x)) or not _only_user(x, chain[-1] if chain else out):
            return None
        chain.append(x)
        x = x.args[0]
    if not isinstance(x, fx.Node) or x.op != "call_function" or x.args[1] not in (-1, _rank(x) - 1) \
            or not _only_user(x, chain[-1] if chain else out) or not _same_dtype(x, x.args[0]):
        return None
    chain.append(x)
    scale, mask, how = 1.0, None, ""
    x = x.args[0]
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target not in _SCORES:
        if not _only_user(x, chain[-1]):
            return None
        factor = _scalar_factor(x)
        if factor is not None:
            scale *= factor
            nxt = x.args[0]
        elif _refolds(x):
            nxt = x.args[0]
        elif mask is None and (masked := _masking(gm, x)) is not None:
            nxt, mask, how = masked
        else:
            return None
        chain.append(x)
        x = nxt
    if not isinstance(x, fx.Node) or x.op != "call_function" or not _only_user(x, chain[-1]):
        return None
    extra = []
    if x.target is aten.baddbmm.default:  # baddbmm(bias, q, kᵀ, beta=0, alpha=c): the bias counts for nothing
        bias, q, kt = x.args[:3]
        beta, alpha = x.kwargs.get("beta", 1), x.kwargs.get("alpha", 1)
        if beta != 0 or not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            return None
        scale *= float(alpha)
        extra += [bias] if isinstance(bias, fx.Node) and _only_user(bias, x) else []
    else:
        q, kt = x.args[0], x.args[1]
    k = _untransposed(kt)
    if x.target is not aten.matmul.default:  # the heads folded: q and k unfolded to (b, h, s, d)
        folds = [q, k]
        q, k = _unfolded(q), _unfolded(k)
        extra += [f for f, user in zip(folds, (x, kt)) if isinstance(f, fx.Node) and _only_user(f, user)]
    if k is None or q is None or _rank(q) != 4 or not _only_user(kt, x):
        return None
    chain += [x, kt, *extra]
    if folded and _only_user(fold_v, out):
        chain.append(fold_v)
    return Written(out.name, q.name, k.name, v.name, scale, None if mask is None else mask.name, how,
                   tuple(n.name for n in reversed(chain)), folded)


def _size_expr(size: object) -> sympy.Expr:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def _unfolded(node: object) -> fx.Node | None:
    """x of ``x.reshape(b·h, s, d)``: a (b, h, s, d) value with its first two dims folded together."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _FOLDS:
        return None
    x = node.args[0]
    if _rank(x) != 4 or _rank(node) != 3:
        return None
    (b, h, s, d), (bh, s2, d2) = (tuple(_size_expr(n) for n in _shape(y)) for y in (x, node))
    same = all(sympy.simplify(a - c) == 0 for a, c in ((b * h, bh), (s, s2), (d, d2)))
    return x if same else None


def _refolds(node: fx.Node) -> bool:
    """A view that folds the heads into the batch (rank 4 to 3) or unfolds them (3 to 4), the last two dims
    kept: the scores or probabilities reshaped between the bmm's (b·h, s, s) and a (b, h, s, s) view."""
    if node.target not in _FOLDS or not isinstance(node.args[0], fx.Node):
        return False
    low, high = (node, node.args[0]) if _rank(node) == 3 else (node.args[0], node)
    if _rank(low) != 3 or _rank(high) != 4:
        return False
    (b, h, s, t), (bh, s2, t2) = (tuple(_size_expr(n) for n in _shape(y)) for y in (high, low))
    return all(sympy.simplify(a - c) == 0 for a, c in ((b * h, bh), (s, s2), (t, t2)))


def _rank(node: object) -> int:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else -1


def _same_dtype(a: fx.Node, b: object) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val") if isinstance(b, fx.Node) else None
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype


def _passes_through(node: fx.Node) -> bool:
    """Between the softmax and the ·v matmul: a cast to the same dtype, or dropout that drops nothing."""
    if node.target in _CASTS:
        return _same_dtype(node, node.args[0])
    if node.target is aten.dropout.default:
        return node.args[1] == 0 or not node.args[2]
    return False


def _scalar_factor(node: fx.Node) -> float | None:
    """``x * c`` or ``x / c`` with a Python number c: the factor it multiplies by."""
    if node.target in (aten.mul.Tensor, aten.mul.Scalar) and isinstance(node.args[1], (int, float)) \
            and not isinstance(node.args[1], bool):
        return float(node.args[1])
    if node.target in (aten.div.Tensor, aten.div.Scalar) and isinstance(node.args[1], (int, float)) \
            and not isinstance(node.args[1], bool) and node.args[1] != 0:
        return 1.0 / float(node.args[1])
    return None


def _masking(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, fx.Node, str] | None:
    """(scores, mask, how) of a masking op: ``masked_fill(scores, m, -inf)``, ``where(m, scores, -inf)``,
    ``scores + bias``."""
    a = node.args

    def _is_minus_inf(x: object) -> bool:
        return _minus_inf(gm, x)

    if node.target in _FILL and isinstance(a[1], fx.Node) and _is_minus_inf(a[2]):
        return a[0], a[1], "fill"
    if node.target is aten.where.self and isinstance(a[0], fx.Node):
        if _is_minus_inf(a[2]) and isinstance(a[1], fx.Node) and _rank(a[1]) == _rank(node):
            return a[1], a[0], "keep"
        if _is_minus_inf(a[1]) and isinstance(a[2], fx.Node) and _rank(a[2]) == _rank(node):
            return a[2], a[0], "fill"
    if node.target is aten.add.Tensor and all(isinstance(x, fx.Node) for x in a[:2]) and len(a) < 3:
        scores, bias = (a[0], a[1]) if _rank(a[0]) == _rank(node) and _shape(a[0]) == _shape(node) else (a[1], a[0])
        return scores, bias, "add"
    return None


def _shape(node: fx.Node) -> tuple:
    return tuple(node.meta["val"].shape)


def _minus_inf(gm: fx.GraphModule, x: object) -> bool:
    """Is ``x`` -inf (or so negative that a softmax gives 0): a number, or one value computed from constants."""
    if isinstance(x, (int, float)):
        return x <= _NEGATIVE
    if not isinstance(x, fx.Node) or x.op != "call_function":
        return False
    try:
        value = _evaluate(gm, x, {})
    except Exception as exc:  # noqa: BLE001 - not computable from constants: not a fill value
        if own_bug(exc):  # autotp's own bug: shown, never a verdict
            raise
        return False
    return value.is_floating_point() and bool((value <= _NEGATIVE).all()) and value.numel() == 1


def _untransposed(kt: object) -> fx.Node | None:
    """k of ``k.transpose(-2, -1)`` (or the permute that swaps the last two dims)."""
    if not isinstance(kt, fx.Node) or kt.op != "call_function":
        return None
    if kt.target is aten.transpose.int:
        n = _rank(kt)
        if {kt.args[1] % n, kt.args[2] % n} == {n - 2, n - 1}:
            return kt.args[0]
    if kt.target is aten.permute.default:
        dims = [d % len(kt.args[1]) for d in kt.args[1]]
        n = len(dims)
        if dims == [*range(n - 2), n - 1, n - 2]:
            return kt.args[0]
    return None


def mask_is_causal(gm: fx.GraphModule, mask: str, how: str, length: sympy.Symbol) -> str:
    """'' where the mask named ``mask`` lets through exactly ``tril(ones(T, T))`` at every length it was
    evaluated at; else why not."""
    node = next(n for n in gm.graph.nodes if n.name == mask)
    hint = _hint(length, node)
    # the capture's length, the ones around it and a few small ones; a long context is checked up to
    # _LONGEST (its s × s masks would take gigabytes), which it shares the mask's code with
    own = min(hint, _LONGEST)
    tried = set()
    for t in sorted({t for t in (1, 2, 3, 5, own, own + 1, 2 * own) if 0 < t <= _LONGEST} | {own}):
        try:
            value = _evaluate(gm, node, {length: t})
        except _Unknown as e:
            return f"the mask reads {e}: its values cannot be computed before the batch"
        except Exception as exc:  # noqa: BLE001 - a length this model cannot take (past a buffer's end): not tried
            if own_bug(exc):  # autotp's own bug: shown, never a verdict
                raise
            continue
        kept = _kept(value, how)
        if kept is None:
            return "the mask is not 0 and -inf where it is added"
        if kept.shape[-2:] != (t, t) or not bool((kept == torch.ones(t, t, dtype=torch.bool).tril()).all()):
            return f"the mask is not causal (at sequence length {t} it is not the lower triangle)"
        tried.add(t)
    if own not in tried or len(tried) < 2:
        return "the mask could not be computed at the capture's sequence length and another"
    return ""


def _kept(value: torch.Tensor, how: str) -> torch.Tensor | None:
    """Where the scores pass through the mask (every batch row and head alike, else None)."""
    if how == "fill":
        kept = ~value.bool()
    elif how == "keep":
        kept = value.bool()
    else:
        if not value.is_floating_point() or not bool(((value == 0) | (value <= _NEGATIVE)).all()):
            return None
        kept = value == 0
    flat = kept.reshape(-1, *kept.shape[-2:])
    return flat[0] if bool((flat == flat[0]).all()) else None


def _hint(length: sympy.Symbol, node: fx.Node) -> int:
    for n in node.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.SymInt) and val.node.expr == length:
            return int(val.node.hint)
        if isinstance(val, torch.Tensor):
            for size in val.shape:
                if isinstance(size, torch.SymInt) and size.node.expr == length:
                    return int(size.node.hint)
    return 0


def _evaluate(gm: fx.GraphModule, node: fx.Node, sizes: dict) -> torch.Tensor:
    """``node``'s value computed from sizes (``sizes`` for the symbols given, the capture's hints for the
    others), constants and buffers; :class:`_Unknown` where it reads anything else."""
    env: dict[fx.Node, object] = {}

    def value(n: fx.Node) -> object:
        if n in env:
            return env[n]
        val = n.meta.get("val")
        if isinstance(val, torch.SymInt):
            expr = val.node.expr
            env_ = val.node.shape_env
            hints = getattr(env_, "backed_var_to_val", None) or env_.var_to_val
            subs = {s: sizes.get(s, hints.get(s)) for s in expr.free_symbols}
            out: object = int(expr.subs(subs))
        elif n.op == "get_attr":
            out = gm
            for part in str(n.target).split("."):
                out = getattr(out, part)
            if isinstance(out, torch.Tensor) and out.is_meta:
                raise _Unknown(f"{n.target}, a tensor of a model built on meta")
        elif n.op == "call_function":
            args, kwargs = tree_map(lambda a: value(a) if isinstance(a, fx.Node) else a, (n.args, n.kwargs))
            out = n.target(*args, **kwargs)
        else:
            raise _Unknown(f"the input {n.name}")
        env[n] = out
        return out

    out = value(node)
    if not isinstance(out, torch.Tensor):
        raise _Unknown(f"{node.name}, not a tensor")
    return out

