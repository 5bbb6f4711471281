"""Forward FLOPs of a captured graph's matmuls and attention, from the shapes export recorded.

Pipeline stages are balanced by the work they do: a GPT's work is its matmuls (2·m·k·n each) and its
attention (4·b·heads·s_q·s_k·d for scores and the weighted sum); norms, activations and adds are memory-bound
and left out, as in Megatron's and Narayanan et al.'s counts. A backward does twice a forward's matmul work,
so the forward count ranks stages as a training step does. Sizes export left symbolic count at the example
they were captured with, or at the sizes asked for.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.fx as fx

aten = torch.ops.aten


def _size(x: object, sizes: Mapping[str, int] | None = None) -> int:
    if isinstance(x, torch.SymInt):
        if sizes:  # the symbols given a value (a micro-batch's batch size), the rest at their hints
            expr = x.node.expr
            value = expr.subs({s: sizes[str(s)] for s in expr.free_symbols if str(s) in sizes})
            if value.is_Integer:
                return int(value)
        hint = x.node.hint
        return int(hint) if hint is not None else 1
    return int(x)


def shape_of(node: object, sizes: Mapping[str, int] | None = None) -> tuple[int, ...] | None:
    """The sizes of a node's tensor value: its symbols at ``sizes`` (symbol name -> size) where given, else at
    the example they were captured with; None for what is not a tensor."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(_size(s, sizes) for s in val.shape) if isinstance(val, torch.Tensor) else None


def _contracted(node: fx.Node, sizes: Mapping[str, int] | None, operand: int = 0) -> int:
    shape = shape_of(node.args[operand], sizes)
    return shape[-1] if shape else 0


def _matmul(node: fx.Node, sizes: Mapping[str, int] | None) -> int:
    out = shape_of(node, sizes)
    return 2 * math.prod(out) * _contracted(node, sizes) if out else 0


def _addmm(node: fx.Node, sizes: Mapping[str, int] | None) -> int:
    return 2 * math.prod(shape_of(node, sizes) or (0,)) * _contracted(node, sizes, 1)


def _attention(node: fx.Node, sizes: Mapping[str, int] | None) -> int:
    q, k = shape_of(node.args[0], sizes), shape_of(node.args[1], sizes)
    if not q or not k:
        return 0
    # (b, heads, s_q, d) · (b, heads, s_k, d): scores and the weighted sum, 2·s_q·s_k·d each
    return 4 * math.prod(q[:-1]) * k[-2] * q[-1]


_RULES = {
    aten.linear.default: _matmul,
    aten.mm.default: _matmul,
    aten.bmm.default: _matmul,
    aten.matmul.default: _matmul,
    aten.addmm.default: _addmm,
    aten.baddbmm.default: _addmm,
    aten.scaled_dot_product_attention.default: _attention,
}


def node_flops(node: fx.Node, sizes: Mapping[str, int] | None = None) -> int:
    """The forward FLOPs of one node (0 for what is not a matmul or attention); ``sizes``: values for some of
    the capture's symbols (by name), e.g. a micro-batch's batch size."""
    rule = _RULES.get(node.target) if node.op == "call_function" else None
    return rule(node, sizes) if rule is not None else 0
