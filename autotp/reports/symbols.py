"""Symbolic sizes in a Plan, read for one concrete batch.

Collective shapes in a Plan are strings of symbolic sizes (``("s95", "s75", "64")``, ``("s75*s95",)``):
export names the dynamic batch and sequence dims of the capture with its own symbols. They are mapped back
by position, which holds for every GPT-style graph autotp plans: a symbol that is the first dim of a 3-D
activation (``[b, s, h]``) is the batch, one that is the second dim is the sequence. The first
classification wins; a symbol neither way (an unbacked size, an unusual model) leaves the element count of
the collectives that use it unknown (``None``).
"""
from __future__ import annotations

import sympy
import torch

from autotp.plan.plan import Plan


def parse(text: str) -> sympy.Expr | None:
    factors = text.split("*")
    if all(f.isdigit() or f.isidentifier() for f in factors):  # "64", "s95", "s75*s95": most sizes, read directly
        return sympy.Mul(*(sympy.Integer(f) if f.isdigit() else sympy.Symbol(f) for f in factors))
    try:
        return sympy.sympify(text)
    except (sympy.SympifyError, TypeError, SyntaxError):
        return None


def symbol_roles(plan: Plan) -> dict[str, str]:
    """Capture symbol -> "b" or "s", from the dims of 3-D activations (see the module docstring)."""
    roles: dict[str, str] = {}
    for c in plan.collectives:
        if len(c.shape) != 3:
            continue
        for dim, role in ((0, "b"), (1, "s")):
            e = parse(c.shape[dim])
            for sym in sorted(e.free_symbols, key=str) if e is not None else ():
                roles.setdefault(str(sym), role)
    return roles


def captured(plan: Plan, dim: int) -> int | None:
    """A batch (dim 0) or sequence (dim 1) size export fixed to a number (it specialises size 1).

    Only when no 3-D activation keeps that dim symbolic: an LM head over the last position alone
    (``x[:, [-1]]``) has a sequence dim of 1 in a graph whose sequence is dynamic.
    """
    dims = [parse(c.shape[dim]) for c in plan.collectives if len(c.shape) == 3]
    if not dims or any(e is None or not e.is_Integer for e in dims):
        return None
    return int(dims[0])


def size_ranges(gm: torch.fx.GraphModule) -> dict[str, tuple[int, int | None]]:
    """The range export allows for each symbolic input size: symbol -> (low, high or None for unbounded).

    Read from the capture's shape environment; a model's own checks (``assert t <= block_size``) show up
    as an upper bound. Empty when the graph carries no shape environment.
    """
    out: dict[str, tuple[int, int | None]] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        for d in val.shape if isinstance(val, torch.Tensor) else ():
            if not isinstance(d, torch.SymInt) or not isinstance(d.node.expr, sympy.Symbol):
                continue
            vr = d.node.shape_env.var_to_range.get(d.node.expr)
            if vr is not None:
                out[str(d.node.expr)] = (_int(vr.lower) or 0, _int(vr.upper))
    return out


def _int(x) -> int | None:
    # int() of torch's int_oo fails inside sympy with an AttributeError: ask for a finite integer first
    return int(x) if getattr(x, "is_Integer", False) or isinstance(x, int) else None


def evaluate(text: str, values: dict[str, int]) -> int | None:
    e = parse(text)
    if e is None:
        return None
    v = e.subs({sympy.Symbol(k): n for k, n in values.items()})
    return int(v) if v.is_Integer else None


def display(shape: tuple[str, ...], roles: dict[str, str]) -> str:
    """``("s95", "s75", "64")`` -> ``"b×s×64"``."""
    out = []
    for text in shape:
        e = parse(text)
        if e is None:
            out.append(text)
            continue
        e = e.subs({sympy.Symbol(k): sympy.Symbol(r) for k, r in roles.items()})
        out.append(str(e).replace("*", "·"))
    return "×".join(out)


def elements(shape: tuple[str, ...], values: dict[str, int]) -> int | None:
    n = 1
    for text in shape:
        v = evaluate(text, values)
        if v is None:
            return None
        n *= v
    return n
