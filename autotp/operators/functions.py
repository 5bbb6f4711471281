"""The model's own autograd Functions kept: each region the capture tagged as one call of a custom
``torch.autograd.Function`` (:mod:`autotp.capture.functions`) runs as a :class:`CustomFunction` call of that
Function again (the region outlined by :mod:`autotp.passes.outline_functions`), so the gradient is the model's
``backward``, not the derivative of the ops its ``forward`` traced to. Here: the tags the capture writes
(:class:`FunctionCall`, the markers of a call's arguments and results) and the module that calls it again.

Analysis shards through such a region only where running the Function on random shards shows that its
forward and backward give each rank its shards (:mod:`autotp.analysis.function_rules`), and where nothing
has to be inserted inside it: the Function then runs on each rank's shards as it ran on whole tensors.
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten


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
