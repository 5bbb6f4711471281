"""The state a pipelined model's forward writes, handed back to the user's model after each step.

One device runs the forward once on the whole batch; a pipeline runs each stage's piece once per
micro-batch, on the rank that holds the stage. A written value (``self.last_loss = loss``, a rotary cache
built on first use, a call counter) is a flat output of the captured graph (:mod:`autotp.capture.writes`),
computed by one stage: that stage keeps what it computes on each micro-batch
(:class:`~autotp.operators.stages.StageModule`), and after the step its rank writes the whole batch's value
on its model, as :func:`autotp.parallel.writeback.write_back` writes a parallelized model's:

* a value computed from no micro-batched input (a cache, a counter, a table from the sizes) is the same on
  every micro-batch: the last one's;
* the loss (the graph's loss output, or a 0-dim loss kept on the model) is the step's own loss, the mean of
  the micro-batches' (each a mean over its tokens), which every pipeline rank has: every rank writes it;
* a value with the micro-batch as its first dim (the last logits, a per-sample statistic) is the
  micro-batches' values concatenated: the whole batch's, as the pipeline's own micro-batching assumes
  samples are independent;
* a graph input written on the model (``self.last_idx = idx``) is the step's whole input;
* any other value computed from the micro-batch (a mean over the batch kept on the model) has no
  whole-batch value here: it is named once, and not written.

Any other value is held by the rank whose stage computes it (a rotary cache built before the first block:
the first stage's ranks); a piece of state written from values of stages on two pipeline ranks is named. Values are kept detached: the step has run their backward already.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from autotp.capture.structure import Spec
from autotp.capture.writes import Write, Writes
from autotp.parallel.writeback import write_back

__all__ = ["OUTPUT_INPUTS", "StageWrites", "mark_outputs", "output_facts", "output_inputs", "output_stages",
           "stage_writes", "written_loss"]

OUTPUT_INPUTS = "autotp_output_inputs"  # the split graph's ``meta`` entry: :func:`output_inputs` of the whole one


def output_inputs(gm: fx.GraphModule) -> tuple[frozenset[int], ...]:
    """For each flat output of ``gm``, the flat inputs (placeholder indices) its value is computed from. A
    size read off an input's dim other than 0 (``x.shape[1]``: the sequence, the same in every micro-batch)
    is not counted; dim 0 is the micro-batch's own size."""
    index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    deps: dict[fx.Node, frozenset[int]] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            deps[node] = frozenset((index[node],))
        elif node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
            return tuple(deps.get(o, frozenset()) if isinstance(o, fx.Node) else frozenset() for o in outs)
        elif node.target is torch.ops.aten.sym_size.int and node.args[1] != 0:
            deps[node] = frozenset()
        else:
            deps[node] = frozenset().union(*(deps.get(a, frozenset()) for a in node.all_input_nodes))
    return ()


def output_facts(gm: fx.GraphModule) -> tuple[tuple[frozenset[int], ...], tuple[object, ...]]:
    """What the pipeline needs of ``gm``'s flat outputs, read before the graph is cut into stages (the cut
    graph's outputs are results of the stages' pieces, with neither): :func:`output_inputs` and their values
    as captured (``meta["val"]``: shapes and dtypes)."""
    return output_inputs(gm), tuple(o.meta.get("val") if isinstance(o, fx.Node) else None for o in _outputs(gm))


def mark_outputs(top: fx.GraphModule, facts: tuple[tuple[frozenset[int], ...], tuple[object, ...]]) -> None:
    """Put :func:`output_facts` of the whole graph on the cut one ``top`` (its meta, its output nodes')."""
    sources, vals = facts
    top.meta[OUTPUT_INPUTS] = sources
    for node, val in zip(_outputs(top), vals):
        if isinstance(node, fx.Node) and val is not None:
            node.meta.setdefault("val", val)


def _outputs(top: fx.GraphModule) -> list[object]:
    out = next(n for n in top.graph.nodes if n.op == "output").args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def written_loss(top: fx.GraphModule, writes: Writes | None) -> int | None:
    """The flat output of a 0-dim floating tensor computed from the inputs that the forward keeps on the model
    as an attribute (llama2.c's ``self.last_loss = F.cross_entropy(...)``, the forward returning only
    logits), when there is exactly one: the loss the last stage ends in. None otherwise."""
    if not writes:
        return None
    outs = _outputs(top)
    sources = top.meta.get(OUTPUT_INPUTS)
    found = []
    for w in writes.items:
        if w.kind != "attr" or w.value is None or w.value.kind != "tensor":
            continue
        i = w.value.value
        val = outs[i].meta.get("val") if isinstance(outs[i], fx.Node) else None
        # computed from the inputs: not a count or a flag the forward keeps as a 0-dim tensor
        if isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point() and \
                (sources is None or sources[i]):
            found.append(i)
    return found[0] if len(found) == 1 else None


def _leaves(spec: Spec | None) -> list[int]:
    """The flat output indices a written value reads ("tensor" and "size" leaves)."""
    if spec is None:
        return []
    if spec.kind in ("tensor", "size"):
        return [spec.value]
    return [i for c in spec.children for i in _leaves(c)]


@dataclass(frozen=True)
class StageWrites:
    """How a pipeline writes back what its forward writes. ``how``: per written flat output, "same", "batch"
    (computed from the micro-batched inputs), ("loss", dtype) or ("input", i) (flat input i itself);
    ``owner``: the stage computing each (None: an input, read from the step's own). ``writes``: the
    captured graph's :class:`Writes`."""

    writes: Writes
    how: tuple[tuple[int, object], ...]
    owner: tuple[tuple[int, int | None], ...]

    def keep(self, stage: int) -> tuple[int, ...]:
        """The flat outputs stage ``stage`` keeps on each micro-batch."""
        return tuple(i for i, s in self.owner if s == stage)

    def write(self, model: torch.nn.Module, kept: dict[int, list[torch.Tensor]], stages: Sequence[int],
              inputs: Sequence[object], loss: torch.Tensor, microbatches: int, graphs: list, warned: set) -> None:
        """Write on ``model`` what this rank's ``stages`` computed (``kept``: flat output -> its value on each
        micro-batch, in order); ``inputs``: the step's whole flat inputs; ``loss``: the step's loss, which every
        pipeline rank has (the mean of the micro-batches' losses), so every rank writes the loss."""
        how, owner = dict(self.how), dict(self.owner)
        flat: dict[int, object] = {}
        named = list(self.writes.named)
        for i, kind in how.items():
            if isinstance(kind, tuple) and kind[0] == "input":
                flat[i] = inputs[kind[1]]
            elif isinstance(kind, tuple):  # ("loss", dtype): the step's, in the loss's own dtype
                flat[i] = loss.to(kind[1])
            elif owner[i] in stages and kept.get(i):
                flat[i] = _combine(kept[i], kind, microbatches)
        items = []
        for w in self.writes.items:
            leaves = _leaves(w.value)
            if all(i in flat for i in leaves):
                if not any(flat[i] is None for i in leaves):
                    items.append(w)
                    continue
                named.append(f"{w.where}: computed from each micro-batch's inputs, with no whole-batch value "
                             "(neither the loss nor a value per sample)")
            elif any(i in flat for i in leaves) and len({owner[i] for i in leaves if owner[i] is not None}) > 1:
                named.append(f"{w.where}: made of values that stages on different pipeline ranks compute")
        values = _Flat(flat)
        write_back(model, Writes(self.writes.first, tuple(items), tuple(dict.fromkeys(named))), values, graphs,
                   warned)


class _Flat:
    """The graph's flat outputs by index, as :func:`write_back` reads them (only the written ones are here)."""

    def __init__(self, values: dict[int, object]):
        self.values = values

    def __getitem__(self, i: int) -> object:
        return self.values[i]


def _combine(values: list[torch.Tensor], kind: object, microbatches: int) -> torch.Tensor | None:
    """The whole batch's value from the micro-batches' (None: it has none)."""
    if kind == "same" or len(values) == 1:
        return values[-1]
    full = [v.full_tensor() if hasattr(v, "full_tensor") else v for v in values]  # a sharded value gathered
    if all(v.dim() > 0 and v.shape[0] == full[0].shape[0] for v in full) and len(full) == microbatches:
        return torch.cat(full)
    return None


def stage_writes(top: fx.GraphModule, writes: Writes | None, loss_index: int, owner: dict[int, int],
                 cut: set[int]) -> StageWrites | None:
    """How each written output of the split graph ``top`` is written back: ``owner``, the stage whose piece
    computes each flat output (:func:`~autotp.operators.stages.wire_stages`); ``cut``, the flat inputs the
    step cuts into micro-batches."""
    if not writes:
        return None
    outs = _outputs(top)
    sources = top.meta.get(OUTPUT_INPUTS)
    placeholders = {n: i for i, n in enumerate(n for n in top.graph.nodes if n.op == "placeholder")}
    loss = outs[loss_index]
    how, where = {}, {}
    for w in writes.items:
        for i in _leaves(w.value):
            node = outs[i]
            if node in placeholders:
                how[i], where[i] = ("input", placeholders[node]), None
                continue
            where[i] = owner.get(i)
            from_batch = sources is None or bool(sources[i] & cut)
            val = node.meta.get("val")
            how[i] = ("loss", val.dtype) if node is loss and isinstance(val, torch.Tensor) else \
                "batch" if from_batch else "same"
    return StageWrites(writes, tuple(how.items()), tuple(where.items()))


def output_stages(top: fx.GraphModule, results: Sequence[tuple[str, ...]]) -> dict[int, int]:
    """The stage computing each flat output of ``top`` (``results``: each stage's result names, in order)."""
    made = {name: s for s, names in enumerate(results) for name in names if name}
    out = {}
    for i, node in enumerate(_outputs(top)):
        if isinstance(node, fx.Node) and node.name in made:
            out[i] = made[node.name]
    return out
