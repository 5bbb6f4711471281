"""Find every matmul whose weight is a parameter, in whichever form torch.export recorded it.

- ``aten.linear(x, W[out, in], b)``: ``nn.Linear`` and ``F.linear``;
- ``aten.addmm(b, x, W[in, out])`` / ``aten.mm(x, W[in, out])``: GPT-2's Conv1D stores W as [in, out];
- ``aten.matmul(x, W.T)``: a hand-written ``x @ W.T`` (W stored [out, in]), or ``x @ W`` (W stored [in, out]).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten

_TRANSPOSES = {aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default}


@dataclass(frozen=True)
class ParamMatmul:
    node: fx.Node
    kind: str  # "linear" | "addmm" | "mm" | "matmul"
    x: fx.Node  # activation input
    weight: str  # parameter name (get_attr target)
    out_dim: int  # dim of the stored weight that indexes output features
    in_features: int
    out_features: int
    bias: str | None
    transpose: fx.Node | None  # the node that transposes W before a matmul, if any

    @property
    def in_dim(self) -> int:
        return 1 - self.out_dim

    @property
    def module(self) -> str:
        return module_path(self.node) or self.weight.rsplit(".", 1)[0]


def module_path(node: fx.Node) -> str:
    """Innermost source module of a node, e.g. ``transformer.h.0.attn.c_attn``."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] for v in stack.values() if isinstance(v, tuple) and v and isinstance(v[0], str)]
    return paths[-1] if paths else ""


def _param(gm: fx.GraphModule, node: object, params: set[str]) -> str | None:
    if isinstance(node, fx.Node) and node.op == "get_attr" and node.target in params:
        return str(node.target)
    return None


def _is_2d_transpose(node: fx.Node) -> bool:
    if node.target in (aten.t.default, aten.numpy_T.default):
        return True
    if node.target is aten.transpose.int:
        return {d % 2 for d in node.args[1:3]} == {0, 1}
    if node.target is aten.permute.default:
        return list(node.args[1]) in ([1, 0], [-1, -2])
    return False


def find_param_matmuls(gm: fx.GraphModule) -> list[ParamMatmul]:
    """Every matmul of an activation by a 2-D parameter, in graph order."""
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        pm = match_param_matmul(gm, node, params)
        if pm is not None:
            found.append(pm)
    return found


def match_param_matmul(gm: fx.GraphModule, node: fx.Node, params: set[str]) -> ParamMatmul | None:
    """``node`` as a matmul of an activation by a 2-D parameter (``params``: the graph's parameter names)."""
    t = node.target
    if t is aten.linear.default:
        w = _param(gm, node.args[1], params)
        if w is None or not isinstance(node.args[0], fx.Node):
            return None
        b = _param(gm, node.args[2], params) if len(node.args) > 2 else None
        return _make(gm, node, "linear", node.args[0], w, 0, b, None)
    if t in (aten.addmm.default, aten.mm.default, aten.matmul.default):
        x, wn = (node.args[1], node.args[2]) if t is aten.addmm.default else (node.args[0], node.args[1])
        if not isinstance(x, fx.Node) or not isinstance(wn, fx.Node):
            return None
        if t is aten.addmm.default and (node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1):
            return None
        b = _param(gm, node.args[0], params) if t is aten.addmm.default else None
        if t is aten.addmm.default and b is None:
            return None
        kind = {aten.addmm.default: "addmm", aten.mm.default: "mm", aten.matmul.default: "matmul"}[t]
        w = _param(gm, wn, params)
        if w is not None:
            return _make(gm, node, kind, x, w, 1, b, None)
        if wn.op == "call_function" and wn.target in _TRANSPOSES and _is_2d_transpose(wn) and len(wn.users) == 1:
            w = _param(gm, wn.args[0], params)
            if w is not None:
                return _make(gm, node, kind, x, w, 0, b, wn)
    return None


def _make(gm, node, kind, x, w, out_dim, b, tr) -> ParamMatmul | None:
    weight = gm.get_parameter(w)
    if weight.dim() != 2:
        return None
    return ParamMatmul(node, kind, x, w, out_dim, weight.shape[1 - out_dim], weight.shape[out_dim], b, tr)


def column_form(gm: fx.GraphModule, c: fx.Node, x: fx.Node, params: set[str]) -> tuple[str, fx.Node, object] | None:
    """(layout, weight node, bias node) of a column matmul reading ``x`` once in a plain form that a fused
    column group computes itself (``linear``, ``addmm``, ``mm``/``matmul`` by a parameter or its transpose);
    layout ``"out_in"`` for W stored [out, in], ``"in_out"`` for [in, out]. None otherwise."""
    pm = match_param_matmul(gm, c, params)
    if pm is None or pm.x is not x or c.kwargs or sum(a is x for a in c.args) != 1:
        return None
    weight = pm.transpose.args[0] if pm.transpose is not None else c.args[2 if pm.kind == "addmm" else 1]
    bias = c.args[0] if pm.kind == "addmm" else c.args[2] if pm.kind == "linear" and len(c.args) > 2 else None
    return ("out_in" if pm.out_dim == 0 else "in_out"), weight, bias
