"""Find every matmul whose weight is a parameter, in whichever form torch.export recorded it.

- ``aten.linear(x, W[out, in], b)``: ``nn.Linear`` and ``F.linear``;
- ``aten.addmm(b, x, W[in, out])`` / ``aten.mm(x, W[in, out])``: GPT-2's Conv1D stores W as [in, out];
- ``aten.matmul(x, W.T)``: a hand-written ``x @ W.T`` (W stored [out, in]), or ``x @ W`` (W stored [in, out]).

Between the parameter and the matmul the weight may pass through casts and layout-only copies
(``W.to(x.dtype)``, ``W.type_as(x)``, ``W.contiguous()``: mixed-precision ``Linear`` subclasses do this) and
2-D transposes (``W.t()``, ``W.T``, ``W.mT``, ``W.transpose(0, 1)``), each read by nothing else; the bias
may be cast too. A cast of a shard is the shard of the cast: the parameter is cut and the chain runs on it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten

# what a weight may pass through on its way to the matmul: ops that keep its values (or round them) and shape
CASTS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default,
          aten.contiguous.default, aten.clone.default, aten.alias.default}
TRANSPOSES_2D = {aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default, aten.mT.default,
               aten.adjoint.default, aten.swapaxes.default, aten.swapdims.default}
_NO_OUTPUT = {aten._assert_tensor_metadata.default}


@dataclass(frozen=True)
class ParamMatmul:
    node: fx.Node
    kind: str  # "linear" | "addmm" | "mm" | "matmul" | "embedding" (see find_param_embeddings)
    x: fx.Node  # activation input
    weight: str  # parameter name (get_attr target)
    out_dim: int  # dim of the stored weight that indexes output features
    in_features: int
    out_features: int
    bias: str | None
    chain: tuple[fx.Node, ...] = ()  # casts and transposes between W and the matmul, W's side first

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


@dataclass(frozen=True)
class WeightSource:
    param: str
    chain: tuple[fx.Node, ...]  # W's side first
    flips: int  # transposes on the way


def _is_2d_transpose(node: fx.Node) -> bool:
    if node.target in (aten.t.default, aten.numpy_T.default, aten.mT.default, aten.adjoint.default):
        return True
    if node.target in (aten.transpose.int, aten.swapaxes.default, aten.swapdims.default):
        return {d % 2 for d in node.args[1:3]} == {0, 1}
    if node.target is aten.permute.default:
        return [d % 2 for d in node.args[1]] == [1, 0]
    return False


def only_user(node: fx.Node) -> fx.Node | None:
    """The one node that reads ``node`` (export's dtype assertions aside), or None."""
    users = [u for u in node.users if u.target not in _NO_OUTPUT]
    return users[0] if len(users) == 1 else None


def weight_source(gm: fx.GraphModule, node: object, params: set[str]) -> WeightSource | None:
    """The parameter a matmul operand is, through casts and 2-D transposes each read by nothing else."""
    chain: list[fx.Node] = []
    flips = 0
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target in TRANSPOSES_2D and _is_2d_transpose(node):
            flips += 1
        elif node.target not in CASTS:
            return None
        if chain and only_user(node) is not chain[0]:
            return None
        chain.insert(0, node)
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.op == "get_attr" and node.target in params):
        return None
    if chain and only_user(node) is not chain[0]:
        return None
    return WeightSource(str(node.target), tuple(chain), flips)


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


def find_param_embeddings(gm: fx.GraphModule) -> list[ParamMatmul]:
    """Every lookup ``aten.embedding(W, ids)`` of a 2-D parameter (or its cast), as a matmul of one-hot ids by W
    [rows, features]: ``kind`` "embedding", ``x`` the ids, ``out_dim`` 1 (the features)."""
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    found = []
    for node in gm.graph.nodes:
        if node.target is not aten.embedding.default or not isinstance(node.args[1], fx.Node):
            continue
        src = weight_source(gm, node.args[0], params)
        if src is None or src.flips or (src.chain and only_user(src.chain[-1]) is not node):
            continue
        w = gm.get_parameter(src.param)
        if w.dim() == 2:
            found.append(ParamMatmul(node, "embedding", node.args[1], src.param, 1, w.shape[0], w.shape[1], None,
                                     src.chain))
    return found


_KINDS = {aten.linear.default: "linear", aten.addmm.default: "addmm", aten.mm.default: "mm",
          aten.matmul.default: "matmul"}


def match_param_matmul(gm: fx.GraphModule, node: fx.Node, params: set[str]) -> ParamMatmul | None:
    """``node`` as a matmul of an activation by a 2-D parameter (``params``: the graph's parameter names)."""
    kind = _KINDS.get(node.target)
    if kind is None:
        return None
    if kind == "linear":  # W [out, in]
        x, wn, bn, out_dim = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else None, 0
    else:  # W [in, out]
        if kind == "addmm" and (node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1):
            return None
        x, wn = (node.args[1], node.args[2]) if kind == "addmm" else (node.args[0], node.args[1])
        bn, out_dim = node.args[0] if kind == "addmm" else None, 1
    if not isinstance(x, fx.Node) or not isinstance(wn, fx.Node):
        return None
    src = weight_source(gm, wn, params)
    if src is None or (src.chain and only_user(src.chain[-1]) is not node):
        return None
    bias = None
    if bn is not None:
        bsrc = weight_source(gm, bn, params)
        if bsrc is None or bsrc.flips:
            return None
        bias = bsrc.param
    weight = gm.get_parameter(src.param)
    if weight.dim() != 2:
        return None
    out_dim ^= src.flips % 2
    return ParamMatmul(node, kind, x, src.param, out_dim, weight.shape[1 - out_dim], weight.shape[out_dim], bias,
                       src.chain)


def column_form(gm: fx.GraphModule, c: fx.Node, x: fx.Node, params: set[str]) -> tuple[str, fx.Node, object] | None:
    """(layout, weight node, bias node) of a column matmul reading ``x`` once in a plain form that a fused
    column group computes itself (``linear``, ``addmm``, ``mm``/``matmul`` by a parameter, its transpose or
    its cast); layout ``"out_in"`` for a weight read as [out, in], ``"in_out"`` for [in, out]. A lone
    transpose of W is undone (the group reads W itself); a cast stays in the graph, the group reads it."""
    pm = match_param_matmul(gm, c, params)
    if pm is None or pm.x is not x or c.kwargs or sum(a is x for a in c.args) != 1:
        return None
    operand = c.args[2 if pm.kind == "addmm" else 1]
    layout = "out_in" if pm.kind == "linear" else "in_out"
    if len(pm.chain) == 1 and pm.chain[0].target in TRANSPOSES_2D:
        operand, layout = pm.chain[0].args[0], "out_in" if pm.out_dim == 0 else "in_out"
    bias = c.args[0] if pm.kind == "addmm" else c.args[2] if pm.kind == "linear" and len(c.args) > 2 else None
    return layout, operand, bias
