"""Each call of the model's own autograd Functions outlined again: the region the capture tagged as one call
of a custom ``torch.autograd.Function`` (:mod:`autotp.capture.functions`) becomes one call of a
:class:`~autotp.operators.functions.CustomFunction`, which runs ``Function.apply`` on the region's inputs, so
the gradient is the model's ``backward``, not the derivative of the ops its ``forward`` traced to.

Before (a straight-through rounding: forward ``round``, backward the identity)::

    alias = aten.alias.default(mul)       # tagged FunctionCall(RoundSTE), argument 0
    round = aten.round.default(alias)     # tagged FunctionCall(RoundSTE)
    alias_1 = aten.alias.default(round)   # tagged FunctionCall(RoundSTE), result 0
    div = aten.div.Tensor(alias_1, 4)

After::

    fn = call_module[autotp_function_0](mul)   # CustomFunction: RoundSTE.apply(mul)
    alias_1 = getitem(fn, 0)
    div = aten.div.Tensor(alias_1, 4)

Run on the bound graph, before the autocast and recomputation regions are outlined (see
:mod:`autotp.parallel.apply`), so a Function inside such a region stays inside it.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autotp.errors import CaptureError
from autotp.operators.functions import ARG, KEY, OUT, CustomFunction, FunctionCall, call_of
from autotp.passes.tagged_regions import outline, tagged_regions


def _function_module(call: FunctionCall, region: fx.GraphModule) -> CustomFunction:
    nodes = list(region.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    args: dict[int, int] = {}
    for n in nodes:
        k = (n.meta.get("custom") or {}).get(ARG)
        if k is not None and n.args and n.args[0] in placeholders:
            args[k] = placeholders.index(n.args[0])
    tensors = sum(x is None for x in call.flat)
    (output,) = [n for n in nodes if n.op == "output"]
    outs = [(o.meta.get("custom") or {}).get(OUT) if _is_out(o) else None for o in output.args[0]]
    if sorted(args) != list(range(tensors)) or any(o is None for o in outs):
        raise CaptureError(f"the custom autograd Function {call.name()} could not be kept: its forward's tensors "
                           "reach the rest of the graph other than through its arguments and results",
                           hint="return every tensor the rest of the forward reads from the Function")
    return CustomFunction(call, tuple(args[k] for k in range(tensors)), tuple(o.index for o in outs))


def _is_out(node: fx.Node) -> bool:
    """A result's marker itself: the passes copy a node's meta (tags included) onto what they insert after it."""
    return node.target is torch.ops.aten.alias.default and OUT in (node.meta.get("custom") or {})


def _spans(gm: fx.GraphModule):
    """The region tag of each node: its Function call, from the call's first node to its last result's marker
    (a collective the passes put after the marker copied its tags, and is not part of the call)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first: dict[FunctionCall, int] = {}
    last: dict[FunctionCall, int] = {}
    for n, i in order.items():
        call = call_of(n)
        if call is not None:
            first.setdefault(call, i)
            if _is_out(n) or call not in last:
                last[call] = i

    def tag_of(n: fx.Node) -> FunctionCall | None:
        call = call_of(n)
        return call if call is not None and first[call] <= order[n] <= last[call] else None

    return tag_of


def outline_functions(gm: fx.GraphModule) -> int:
    """Replace each custom Function region of ``gm``, and of every graph it was split into (FSDP units'
    pieces, pipeline stages), by a :class:`~autotp.operators.functions.CustomFunction` call; the number replaced. First of the outliners:
    a Function inside an autocast or checkpointed region stays inside it."""
    pieces = [m for m in gm.modules() if isinstance(m, fx.GraphModule) and m is not gm]
    n = 0
    for g in (gm, *pieces):
        found = tagged_regions(g, _spans(g))
        for k, nodes in enumerate(found):
            outline(g, nodes, f"autotp_function_{k}", lambda region, owners, call: _function_module(call, region), KEY)
        if found:
            g.graph.lint()
            g.recompile()
        n += len(found)
    return n
