"""Every weight left whole, with the reason: the completeness check of a plan.

A parameter of two or more dims that no column→row pair, vocab-parallel layer or head-sharded region cuts
is a gap (memory every rank pays in full) unless there is a reason for it. Each one is classified by what
reads it in the graph, through casts and transposes:

- the weight of a matmul: the reason its module was left replicated (analysis recorded it), else what its
  output feeds;
- the table of an embedding: indexed by positions (Megatron keeps position embeddings whole), or the
  reason its vocab-parallel layout was refused;
- anything else: the op that reads it, which no sharding rule reads as a weight.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autotp.analysis.matmuls import ParamMatmul, module_path
from autotp.analysis.op_rules import is_cast, kind_of, permutes
from autotp.analysis.ops import from_inputs
from autotp.analysis.pairs import Analysis
from autotp.plan.plan import WholeParam

aten = torch.ops.aten


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
    return (f"a {m.in_features}→{m.out_features} matmul outside every column→row pair whose output is read by "
            f"{', '.join(readers) or 'nothing'}: no row-parallel matmul or loss consumes it sharded")


def _row_bias_of(reader: fx.Node, a: Analysis) -> ParamMatmul | None:
    """The row matmul whose output ``reader`` (``bias[ids]``: an expert's bias per token slot) is added to."""
    rows = {p.row.node: p.row for p in a.pairs}
    if reader.target is not aten.index.Tensor or len(reader.users) != 1:
        return None
    (add,) = reader.users
    if add.target not in (aten.add.Tensor, aten.add_.Tensor):
        return None
    return next((rows[x] for x in add.all_input_nodes if x in rows), None)


def whole_params(gm: fx.GraphModule, a: Analysis, cut: set[str]) -> tuple[WholeParam, ...]:
    """The parameters of two or more dims of ``gm`` not in ``cut`` (the plan's sharded names), each with its
    reason; tied names count once."""
    if a.tp == 1:
        return ()
    matmuls = {m.weight: m for m in a.matmuls}
    nodes = {n.target: n for n in gm.graph.nodes if n.op == "get_attr"}
    named = list(gm.named_parameters(remove_duplicate=False))
    seen = {id(p) for name, p in named if name in cut}  # a tied weight is cut under any of its names
    out = []
    for name, p in named:
        if p.dim() < 2 or id(p) in seen:
            continue
        seen.add(id(p))
        node = nodes.get(name)
        if node is None:
            out.append(WholeParam(name, name.rpartition(".")[0], "not read by this call's graph"))
            continue
        if name in matmuls:
            m = matmuls[name]
            out.append(WholeParam(name, m.module, _matmul_reason(m, a)))
            continue
        readers = _readers(node)
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
        elif (row := _row_bias_of(first, a)) is not None:
            reason = (f"bias of the row-parallel {row.module} (picked per token by {first.name}): added once, after "
                      "the all-reduce of its partial sums, on every rank (as Megatron adds a row-parallel bias)")
        else:
            op = str(getattr(first.target, "__name__", first.target))
            known = _replicated_reason(module, a)
            reason = known or f"read by {op} (at {first.name}), which no sharding rule reads as a weight"
        out.append(WholeParam(name, module, reason))
    return tuple(out)
