"""Every weight left whole, with the reason: the completeness check of a plan.

A parameter of two or more dims that no column→row pair, vocab-parallel layer or head-sharded region cuts
is a gap (memory every rank pays in full) unless there is a reason for it. Each one is classified by what
reads it in the graph, through casts and transposes:

- the weight of a matmul: the reason its module was left replicated (analysis recorded it), else what its
  output feeds;
- the table of an embedding: indexed by positions (Megatron keeps position embeddings whole), or the
  reason its vocab-parallel rows were refused;
- the filters of a convolution of the call's own input (a vision tower's patch embedding): the input stem,
  whole as Megatron's ViT keeps it;
- anything else: the op that reads it, which no sharding rule reads as a weight.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx as fx

from autotp.analysis.chosen import chooses_only, maker_of
from autotp.analysis.matmuls import ParamMatmul, module_path
from autotp.analysis.op_rules import drops_dim, inserts_dim, is_cast, kind_of, permutes
from autotp.analysis.ops import from_inputs, reaches, unread
from autotp.analysis.pairs import Analysis
from autotp.plan.plan import WholeParam

aten = torch.ops.aten

# the convolutions an input stem is (input, weight, bias, stride, padding, dilation, groups)
_CONVS = frozenset({aten.conv1d.default, aten.conv1d.padding, aten.conv2d.default, aten.conv2d.padding,
                    aten.conv3d.default, aten.conv3d.padding})


def _passes_through(target: object) -> bool:
    """What a weight passes through on its way to its reader: a cast or a dim reorder."""
    return is_cast(target) or permutes(target)


def _readers(node: fx.Node) -> list[fx.Node]:
    """What reads a parameter, looking through casts and transposes."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            if kind_of(u.target) == "no_output":
                continue
            if _passes_through(u.target) and u.args[0] is n:
                todo.append(u)
            else:
                out.append(u)
    return out


def _constant_row(reader: fx.Node) -> bool:
    """Does ``reader`` pick one row of a table by a constant index (``E[2]``: ``select(E, 0, 2)``)?"""
    return kind_of(reader.target) == "select" and reader.args[1] == 0 and isinstance(reader.args[2], int)


def _replicated_reason(module: str, a: Analysis) -> str | None:
    for where, reason in [*a.by_design, *a.replicated]:
        if where == "<root>" or module == where or module.startswith(where + "."):
            return reason if module == where else f"{where} left replicated: {reason}"
    return None


def _matmul_reason(m: ParamMatmul, a: Analysis) -> str:
    known = _replicated_reason(m.module, a)
    if known is not None:
        return known
    readers = sorted({str(getattr(u.target, "__name__", u.target)) for u in m.node.users
                      if kind_of(u.target) != "no_output"})
    if unread(m.node):
        # computed and then dropped at this call's sizes (DeepSeek-V4's compressor gate over windows of 128
        # tokens, sliced to none of a shorter sequence's): nothing to cut
        return (f"read by nothing in this call's graph: its {m.in_features}→{m.out_features} output (read by "
                f"{', '.join(readers)}) reaches neither the loss nor an output")
    return (f"a {m.in_features}→{m.out_features} matmul outside every column→row pair whose output is read by "
            f"{', '.join(readers) or 'nothing'}: no row-parallel matmul or loss consumes it sharded")


def _added_table(reader: fx.Node, a: Analysis, shape: torch.Size) -> bool:
    """Is ``reader`` the add of a learned table ``(1, n, h)`` (``shape``: one row per position, broadcast over the
    batch; a ViT's ``pos_embed``) to an activation outside every pair's region, whole on every rank?"""
    if reader.target not in (aten.add.Tensor, aten.add_.Tensor) or len(shape) < 3 or any(d != 1 for d in shape[:-2]):
        return False
    cut = {n for p in a.pairs for n in p.region.specs}
    return reader not in cut and len(reader.all_input_nodes) == 2 and not cut.intersection(reader.all_input_nodes)


def _row_bias_of(reader: fx.Node, a: Analysis) -> ParamMatmul | None:
    """The row matmul whose output ``reader`` (``bias[ids]``: an expert's bias per token slot) is added to."""
    rows = {p.row.node: p.row for p in a.pairs}
    if reader.target is not aten.index.Tensor or len(reader.users) != 1:
        return None
    (add,) = reader.users
    if add.target not in (aten.add.Tensor, aten.add_.Tensor):
        return None
    return next((rows[x] for x in add.all_input_nodes if x in rows), None)


def _scales_per_row(reader: fx.Node) -> bool:
    """Is ``reader`` ``P[ids]`` (``index`` or ``index_select`` of dim 0, one index tensor chosen from the model's
    parameters, a router's choice: a table read by token ids is an embedding) whose picked rows (``(rows,
    width)`` per token) only multiply other values elementwise, through casts and unsqueezes?"""
    if reader.target is aten.index.Tensor:
        if len(reader.args[1]) != 1 or not isinstance(reader.args[1][0], fx.Node):
            return False
        ids = reader.args[1][0]
    elif reader.target is aten.index_select.default and reader.args[1] in (0, -2):
        ids = reader.args[2]
    else:
        return False
    params = {n for n, _ in reader.graph.owning_module.named_parameters(remove_duplicate=False)}
    if not reaches(ids, lambda n: n.op == "get_attr" and n.target in params):
        return False
    todo, uses = [reader], []
    while todo:
        n = todo.pop()
        for u in n.users:
            if kind_of(u.target) == "no_output":
                continue
            if (is_cast(u.target) or inserts_dim(u.target)) and u.args[0] is n:
                todo.append(u)
            else:
                uses.append(u)
    return bool(uses) and all(u.target is aten.mul.Tensor and len(u.all_input_nodes) == 2 for u in uses)


def _entering_region(read: list[fx.Node], readers: list[fx.Node], a: Analysis) -> str | None:
    """The pair whose region every reader of the parameter (``read``: its get_attrs; ``readers``: what reads them
    through casts and transposes) takes it in through f, whole (a weight every head applies to its own heads:
    :func:`~autotp.analysis.pairs.head_shared`); None where a reader is not such a use."""
    chain, todo = set(), list(read)
    while todo:
        n = todo.pop()
        chain.add(n)
        todo.extend(u for u in n.users if _passes_through(u.target) and u.args[0] is n)
    found = None
    for r in readers:
        found = next((p.name for p in a.pairs for e in p.region.entering if e.consumer is r and e.operand in chain),
                     None)
        if found is None:
            return None
    return found


def _depthwise_whole(reader: fx.Node) -> fx.Node | None:
    """The depthwise ``conv1d`` (one filter per channel, ``groups`` = channels) of a value no pair cuts that
    ``reader`` is, through squeezes and unsqueezes of the filters' size-1 dim; None where it is none."""
    n = reader
    while (inserts_dim(n.target) or drops_dim(n.target)) and len(n.users) == 1:
        n = next(iter(n.users))
    if kind_of(n.target) != "conv" or len(n.args) <= 6 or not isinstance(n.args[0], fx.Node):
        return None
    return n if n.args[6] == n.args[0].meta["val"].shape[1] and "autotp" not in n.meta else None


def _input_stem(reader: fx.Node) -> fx.Node | None:
    """The call's input (an image's pixels) that ``reader`` convolves, through casts alone, when ``reader`` is a
    convolution of ``groups`` 1 (every output channel reads every input channel): the stem that makes the first
    activations; None otherwise."""
    if reader.target not in _CONVS or not isinstance(reader.args[0], fx.Node):
        return None
    if (reader.args[6] if len(reader.args) > 6 else 1) != 1:
        return None
    x = reader.args[0]
    while x.op == "call_function" and is_cast(x.target) and isinstance(x.args[0], fx.Node):
        x = x.args[0]
    return x if x.op == "placeholder" else None


def _depth_scores(reader: fx.Node, shape: torch.Size) -> fx.Node | None:
    """The softmax that weighs ``reader``'s scores, where ``reader`` (through views, expands and unsqueezes of a
    few learned queries ``shape = (n, h)``, fewer than their width, each read whole: one head) is the left operand
    of a matmul that no pair cuts, whose output reaches that softmax through elementwise ops alone (a scale, a
    mask): a block attention residual's queries scoring the layer outputs stacked over depth, ``(b, s, n, h) @
    (b, s, h, L)``. None where it is not so."""
    if len(shape) != 2 or shape[0] >= shape[1]:
        return None
    n, last = reader, reader
    while (kind_of(n.target) in ("view", "expand") or inserts_dim(n.target) or is_cast(n.target)) \
            and len(n.users) == 1:
        n, last = next(iter(n.users)), n
    if kind_of(n.target) != "matmul" or "autotp" in n.meta or n.args[0] is not last \
            or last.meta["val"].shape[-1] != shape[1]:
        return None
    while len(n.users) == 1:
        n = next(iter(n.users))
        if kind_of(n.target) == "softmax":
            return None if "autotp" in n.meta else n
        if kind_of(n.target) not in ("pointwise", "same_shape"):
            return None
    return None


class WholeCandidate(NamedTuple):
    """A parameter of two or more dims under all its (tied) names, with the reason it is whole if nothing cuts it."""

    names: tuple[str, ...]
    param: WholeParam


def whole_candidates(gm: fx.GraphModule, a: Analysis) -> tuple[WholeCandidate, ...]:
    """Every parameter of two or more dims larger than 1 of ``gm`` (RWKV's time-mixing scales ``(1, 1, h)`` are
    vectors, whole as a norm's weight is), each with the reason it would be left whole; tied names
    count once (the first one names it). The planner keeps those it does not cut (:func:`whole_params`)."""
    if a.tp == 1:
        return ()
    matmuls = {m.weight: m for m in a.matmuls}
    nodes = {n.target: n for n in gm.graph.nodes if n.op == "get_attr"}
    groups: dict[int, list[str]] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        # a (1, 1, h) scale is a vector, as a norm's weight is; a 2-D weight is a matrix even of one row (a
        # shared expert's h -> 1 gate)
        if p.dim() == 2 or sum(size > 1 for size in p.shape) >= 2:
            groups.setdefault(id(p), []).append(name)
    return tuple(WholeCandidate(tuple(names), _whole(names, nodes, matmuls, a)) for names in groups.values())


def whole_params(candidates: tuple[WholeCandidate, ...], cut: set[str]) -> tuple[WholeParam, ...]:
    """The candidates none of whose names is in ``cut`` (the plan's sharded names): a tied weight is cut under
    any of its names."""
    return tuple(c.param for c in candidates if not cut.intersection(c.names))


def _whole(names: list[str], nodes: dict[str, fx.Node], matmuls: dict[str, ParamMatmul], a: Analysis) -> WholeParam:
    """The reason the parameter called ``names`` stays whole if nothing cuts it, named by its first name. The
    graph may read it under any of them (each has its own get_attr)."""
    name, read = names[0], [nodes[n] for n in names if n in nodes]
    if not read:
        return WholeParam(name, name.rpartition(".")[0], "not read by this call's graph")
    m = next((matmuls[n] for n in names if n in matmuls), None)
    if m is not None:
        return WholeParam(name, m.module, _matmul_reason(m, a))
    readers = [r for node in read for r in _readers(node)]
    first = readers[0] if readers else None
    module = (module_path(first) if first is not None else "") or name.rpartition(".")[0]
    if first is not None and first.target is aten.embedding.default:
        known = _replicated_reason(module, a)
        if known is not None:
            reason = known
        elif not from_inputs(first.args[1]):
            reason = ("position embedding: indexed by positions, not token ids; every rank reads every row "
                      "(Megatron keeps it whole)")
        else:
            reason = "embedding of token ids not made vocab-parallel"
    elif first is None:
        reason = "read by nothing in this call's graph"
    elif _replicated_reason(module, a) is None and all(_constant_row(r) for r in readers):
        # ProphetNet's n-gram embeddings: ``E[i]`` for each predicting stream i, added to the position embeddings
        reason = (f"position embedding: its rows are picked by constant indices (at {first.name}), not by token "
                  "ids; every rank reads them whole (Megatron keeps it whole)")
    elif _replicated_reason(module, a) is None and all(
            _added_table(r, a, shape := read[0].graph.owning_module.get_parameter(name).shape) for r in readers):
        reason = (f"position embedding: its {'×'.join(map(str, shape))} table is added to every sequence of an "
                  f"activation no pair cuts (at {first.name}), one row per position, not looked up by token ids; "
                  "every rank reads it whole (Megatron keeps it whole)")
    elif (row := _row_bias_of(first, a)) is not None:
        reason = (f"bias of the row-parallel {row.module} (picked per token by {first.name}): added once, after "
                  "the all-reduce of its partial sums, on every rank (as Megatron adds a row-parallel bias)")
    elif _replicated_reason(module, a) is None and all(_scales_per_row(r) for r in readers):
        rows, width = read[0].graph.owning_module.get_parameter(name).shape[:2]
        reason = (f"scale kept whole: its {rows} rows of {width} are picked per token by {first.name} and multiply "
                  "a replicated activation elementwise (as a per-expert norm's weight does after the experts' "
                  "all-reduce): every rank needs whole rows, as Megatron keeps a norm's weight whole")
    elif all(chooses_only(node) is not None for node in read):
        shape = "×".join(map(str, read[0].graph.owning_module.get_parameter(name).shape))
        ops = ", ".join(sorted({maker_of(n) for node in read for n in chooses_only(node)}))
        reason = (f"router kept whole: its {shape} values reach the loss and the outputs only through the integer "
                  f"or boolean values of {ops} (it only shifts which entries are chosen, as a router's correction bias "
                  "does; no gradient reaches it): every rank holds it whole and makes the one device's choice, with no "
                  "communication")
    elif (region := _entering_region(read, readers, a)) is not None:
        shape = "×".join(map(str, read[0].graph.owning_module.get_parameter(name).shape))
        reason = (f"head-shared weight kept whole: each rank applies its whole {shape} to its own heads in "
                  f"{region}'s region (at {first.name}); its gradient, partial per rank, is summed over the group, "
                  "as Megatron sums a q/k norm's weight")
    elif _replicated_reason(module, a) is None and all(convs := [_depthwise_whole(r) for r in readers]):
        shape = "×".join(map(str, read[0].graph.owning_module.get_parameter(name).shape))
        reason = (f"filter kept whole: its {shape} filters convolve each channel of a replicated activation on its "
                  f"own (the depthwise {convs[0].name} over its full width): every rank holds it whole, as Megatron "
                  "keeps a norm's weight whole")
    elif _replicated_reason(module, a) is None and all(_input_stem(r) is not None for r in readers):
        shape = "×".join(map(str, read[0].graph.owning_module.get_parameter(name).shape))
        channels = read[0].graph.owning_module.get_parameter(name).shape[0]
        reason = (f"input stem kept whole: its {shape} filters convolve the call's input (at {first.name}) into the "
                  f"{channels} channels the stream starts from, as an embedding's lookup does: every rank computes "
                  "them whole, as Megatron's ViT keeps its patch embedding (conv1) whole beside the position "
                  "embedding (cut by output channels, they would be gathered before the norm that reads all of "
                  "them)")
    elif _replicated_reason(module, a) is None and all(
            weighs := [_depth_scores(r, read[0].graph.owning_module.get_parameter(name).shape) for r in readers]):
        shape = "×".join(map(str, read[0].graph.owning_module.get_parameter(name).shape))
        reason = (f"gate kept whole: its {shape} queries score the entries of an activation no pair cuts, weighed by "
                  f"{weighs[0].name} over them (a block attention residual over the whole layer outputs): every "
                  "rank computes the few mixing weights whole, as Megatron keeps a router's gate whole")
    else:
        op = str(getattr(first.target, "__name__", first.target))
        known = _replicated_reason(module, a)
        reason = known or f"read by {op} (at {first.name}), which no sharding rule reads as a weight"
    return WholeParam(name, module, reason)
