"""Attention written out by hand that is not SDPA's, run on a sequence chunk with its keys gathered.

A ring needs scores that SDPA computes: ``softmax(q·kᵀ·c + causal mask)``. Public model code adds other
things to the scores — a bias of distances (ALiBi), a sliding-window mask, tanh soft-capping (Gemma-2)::

    att = q @ k.transpose(-2, -1) / math.sqrt(d)                  # (b, h, s, s)
    att = att + slopes[:, None, None] * (pos[None, :] - pos[:, None])
    att = torch.tanh(att / 50.0) * 50.0
    y = att.masked_fill(~window_mask, float("-inf")).softmax(-1) @ v

Every op between the q·kᵀ matmul and the ·v matmul treats each query row alone, given the row's whole set of
keys. So with the keys (kᵀ, as the scores' matmul reads it) and values (as the ·v matmul reads them)
gathered whole over the cp group, in sequence order, the chunk's rows of the scores are exactly the one
device's rows: the chain runs as written on (b, h, s/cp, s). What else the scores read is computed from
positions and the whole inputs (sizes, constants, buffers, parameters, a padding mask: never random) — is
computed at the whole length, as every rank has the inputs whole, and this rank's rows taken. The same holds
for ``scaled_dot_product_attention`` given a mask that is not causal (:func:`keyed_sdpa`).

The region between the two matmuls may hold pointwise ops (with the scores, or with values without the
sequence: slopes, scalars), casts, and a softmax over the keys; its values must be read by nothing else
(probabilities the model also returns are named), and a mask or bias made from positions by nothing but
attentions run this way (Hugging Face makes one mask for every layer: the caller checks them together).
Read-only: facts by node name; the context pass rewrites.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import sympy
import torch
import torch.fx as fx

from autotp.analysis.op_rules import op_rule
from autotp.analysis.ops import is_random

aten = torch.ops.aten

# ops on each element alone, and values made in the scores' shape (``full_like(att, -inf)``)
_REGION_KINDS = frozenset({"pointwise", "same_shape", "like"})
_REGION_OPS = (aten.masked_fill.Tensor,)  # a fill value given as a tensor (``torch.tensor(-inf)``)
# what a mask or bias computed whole may not hold: the model's own layers (they run on the chunk)
_LAYER_KINDS = frozenset({"matmul", "baddbmm", "sdpa", "conv", "norm", "cross_entropy", "nll_loss"})
_LAYER_OPS = (aten.linear.default, aten.embedding.default, aten.mm.default, aten.addmm.default,
              aten.einsum.default, aten._embedding_bag.default)


@dataclass(frozen=True)
class Keyed:
    """An attention whose keys and values are gathered whole: ``scores`` the q·kᵀ matmul, ``out`` the ·v
    matmul, ``keys`` (operand, its sequence dim) gathered over the group, ``rows`` values made from positions
    that the scores read (node, the query dim or None where it has only the keys'), computed at the whole
    length by ``whole`` (those nodes, in graph order) and cut to this rank's query rows."""

    scores: str
    out: str
    keys: tuple[tuple[str, int], ...]
    rows: tuple[tuple[str, int | None], ...]
    whole: tuple[str, ...]
    region: tuple[str, ...]  # the ops on the scores between the two matmuls
    # per key: the ops from the gathered value to the attention's operand (grouped-query heads repeated
    # after the gather, so only the kv heads travel), and those of them whose size at ``dim`` becomes -1
    spans: tuple[tuple[str, ...], ...] = ((), ())
    widen: tuple[tuple[str, int], ...] = ()


def symbols(size: object) -> set:
    """The size symbols a (symbolic) size is made of."""
    return set(size.node.expr.free_symbols) if isinstance(size, torch.SymInt) else set()


def seq_dims(node: object, s: sympy.Symbol) -> list[int]:
    """The dims of ``node``'s value whose size involves the sequence length ``s``."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return []
    return [i for i, size in enumerate(val.shape) if s in symbols(size)]



def _rank(node: object) -> int:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else -1


def _is_scores(node: fx.Node, s: sympy.Symbol) -> bool:
    """q·kᵀ: a 4-D matmul of (b, h, s, d) by (b, h, d, s)."""
    return node.op == "call_function" and node.target is aten.matmul.default and _rank(node) == 4 and \
        seq_dims(node.args[0], s) == [2] and seq_dims(node.args[1], s) == [3] and seq_dims(node, s) == [2, 3]


def _in_region(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in _REGION_OPS:
        return True
    rule = op_rule(node.target)
    if rule is None:
        return False
    if rule.kind == "softmax":  # over the keys only: the last dim
        return node.args[1] in (-1, _rank(node.args[0]) - 1)
    return rule.kind in _REGION_KINDS


def computable_whole(node: fx.Node, inputs: set[str]) -> tuple[list[fx.Node], str]:
    """(the nodes computing ``node``, in graph order; '') where it is made from the whole inputs that carry
    the sequence (a padding mask), their sizes, constants, buffers and parameters alone; ([], why) where it
    reads another input, a size of anything but an input, or random numbers."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if n.name in inputs:
                continue  # the whole input, as every rank has it (ids, a padding mask)
            return [], f"it reads the input {n.name}, which does not carry the sequence"
        if n.op == "get_attr":
            continue
        if n.op != "call_function":
            return [], f"it reads {n.op} {n.target}"
        rule = op_rule(n.target)
        if n.target in _LAYER_OPS or rule is not None and rule.kind in _LAYER_KINDS:
            return [], f"it runs a layer of the model ({n.target})"
        if rule is not None and rule.kind == "sym_size":
            if not (isinstance(n.args[0], fx.Node) and n.args[0].name in inputs):
                return [], f"it reads a size of {n.args[0]}, not of an input"
            continue  # the whole length: read off the whole input
        if rule is not None and is_random(n, rule):
            return [], f"it draws random numbers ({n.target})"
        todo += n.all_input_nodes
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    made = sorted((n for n in seen if n.op == "call_function" and not (
        op_rule(n.target) is not None and op_rule(n.target).kind == "sym_size")), key=order.__getitem__)
    return made, ""


_MOVES = (aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.clone.default)
_SIZED = (aten.expand.default, aten.reshape.default, aten.view.default, aten._unsafe_view.default)


class _Gathered(NamedTuple):
    node: fx.Node  # what is gathered
    dim: int  # its sequence dim
    span: tuple[str, ...]  # the ops from it to the attention's operand, first to last
    widen: tuple[tuple[str, int], ...]  # of them, those whose size at the sequence dim becomes -1 (whole)


def _before_repeat(x: fx.Node, s: sympy.Symbol) -> _Gathered:
    """Where to gather the attention's operand ``x``: before the grouped-query heads are repeated
    (``k[:, :, None].expand(b, kv, n, s, d).reshape(b, h, s, d)``, Hugging Face's ``repeat_kv``), so that only
    the kv heads travel; ``x`` itself where nothing is repeated. Each op on the way is read by the next
    alone (gathering earlier changes no other reader), and keeps one sequence dim."""
    chain, n = [], x
    while n.op == "call_function" and n.target in _MOVES + _SIZED and len(n.users) == 1 \
            and isinstance(n.args[0], fx.Node) and len(seq_dims(n.args[0], s)) == 1 and len(seq_dims(n, s)) == 1:
        if n.target in _SIZED[1:] and -1 in list(n.args[1]):
            break  # a view that infers a size already: its sequence size cannot be left to it
        chain.append(n)
        n = n.args[0]
    if not any(c.target is aten.expand.default for c in chain):
        return _Gathered(x, seq_dims(x, s)[0], (), ())
    return _Gathered(n, seq_dims(n, s)[0], tuple(c.name for c in reversed(chain)),
                     tuple((c.name, seq_dims(c, s)[0]) for c in reversed(chain) if c.target in _SIZED))


def _keys(k: fx.Node, v: fx.Node, s: sympy.Symbol) -> dict:
    """The ``keys``, ``spans`` and ``widen`` of a :class:`Keyed` gathering ``k`` and ``v``."""
    gk, gv = _before_repeat(k, s), _before_repeat(v, s)
    return {"keys": ((gk.node.name, gk.dim), (gv.node.name, gv.dim)), "spans": (gk.span, gv.span),
            "widen": gk.widen + gv.widen}


def keyed_sdpa(node: fx.Node, mask: fx.Node, s: sympy.Symbol, inputs: set[str]) -> Keyed | None:
    """``scaled_dot_product_attention(q, k, v, attn_mask=mask)`` with a mask that is not causal (a padding
    mask, a sliding window): k and v gathered, the mask computed whole and cut to the query rows; None where
    the mask cannot be computed whole."""
    q, k, v = node.args[:3]
    if not all(seq_dims(x, s) == [2] and _rank(x) == 4 for x in (q, k, v)):
        return None
    made, why = computable_whole(mask, inputs)
    r, dims = _rank(mask), seq_dims(mask, s)
    if why or not set(dims) <= {r - 2, r - 1}:
        return None
    keys = _keys(k, v, s)
    return Keyed(node.name, node.name, keys["keys"], ((mask.name, r - 2 if r - 2 in dims else None),),
                 tuple(n.name for n in made), (node.name,), keys["spans"], keys["widen"])


def keyed_attention(out: fx.Node, s: sympy.Symbol, inputs: set[str]) -> tuple[Keyed | None, str]:
    """The attention whose ·v matmul is ``out``, run with its keys gathered; (None, why) where it cannot."""
    if out.op != "call_function" or out.target is not aten.matmul.default or _rank(out) != 4 \
            or seq_dims(out, s) != [2]:
        return None, ""
    probs, v = out.args[0], out.args[1]
    if seq_dims(probs, s) != [2, 3] or seq_dims(v, s) != [2] or _rank(v) != 4:
        return None, ""
    region: list[fx.Node] = []
    rows: list[tuple[fx.Node, int | None]] = []
    scores, todo, seen = None, [probs], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if _is_scores(n, s):
            if scores is not None:
                return None, "the scores come from two q·kᵀ matmuls"
            scores = n
            continue
        if not _in_region(n):
            return None, f"{n.target} on the scores: not an op on each query row alone"
        region.append(n)
        for a in n.all_input_nodes:
            dims = seq_dims(a, s)
            if not dims:
                continue  # no sequence dim: slopes, scalars
            made, why = computable_whole(a, inputs)
            if not why:
                r = _rank(a)
                if not set(dims) <= {r - 2, r - 1}:
                    return None, f"{a.name}, added to the scores, has the sequence in dims {dims}"
                rows.append((a, r - 2 if r - 2 in dims else None))
            elif seq_dims(a, s) == [2, 3] and _rank(a) == 4:
                todo.append(a)  # the scores, further up
            else:
                return None, f"the scores read {a.name}, which is neither the scores nor made from positions: {why}"
    if scores is None:
        return None, "no q·kᵀ matmul feeds the softmax"
    inside = set(region) | {scores}
    for n in region:
        if any(u not in inside and u is not out for u in n.users):
            return None, f"{n.name} (the scores or probabilities) is also read outside the attention"
    if any(u not in inside for u in scores.users):
        return None, "the scores are also read outside the attention"
    whole: list[fx.Node] = []
    for a, _ in rows:
        whole += [m for m in computable_whole(a, inputs)[0] if m not in whole]
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    keys = _keys(scores.args[1], v, s)
    return Keyed(scores.name, out.name, keys["keys"],
                 tuple((a.name, d) for a, d in rows), tuple(n.name for n in sorted(whole, key=order.__getitem__)),
                 tuple(n.name for n in sorted(region, key=order.__getitem__)), keys["spans"], keys["widen"]), ""
