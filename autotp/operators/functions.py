"""The model's own autograd Functions kept: each region the capture tagged as one call of a custom
``torch.autograd.Function`` (:mod:`autotp.capture.functions`) runs as a call of that Function again, so the
gradient is the model's ``backward``, not the derivative of the ops its ``forward`` traced to.

Before (a straight-through rounding: forward ``round``, backward the identity)::

    alias = aten.alias.default(mul)       # tagged FunctionCall(RoundSTE), argument 0
    round = aten.round.default(alias)     # tagged FunctionCall(RoundSTE)
    alias_1 = aten.alias.default(round)   # tagged FunctionCall(RoundSTE), result 0
    div = aten.div.Tensor(alias_1, 4)

After::

    fn = call_module[autotp_function_0](mul)   # CustomFunction: RoundSTE.apply(mul)
    alias_1 = getitem(fn, 0)
    div = aten.div.Tensor(alias_1, 4)

Analysis shards through such a region only where running the Function on random shards shows that its
forward and backward give each rank its shards (:mod:`autotp.analysis.function_rules`), and where nothing
has to be inserted inside it: the Function then runs on each rank's shards as it ran on whole tensors.
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from autotp.errors import CaptureError
from autotp.operators.regions import outline, regions

KEY = "autotp_function"  # node.meta["custom"][KEY]: the FunctionCall whose forward made the node
ARG = "autotp_function_arg"  # on the alias a tensor argument enters through: its position among the tensors
OUT = "autotp_function_out"  # on the alias a tensor result leaves through: an Out


class FunctionCall(NamedTuple):
    """One call of a custom autograd Function: the class, the call's flattened arguments (None where a tensor
    goes, the value itself otherwise) and their structure, and which call it was (``id``)."""

    function: type
    flat: tuple
    spec: TreeSpec
    id: Hashable

    def renamed(self, block: str) -> FunctionCall:
        """The call in a copied block: numbered apart from the block it was copied from."""
        return self._replace(id=(self.id, block))

    def name(self) -> str:
        return f"{self.function.__module__}.{self.function.__qualname__}"


class Out(NamedTuple):
    """A tensor result of a call: its position among the flattened results, and their structure."""

    index: int
    count: int
    spec: TreeSpec


def call_of(node: object) -> FunctionCall | None:
    """The custom Function call whose forward made ``node`` (None: outside any)."""
    custom = getattr(node, "meta", {}).get("custom")
    found = custom.get(KEY) if isinstance(custom, dict) else None
    return found if isinstance(found, FunctionCall) else None


def is_marker(node: object) -> bool:
    """Is ``node`` the alias a custom Function's tensor argument enters, or its result leaves, through?"""
    custom = getattr(node, "meta", {}).get("custom")
    return isinstance(custom, dict) and (ARG in custom or OUT in custom)


def _custom(node: object) -> dict:
    custom = getattr(node, "meta", {}).get("custom")
    return custom if isinstance(custom, dict) else {}


def arg_index(node: object) -> int | None:
    """The position among a call's tensor arguments of the one ``node`` marks the entry of (None: no marker)."""
    return _custom(node).get(ARG) if getattr(node, "target", None) is torch.ops.aten.alias.default else None


def is_result(node: object) -> bool:
    """Is ``node`` the marker a call's tensor result leaves through (not a node the passes copied its tags to)?"""
    return getattr(node, "target", None) is torch.ops.aten.alias.default and isinstance(_custom(node).get(OUT), Out)


def result_index(node: object) -> int:
    return _custom(node)[OUT].index


def result_count(node: object) -> int:
    return _custom(node)[OUT].count


class CustomFunction(nn.Module):
    """``call.function.apply`` on the region's inputs: ``args[i]`` is the input feeding the call's i-th tensor
    argument; the results ``outs`` (positions among the flattened results) are returned in the region's
    output order."""

    def __init__(self, call: FunctionCall, args: tuple[int, ...], outs: tuple[int, ...]) -> None:
        super().__init__()
        self.call, self.args, self.outs = call, args, outs

    def forward(self, *inputs):
        tensors = iter(inputs[i] for i in self.args)
        flat = [next(tensors) if x is None else x for x in self.call.flat]
        args, kwargs = tree_unflatten(flat, self.call.spec)
        results = tree_flatten(self.call.function.apply(*args, **kwargs))[0]
        return tuple(results[j] for j in self.outs)


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
    pieces, pipeline stages), by a :class:`CustomFunction` call; the number replaced. First of the outliners:
    a Function inside an autocast or checkpointed region stays inside it."""
    pieces = [m for m in gm.modules() if isinstance(m, fx.GraphModule) and m is not gm]
    n = 0
    for g in (gm, *pieces):
        found = regions(g, _spans(g))
        for k, nodes in enumerate(found):
            outline(g, nodes, f"autotp_function_{k}", lambda region, owners, call: _function_module(call, region), KEY)
        if found:
            g.graph.lint()
            g.recompile()
        n += len(found)
    return n
