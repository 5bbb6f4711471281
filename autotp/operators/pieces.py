"""Pieces of a split graph, each run as one call: an FSDP unit's piece through the unit's forward.

FSDP gathers a ``fully_shard``-ed module's parameters when that module's forward runs, and from the
forward's inputs and outputs it knows when the module's backward starts and ends. A rewritten graph calls no
module of the user's, so :func:`autotp.passes.split_units` cuts it into pieces, one per unit (a transformer
block) and one per stretch of root-level code between them, and puts a :class:`PieceCall` where each piece
was. When it runs, a unit's piece goes through the unit's registered FSDP forward method (``run_unit``, see
``torch.distributed.fsdp.register_fsdp_forward_method``), so FSDP gathers the block's parameters just before
it and frees them after (and again around its backward) exactly as it would around the block's own forward.

A piece reads its parameters from the model at the moment it runs (FSDP swaps the gathered parameters into
the modules and the sharded ones back), never from references kept in the graph: a reference kept across
calls would hold either a stale tensor or the whole unsharded parameter. Parameters that are DTensors on
the tensor-parallel mesh (as :mod:`autotp.parallel.fsdp` makes them) run as their local shards.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor

UNIT_METHOD = "_autotp_unit"  # the name the unit's FSDP forward method is registered under


def run_unit(self: nn.Module, fn: Callable, *args):
    """A unit's forward method for FSDP: runs one of its graph pieces (``fn``) on ``args``."""
    return fn(*args)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class PieceCall(nn.Module):
    """One piece of a split graph. ``inputs`` says what each of the piece's inputs is, in order: an index into
    this call's arguments, or the name of a parameter read from the bound model when the piece runs."""

    def __init__(self, piece: fx.GraphModule, unit: str | None, inputs: tuple[int | str, ...]):
        super().__init__()
        self.piece = piece
        self.unit = unit  # the unit's module path; None for root-level code
        self.inputs = inputs
        # (the unit module or None, each parameter's (owner module, attribute)); not registered as submodules
        self.__dict__["_bound"] = None

    def bind(self, model: nn.Module) -> None:
        owners = {}
        for name in self.inputs:
            if isinstance(name, str):
                path, _, leaf = name.rpartition(".")
                owners[name] = (model.get_submodule(path), leaf)
        unit = model.get_submodule(self.unit) if self.unit is not None else None
        self.__dict__["_bound"] = (unit, owners)

    def owners(self) -> list[tuple[nn.Module, str]]:
        """(module, attribute) of each parameter the piece reads, once bound."""
        return list(self._bound[1].values()) if self._bound is not None else []

    def forward(self, *args):
        if self._bound is None:
            raise RuntimeError("a graph piece ran before bind_pieces() bound it to its model")
        unit = self._bound[0]
        method = None if unit is None else unit.__dict__.get(UNIT_METHOD)
        return self._run(*args) if method is None else method(self._run, *args)

    def _run(self, *args):
        owners = self._bound[1]
        if isinstance(self.piece, fx.GraphModule):  # eager: each parameter made local where it is first read
            values = [args[x] if isinstance(x, int) else owners[x][0]._parameters[owners[x][1]] for x in self.inputs]
            return self._lazy_locals()(*values)
        values = [args[x] if isinstance(x, int) else _local(owners[x][0]._parameters[owners[x][1]])
                  for x in self.inputs]
        return self.piece(*values)

    def _lazy_locals(self) -> fx.GraphModule:
        """The piece taking the parameters themselves, each made its local shard just before its first reader.

        Autograd runs the ready node created last first: ``to_local`` of every parameter called before the
        piece would run its backward only after the piece's whole backward, holding every parameter's
        gradient at once (a whole FSDP unit's, a pipeline stage's) until each reaches ``.grad``; made just
        before its reader, each gradient is accumulated as soon as it is computed."""
        lazy = self.__dict__.get("_lazy")
        if lazy is None or lazy[0] is not self.piece:
            lazy = (self.piece, _with_lazy_locals(self.piece, self.inputs))
            self.__dict__["_lazy"] = lazy
        return lazy[1]


def _with_lazy_locals(piece: fx.GraphModule, inputs: tuple[int | str, ...]) -> fx.GraphModule:
    """A copy of ``piece`` whose parameter inputs (``inputs``' names) may be DTensors: each is made its local
    tensor right before the first node that reads it."""
    gm = fx.GraphModule(piece, copy_graph(piece.graph))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, what in zip(placeholders, inputs):
        if not isinstance(what, str) or not node.users:
            continue
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        first = min(node.users, key=order.__getitem__)
        with gm.graph.inserting_before(first):
            local = gm.graph.call_function(_local, (node,))
        node.replace_all_uses_with(local, delete_user_cb=lambda user: user is not local)
    gm.recompile()
    return gm


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` (its nodes' meta shared, not copied)."""
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def bind_pieces(gm: nn.Module, model: nn.Module) -> None:
    """Point every :class:`PieceCall` of ``gm`` at ``model``'s modules."""
    for m in gm.modules():
        if isinstance(m, PieceCall):
            m.bind(model)
