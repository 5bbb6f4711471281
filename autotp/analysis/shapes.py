"""Shapes of captured nodes as plain integers, and the dim grouping of a view.

Symbolic sizes (batch, sequence) are replaced by distinct large primes so that products of sizes can be
compared exactly: two products of dims are equal as numbers only when they are equal as symbols. A size the
graph divides (``s // 4``: a model that folds groups of 4 positions, ``view(b, s // 4, 4, d)``) gets its prime
times the divisors, so that the quotient times the divisor is the size again, as it is for every size the
model accepts.
"""
from __future__ import annotations

import math

import sympy
import torch
import torch.fx as fx
from torch.utils._sympy.functions import CleanDiv, FloorDiv, Mod, PythonMod

_PRIMES = [1_000_003, 1_000_033, 1_000_037, 1_000_039, 1_000_081, 1_000_099, 1_000_117, 1_000_121,
           1_000_133, 1_000_151, 1_000_159, 1_000_171, 1_000_183, 1_000_187, 1_000_193, 1_000_199]


class Fingerprinter:
    """Maps SymInts to exact integers, consistently within one graph (``gm``: read for the divisors of its
    sizes)."""

    def __init__(self, gm: fx.GraphModule | None = None) -> None:
        self._sym: dict[sympy.Symbol, int] = {}
        self._sizes: dict[sympy.Expr, int] = {}  # a deep graph asks for the same few sizes thousands of times
        self._divisors = _divisors(gm) if gm is not None else {}

    def size(self, s: int | torch.SymInt) -> int:
        if isinstance(s, int):
            return s
        expr = s.node.expr
        if isinstance(expr, sympy.Integer):
            return int(expr)
        known = self._sizes.get(expr)
        if known is not None:
            return known
        subs = {}
        for sym in sorted(expr.free_symbols, key=str):
            if sym not in self._sym:
                prime = _PRIMES[len(self._sym) % len(_PRIMES)] + 2 * (len(self._sym) // len(_PRIMES))
                self._sym[sym] = prime * self._divisors.get(sym, 1)
            subs[sym] = self._sym[sym]
        self._sizes[expr] = value = int(expr.subs(subs))
        return value

    def shape(self, node: fx.Node | torch.Tensor) -> list[int]:
        val = node.meta["val"] if isinstance(node, fx.Node) else node
        return [self.size(s) for s in val.shape]


def _divisors(gm: fx.GraphModule) -> dict[sympy.Symbol, int]:
    """{symbol: the least common multiple of the constants the graph's sizes divide it by} (``s // 4``,
    ``s % 4``, of the symbol itself)."""
    found: dict[sympy.Symbol, int] = {}
    exprs = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        sizes = val.shape if isinstance(val, torch.Tensor) else [val] if isinstance(val, torch.SymInt) else ()
        exprs.update(s.node.expr for s in sizes if isinstance(s, torch.SymInt))
    for expr in exprs:
        for atom in expr.atoms(FloorDiv, CleanDiv, Mod, PythonMod):
            base, divisor = atom.args
            if isinstance(base, sympy.Symbol) and isinstance(divisor, sympy.Integer) and int(divisor) > 1:
                found[base] = math.lcm(found.get(base, 1), int(divisor))
    return found


def is_static(s: object) -> bool:
    return isinstance(s, int) and not isinstance(s, bool)


def view_groups(src: list[int], dst: list[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of source and destination dims whose products are equal.

    ``[b, s, 64] -> [b, s, 4, 16]`` gives ``[([0],[0]), ([1],[1]), ([2],[2,3])]``. A size-1 dim on one side
    only joins the group after it (``[b, s, 16] -> [b, s, 1, 16]``: one head of 16), or the last group.
    """
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        while i < len(src) and src[i] == 1 and not (j < len(dst) and dst[j] == 1):
            gi.append(i); i += 1
        while j < len(dst) and dst[j] == 1 and not (i < len(src) and src[i] == 1):
            gj.append(j); j += 1
        if i >= len(src) and j >= len(dst):
            if groups:
                groups[-1][0].extend(gi); groups[-1][1].extend(gj)
            else:
                groups.append((gi, gj))
            break
        pi = pj = 1
        if i < len(src):
            gi.append(i); pi = src[i]; i += 1
        if j < len(dst):
            gj.append(j); pj = dst[j]; j += 1
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i); pi *= src[i]; i += 1
            elif j < len(dst):
                gj.append(j); pj *= dst[j]; j += 1
            else:
                raise ValueError(f"view {src} -> {dst} does not preserve the number of elements")
        groups.append((gi, gj))
    return groups


def normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim
