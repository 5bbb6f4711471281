"""Einsums between activations as the batched matmuls they are, so analysis reads them with the rules it has
for ``q @ k.transpose(-2, -1)`` and ``attn @ v``: attention written as ``einsum('b h i d, b h j d -> b h i j',
q, k)`` and ``einsum('b h i j, b h j d -> b h i d', attn, v)``, with any letters, spaces, an ellipsis, heads
before or after the sequence, or a head dim only one operand has (multi-query: broadcast as a size-1 dim).

An einsum of two operands that contracts one letter, with one letter free in each operand (the matrix rows and
columns) and every other letter of the output a batch dim, is ``permute``/``unsqueeze`` of each operand,
``matmul``, and a ``permute`` to the output's order: the same values and gradients (torch's einsum computes
it as that bmm). Others (a letter summed in one operand only, several contracted letters, a vector operand)
are left as they are.

Before::

    scores = aten.einsum("bhid,bhjd->bhij", [q, k])

After::

    kt = aten.permute(k, [0, 1, 3, 2])      # (b, h, d, j)
    scores = aten.matmul(q, kt)             # (b, h, i, j)
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


def _tokens(term: str, ndim: int) -> list[str] | None:
    """An operand's subscripts as tokens, its ellipsis dims as ``#k`` counted from the right (as broadcasting
    aligns them); None where a letter repeats."""
    lead, _, rest = term.rpartition("...") if "..." in term else ("", "", term)
    if not rest.isalpha() and rest or lead and not lead.isalpha() or len(set(lead + rest)) != len(lead + rest):
        return None
    n_ell = ndim - len(lead) - len(rest) if "..." in term else 0
    if n_ell < 0:
        return None
    return [*lead, *(f"#{n_ell - 1 - i}" for i in range(n_ell)), *rest]


def _out_tokens(term: str, n_ell: int) -> list[str] | None:
    lead, _, rest = term.rpartition("...") if "..." in term else ("", "", term)
    if not rest.isalpha() and rest or lead and not lead.isalpha() or len(set(lead + rest)) != len(lead + rest):
        return None
    return [*lead, *(f"#{n_ell - 1 - i}" for i in range(n_ell if "..." in term else 0)), *rest]


def _call(gm: fx.GraphModule, op, args: tuple, meta: dict) -> fx.Node:
    node = gm.graph.call_function(op, args)
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    node.meta = {k: v for k, v in meta.items() if k not in ("val", "tensor_meta")}
    node.meta["val"] = op(*vals)  # on the captured fake tensors: shapes (symbolic ones too) and dtypes
    return node


def _arrange(gm: fx.GraphModule, x: fx.Node, have: list[str], want: list[str], meta: dict) -> fx.Node:
    """``x`` (dims named ``have``) permuted to the order of ``want``, a size-1 dim where it lacks a letter."""
    present = [t for t in want if t in have]
    perm = [have.index(t) for t in present]
    if perm != list(range(len(perm))):
        x = _call(gm, aten.permute.default, (x, perm), meta)
    for i, t in enumerate(want):
        if t not in have:
            x = _call(gm, aten.unsqueeze.default, (x, i), meta)
    return x


def einsums_as_batched_matmuls(gm: fx.GraphModule) -> bool:
    """Rewrite the einsums described in the module doc, in place; whether any was."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.target is not aten.einsum.default or not isinstance(node.args[0], str) or len(node.args[1]) != 2:
            continue
        eq = node.args[0].replace(" ", "")
        ops = node.args[1]
        vals = [o.meta.get("val") if isinstance(o, fx.Node) else None for o in ops]
        if "->" not in eq or eq.count(",") != 1 or not all(isinstance(v, torch.Tensor) for v in vals):
            continue
        ins, out = eq.split("->")
        a, b = (_tokens(t, v.dim()) for t, v in zip(ins.split(","), vals))
        if a is None or b is None:
            continue
        o = _out_tokens(out, max(sum(t.startswith("#") for t in s) for s in (a, b)))
        if o is None or any(t not in a and t not in b for t in o):
            continue
        contracted = [t for t in a if t in b and t not in o]
        if len(contracted) != 1 or any(t not in b and t not in o for t in a) or any(t not in a and t not in o for t in b):
            continue
        free_a = [t for t in o if t in a and t not in b]
        free_b = [t for t in o if t in b and t not in a]
        if not free_a or not free_b:
            continue
        row, col, k = free_a[-1], free_b[-1], contracted[0]
        batch = [t for t in o if t not in (row, col)]
        with gm.graph.inserting_before(node):
            x = _arrange(gm, ops[0], a, [*batch, row, k], node.meta)
            y = _arrange(gm, ops[1], b, [*batch, k, col], node.meta)
            mm = _call(gm, aten.matmul.default, (x, y), node.meta)
            have = [*batch, row, col]
            result = mm if have == o else _call(gm, aten.permute.default, (mm, [have.index(t) for t in o]), node.meta)
        node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
        changed = True
    return changed
