"""The sharding rule of ``torch.einsum`` with any number of operands, read from its subscripts.

DTensor's einsum strategy (``torch.distributed.tensor._ops._einsum_strategy``) places two operands at most, and
``aten.einsum`` reaches DTensor only decomposed; the rule it applies per letter holds for any count:

- a letter sharded in one operand and kept in the output: the output is sharded on it, every other operand
  that has the letter is read as its shard (Replicate -> Shard, a local slice) and one that lacks it is
  broadcast whole; Mamba's discretisation ``einsum('bld,dn->bldn', Δ, A)`` and
  ``einsum('bld,bln,bld->bldn', Δ, B, x)`` with the channels ``d`` cut;
- a letter the output drops is contracted: each rank's sum is partial, refused here (a reducing projection of
  a channel-cut value is a parameter matmul, which :mod:`autotp.analysis.pairs` makes row-parallel).
"""
from __future__ import annotations

import torch.fx as fx

from autotp.analysis.op_rules import OpRule, kind_of
from autotp.analysis.ops import Unshardable, ndim_of
from autotp.analysis.pair_region import OperandSlice, ParamCut
from autotp.shard_spec import Sharding


def subscripts(equation: str, ndims: list[int]) -> tuple[list[list[str]], list[str]] | None:
    """Each operand's subscripts and the output's, one token a dim (an ellipsis's dims as ``#k`` counted from
    the right, as broadcasting aligns them); None where the equation is not one this rule reads."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        return None
    ins, n_ell = [], 0
    for term, nd in zip(terms, ndims):
        head, ell, tail = term.partition("...")
        n = nd - len(head) - len(tail) if ell else 0
        if not (head + tail).isalpha() and head + tail or n < 0 or (not ell and len(term) != nd):
            return None
        n_ell = max(n_ell, n)
        ins.append([*head, *(f"#{n - 1 - i}" for i in range(n)), *tail])
    if not arrow:  # implicit output: the ellipsis, then the letters used once, in alphabetical order
        letters = [t for tokens in ins for t in tokens if not t.startswith("#")]
        rhs = "..." * bool(n_ell) + "".join(sorted(t for t in set(letters) if letters.count(t) == 1))
    head, ell, tail = rhs.partition("...")
    if not (head + tail).isalpha() and head + tail:
        return None
    return ins, [*head, *(f"#{n_ell - 1 - i}" for i in range(n_ell if ell else 0)), *tail]


class EinsumRules:
    """The einsum handler of :class:`~autotp.analysis.propagate.Propagator`."""

    def _on_einsum(self, node: fx.Node, rule: OpRule) -> Sharding:
        equation, operands = node.args[0], list(node.args[1])
        parsed = subscripts(equation, [ndim_of(x) for x in operands]) if isinstance(equation, str) else None
        if parsed is None:
            raise Unshardable(node, f"einsum {equation!r} is not read by autotp's einsum rule")
        ins, out = parsed
        cut = {}  # the sharded operands' letter on their sharded dim
        for x, tokens in zip(operands, ins):
            s = self.spec(x)
            if s is not None:
                if s.inner or s.outer or s.group:
                    raise Unshardable(node, f"einsum {equation!r} reads {x.name} laid out in a way its rule does "
                                            "not describe")
                cut[x] = (tokens[s.dim], s)
        (letter, s), *rest = cut.values()
        if any(t != letter or o.segments != s.segments for t, o in rest):
            raise Unshardable(node, f"einsum {equation!r} reads operands sharded on different letters")
        if letter not in out:
            raise Unshardable(node, f"einsum {equation!r} contracts the sharded letter {letter!r}: each rank's sum "
                                    "would be partial")
        result = s.moved(out.index(letter))
        full = sum(g.size for g in s.segments)
        for x, tokens in zip(operands, ins):
            if x in cut or not isinstance(x, fx.Node):
                continue
            xd = tokens.index(letter) if letter in tokens else None
            if xd is None or self.fp.shape(x)[xd] == 1:
                self._enter_if_learned(node, x)  # broadcast whole: a learned one's gradient is partial
            elif self.fp.shape(x)[xd] != full:
                raise Unshardable(node, f"einsum {equation!r}: {x.name} spans the sharded letter with another size")
            else:
                self._operand_shard(node, x, xd, s.moved(xd))
        return result

    def _operand_shard(self, node: fx.Node, x: fx.Node, xd: int, s: Sharding) -> None:
        """A replicated operand that has the sharded letter on its dim ``xd``: a parameter (or one computed from
        a parameter by elementwise ops alone, ``-exp(A_log)``) is cut with the channels, a constant-filled
        tensor made local-sized, any other value that needs no gradient sliced where it is read."""
        if self._parameter(x) is not None and len(x.users) == 1:
            self.region.params.append(ParamCut(x, xd, s))
        elif self.elementwise_parameter(x, s) or self.viewed_parameter(x, s):
            return
        elif kind_of(x.target) == "factory" and len(x.users) == 1:
            self._set_view_size(x, list(x.args[0]), xd, sum(g.size for g in s.segments), s.local_size, arg=0)
        elif self._learned(x):
            raise Unshardable(node, f"replicated operand {x.name} spans the sharded letter and depends on a "
                                    "parameter")
        else:
            self.region.slices.append(OperandSlice(node, x, xd, s))
