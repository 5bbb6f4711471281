"""Forward FLOPs of a captured graph's matmuls and attention, from the shapes export recorded.

Pipeline stages are balanced by the work they do: a GPT's work is its matmuls (2·m·k·n each) and its
attention (4·b·heads·s_q·s_k·d for scores and the weighted sum); norms, activations and adds are memory-bound
and left out, as in Megatron's and Narayanan et al.'s counts. A backward does twice a forward's matmul work,
so the forward count ranks stages as a training step does. Sizes export left symbolic count at the example
they were captured with.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

aten = torch.ops.aten


def _size(x: object) -> int:
    if isinstance(x, torch.SymInt):
        hint = x.node.hint
        return int(hint) if hint is not None else 1
    return int(x)


def _shape(node: object) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(_size(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def _contracted(node: fx.Node, operand: int = 0) -> int:
    shape = _shape(node.args[operand])
    return shape[-1] if shape else 0


def _matmul(node: fx.Node) -> int:
    out = _shape(node)
    return 2 * math.prod(out) * _contracted(node) if out else 0


def _attention(node: fx.Node) -> int:
    q, k = _shape(node.args[0]), _shape(node.args[1])
    if not q or not k:
        return 0
    # (b, heads, s_q, d) · (b, heads, s_k, d): scores and the weighted sum, 2·s_q·s_k·d each
    return 4 * math.prod(q[:-1]) * k[-2] * q[-1]


_RULES = {
    aten.linear.default: _matmul,
    aten.mm.default: _matmul,
    aten.bmm.default: _matmul,
    aten.matmul.default: _matmul,
    aten.addmm.default: lambda n: 2 * math.prod(_shape(n) or (0,)) * _contracted(n, 1),
    aten.baddbmm.default: lambda n: 2 * math.prod(_shape(n) or (0,)) * _contracted(n, 1),
    aten.scaled_dot_product_attention.default: _attention,
}


def node_flops(node: fx.Node) -> int:
    """The forward FLOPs of one node (0 for what is not a matmul or attention)."""
    rule = _RULES.get(node.target) if node.op == "call_function" else None
    return rule(node) if rule is not None else 0
