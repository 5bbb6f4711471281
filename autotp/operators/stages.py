"""The modules ``torch.distributed.pipelining`` runs: one per pipeline stage of a split graph.

:func:`autotp.passes.split_stages` leaves a top graph that calls one piece per stage::

    x0, x1 = autotp_stage_0(idx)            # x1: e.g. a value of block 0 that block 3 reads too
    y0 = autotp_stage_1(x0, x1)
    loss = autotp_stage_2(y0, x1, targets)

A :class:`StageModule` runs one of those calls. A ``PipelineStage`` hands a stage only what the previous
stage returned, so every value computed before the cut and read after it (the hidden state; masks and rotary
tables are made again in each stage instead) is sent on by each stage in between; the graph's
own inputs (token ids, targets) reach every stage locally, as keyword arguments of the schedule's step
(``in0``, ``in1``, ...: the flat inputs), and are never sent. The last stage returns the loss, shape (1,).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn


STAGE_PREFIX = "autotp_stage_"  # the pieces split_stages puts on the top graph
ATTR = "attr:"  # a piece argument the top graph reads from itself (a buffer of the model, a constant)


@dataclass(frozen=True)
class Whole:
    """A step input that is not cut into micro-batches (its dim 0 is not the batch, e.g. position ids of
    shape (1, s)): the schedule hands every micro-batch all of it (it splits only tensors)."""

    tensor: torch.Tensor


def input_name(i: int) -> str:
    """The keyword a stage takes flat graph input ``i`` under."""
    return f"in{i}"


@dataclass(frozen=True)
class StageWiring:
    """Where each value of one stage call comes from and where its results go, by top-graph node name."""

    index: int
    piece: str  # the PieceCall's attribute on the top graph
    recv: tuple[str, ...]  # the values the previous stage sends, in order
    args: tuple[str, ...]  # the piece's arguments: received values, graph inputs ("in3"), buffers ("attr:...")
    results: tuple[str, ...]  # the piece's outputs (one name: the piece returns a single value)
    send: tuple[str, ...]  # what this stage returns: sent on, or (last stage) the loss


def wire_stages(top: fx.GraphModule, loss_index: int) -> tuple[StageWiring, ...]:
    """The wiring of every stage call of ``top``; the last stage returns flat output ``loss_index``."""
    inputs = {n: input_name(i) for i, n in enumerate(n for n in top.graph.nodes if n.op == "placeholder")}
    calls = [n for n in top.graph.nodes if n.op == "call_module" and str(n.target).startswith(STAGE_PREFIX)]
    made: dict[fx.Node, int] = {}  # value -> the stage that computes it
    results: dict[fx.Node, list[str]] = {}
    for s, call in enumerate(calls):
        getters = [u for u in call.users if u.op == "call_function" and u.target is operator.getitem]
        if getters and len(getters) == len(call.users):
            names = [""] * (max(int(u.args[1]) for u in getters) + 1)
            for u in getters:
                names[int(u.args[1])] = u.name
                made[u] = s
        else:
            names = [call.name]
            made[call] = s
        results[call] = names
    read: dict[str, set[int]] = {}  # value name -> the stages that read it
    for s, call in enumerate(calls):
        for a in call.args:
            if isinstance(a, fx.Node) and a in made:
                read.setdefault(a.name, set()).add(s)
    out = next(n for n in top.graph.nodes if n.op == "output").args[0]
    loss = out[loss_index] if isinstance(out, (tuple, list)) else out
    wirings, live = [], []
    for s, call in enumerate(calls):
        args = tuple(inputs[a] if a in inputs else ATTR + str(a.target) if a.op == "get_attr" else a.name
                     for a in call.args)
        recv = tuple(live)
        produced = [n for n in results[call] if n]
        last = s == len(calls) - 1
        live = [n for n in [*recv, *produced] if any(t > s for t in read.get(n, ()))]
        send = (loss.name,) if last else tuple(live)
        if last and loss.name not in {*recv, *produced}:
            raise ValueError(f"the loss ({loss.name}) is not computed by the last stage")
        wirings.append(StageWiring(s, str(call.target), recv, args, tuple(results[call]), send))
    return tuple(wirings)


class StageModule(nn.Module):
    """One pipeline stage: ``forward(*received, **inputs)`` runs the stage's piece and returns what the next
    stage needs (the last stage: the loss). ``held`` registers the parameters the piece reads (the model's
    own Parameter objects), so ``parameters()`` (the optimizer's, DDP's) are this stage's. ``keep``: (flat
    output, its value's name) of what the forward writes on the model that this stage computes: ``kept`` holds
    it per micro-batch, detached, until the step writes it back (:mod:`autotp.parallel.stage_writes`)."""

    def __init__(self, top: fx.GraphModule, wiring: StageWiring, held: list[nn.Parameter], last: bool,
                 keep: tuple[tuple[int, str], ...] = ()):
        super().__init__()
        self.last = last
        self.keep = keep
        self.__dict__["kept"] = {}  # flat output -> [its value on each micro-batch]
        # the split graph (its buffers are the model's) and this stage's piece: not submodules of this one
        self.__dict__["top"] = top
        self.__dict__["piece"] = top.get_submodule(wiring.piece)
        self.wiring = wiring
        self.held = nn.ParameterList(held)

    def forward(self, *received: torch.Tensor, **inputs: torch.Tensor):
        w = self.wiring
        env = dict(zip(w.recv, received))
        env.update((k, v.tensor if isinstance(v, Whole) else v) for k, v in inputs.items())
        out = self.piece(*(env[a] if not a.startswith(ATTR) else self._attr(a) for a in w.args))
        if len(w.results) == 1:
            env[w.results[0]] = out
        else:
            env.update((n, v) for n, v in zip(w.results, out) if n)
        for i, name in self.keep:
            self.kept.setdefault(i, []).append(env[name].detach())
        if self.last:  # (1,): the schedule concatenates the micro-batches' outputs, which a 0-dim loss cannot;
            # a copy, not a view: an FSDP root returning a view warns on every micro-batch (one element)
            return env[w.send[0]].reshape(1).clone()
        sent = tuple(env[n] for n in w.send)
        return sent[0] if len(sent) == 1 else sent

    def _attr(self, arg: str) -> torch.Tensor:
        path, _, leaf = arg.removeprefix(ATTR).rpartition(".")
        return getattr(self.top.get_submodule(path) if path else self.top, leaf)
