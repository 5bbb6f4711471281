"""Find every matmul whose weight is a parameter, in whichever form torch.export recorded it.

- ``aten.linear(x, W[out, in], b)``: ``nn.Linear`` and ``F.linear``;
- ``aten.addmm(b, x, W[in, out])`` / ``aten.mm(x, W[in, out])``: GPT-2's Conv1D stores W as [in, out];
- ``aten.matmul(x, W.T)``: a hand-written ``x @ W.T`` (W stored [out, in]), or ``x @ W`` (W stored [in, out]).

Between the parameter and the matmul the weight may pass through casts and layout-only copies
(``W.to(x.dtype)``, ``W.type_as(x)``, ``W.contiguous()``: mixed-precision ``Linear`` subclasses do this) and
2-D transposes (``W.t()``, ``W.T``, ``W.mT``, ``W.transpose(0, 1)``), each read by nothing else; the bias
may be cast too. A cast of a shard is the shard of the cast: the parameter is cut and the chain runs on it.
A parameter of 3 or more dims flattened to a matrix (``W.flatten(1, 2)`` of XLNet's ``(d_model, n_head,
d_head)``, as capture writes an einsum by it) is a matmul too: the matrix dim that merges several of its dims
is cut on the outermost of them (``fold``), a rank's slice of W flattening to its slice of the matrix.

Experts stored as one 3-D parameter ``W [E, a, b]`` are matmuls of that parameter too:

- ``W[e]`` (``select(W, 0, e)``) then any form above: one expert of a loop over experts;
- ``W[ids]`` (``index(W, [ids])``: a weight per token or per (token, k) slot) read by ``bmm``, a batched
  ``matmul`` or ``einsum`` (Hugging Face's batched_mm, gpt-fast's ConditionalFeedForward);
- a grouped GEMM ``grouped_mm(x [S, K], W' [E, K, N], offsets)`` of tokens sorted by expert, W' being W or
  its transpose (Hugging Face's grouped_mm, ``torch._grouped_mm``).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from autotp.analysis.op_rules import inserts_dim, is_cast, kind_of, permutes
from autotp.analysis.ops import ndim_of, permutation
from autotp.analysis.shapes import normalize_dim
from autotp.shard_spec import Segment

aten = torch.ops.aten



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
    in_axis: int | None = None  # dim of the stored weight that indexes input features (default: the other one)
    expert: int | None = None  # ``W[expert]`` of a 3-D parameter read one expert at a time
    x_dim: int = -1  # dim of ``x`` that is contracted
    y_dim: int = -1  # dim of the output that indexes output features
    # W flattened to a matrix: (its dim that a merged matrix dim is cut on, elements of the dims merged after it)
    fold: tuple[int, int] | None = None

    @property
    def in_dim(self) -> int:
        return 1 - self.out_dim if self.in_axis is None else self.in_axis

    @property
    def key(self) -> tuple[str, int | None]:
        """What one use of a weight is: the parameter, or one expert of it."""
        return self.weight, self.expert

    @property
    def module(self) -> str:
        return module_path(self.node) or self.weight.rsplit(".", 1)[0]


def module_path(node: fx.Node) -> str:
    """Innermost source module of a node, e.g. ``transformer.h.0.attn.c_attn``."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] for v in stack.values() if isinstance(v, tuple) and v and isinstance(v[0], str)]
    return paths[-1] if paths else ""


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def source_line(node: fx.Node) -> str:
    """Where the model's code made ``node``: ``model.py:42`` (the innermost frame outside torch), or ''."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    mine = [(f, n) for f, n in frames if "/torch/" not in f and "site-packages" not in f]
    if not mine:
        return ""
    file, line = mine[-1]
    return f"{os.path.basename(file)}:{line}"


def where(node: fx.Node) -> str:
    """``cumsum, blocks.0.attn, model.py:42``: a node, its module and its source line, for reasons."""
    return ", ".join(x for x in (node.name, module_path(node) or "top level", source_line(node)) if x)


@dataclass(frozen=True)
class WeightSource:
    param: str
    chain: tuple[fx.Node, ...]  # W's side first
    flips: int  # transposes on the way
    expert: int | None = None  # the chain starts with ``W[expert]`` of a 3-D parameter W
    # W of 3 or more dims flattened to a matrix: for each matrix dim, the dim of W it is cut on; and the
    # (dim, elements after it) of the one matrix dim that merges several
    dims: tuple[int, int] | None = None
    fold: tuple[int, int] | None = None


def _is_2d_transpose(node: fx.Node) -> bool:
    """Does ``node`` transpose a 2-D weight (``W.t()``, ``W.T``, ``W.mT``, ``W.transpose(0, 1)``, ..)?"""
    return permutes(node.target) and ndim_of(node.args[0]) == 2 and permutation(node) == [1, 0]


def only_user(node: fx.Node) -> fx.Node | None:
    """The one node that reads ``node`` (export's dtype assertions aside), or None."""
    users = [u for u in node.users if kind_of(u.target) != "no_output"]
    return users[0] if len(users) == 1 else None


def _chain(node: object, flip, stop) -> tuple[fx.Node, tuple[fx.Node, ...], int] | None:
    """Follow a matmul operand back through casts and transposes (those ``flip`` accepts), each read by
    nothing else, to the first node ``stop`` accepts: (that node, the chain W's side first, transposes)."""
    chain: list[fx.Node] = []
    flips = 0
    while isinstance(node, fx.Node):
        if stop(node):  # the parameter itself may have other readers: a tied weight's embedding, another matmul
            return node, tuple(chain), flips
        if chain and only_user(node) is not chain[0]:
            return None
        if node.op != "call_function":
            return None
        if permutes(node.target) and flip(node):
            flips += 1
        elif not is_cast(node.target) and _matrix_of(node) is None:
            return None
        chain.insert(0, node)
        node = node.args[0]
    return None


def weight_source(gm: fx.GraphModule, node: object, params: set[str]) -> WeightSource | None:
    """The parameter a matmul operand is, through casts and 2-D transposes each read by nothing else; or one
    expert ``W[e]`` of a 3-D parameter (the other experts read W too)."""
    found = _chain(node, _is_2d_transpose, lambda n: (n.op == "get_attr" and n.target in params)
                   or _expert_of(n, params) is not None)
    if found is None:
        return None
    top, chain, flips = found
    if top.op == "get_attr":
        flat = [n for n in chain if _matrix_of(n) is not None]
        if len(flat) > 1 or flat and any(permutes(n.target) for n in chain[:chain.index(flat[0])]):
            return None  # (a transpose before the flatten: the merged dims would not be W's own)
        return WeightSource(str(top.target), chain, flips, None, *(_matrix_of(flat[0]) if flat else (None, None)))
    return WeightSource(str(top.args[0].target), (top, *chain), flips, _expert_of(top, params))


def _matrix_of(node: fx.Node) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """For ``flatten(W, s, e)`` of a tensor of 3 or more dims to a matrix, merging its leading or its trailing
    dims: (the dim of W each matrix dim is cut on, (that dim for the merged one, the elements of the dims
    merged after it)). ``(h, n, d).flatten(1, 2)`` is ((0, 1), (1, d)); ``(n, d, h).flatten(0, 1)`` is ((0, 2),
    (0, d))."""
    if node.target is not aten.flatten.using_ints or node.kwargs:
        return None
    nd = ndim_of(node.args[0])
    if nd is None or nd < 3:
        return None
    shape = node.args[0].meta["val"].shape
    s = normalize_dim(node.args[1] if len(node.args) > 1 else 0, nd)
    e = normalize_dim(node.args[2] if len(node.args) > 2 else -1, nd)
    if (s, e) == (0, nd - 2):
        return (0, nd - 1), (0, int(math.prod(shape[1:nd - 1])))
    if (s, e) == (1, nd - 1):
        return (0, 1), (1, int(math.prod(shape[2:])))
    return None


def _param_node(node: object, params: set[str], ndim: int) -> bool:
    """Is ``node`` a parameter (``params``: the graph's parameter names) of ``ndim`` dims?"""
    return isinstance(node, fx.Node) and node.op == "get_attr" and node.target in params \
        and node.graph.owning_module.get_parameter(node.target).dim() == ndim


def _expert_of(node: fx.Node, params: set[str]) -> int | None:
    """``e`` for ``W[e]`` (``select(W, 0, e)``) of a 3-D parameter W."""
    if node.target is aten.select.int and _param_node(node.args[0], params, 3) and node.args[1] in (0, -3) \
            and isinstance(node.args[2], int):
        return node.args[2] % node.graph.owning_module.get_parameter(node.args[0].target).shape[0]
    return None


def find_param_matmuls(gm: fx.GraphModule) -> list[ParamMatmul]:
    """Every matmul of an activation by a 2-D parameter (or an expert's 3-D one), in graph order."""
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        pm = match_param_matmul(gm, node, params) or match_expert_matmul(gm, node, params)
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
        if src is None or src.flips or src.dims is not None or (src.chain and only_user(src.chain[-1]) is not node):
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
    if src is None and kind in ("mm", "matmul"):
        return _left_matmul(gm, node, kind, params)
    if src is None or (src.chain and only_user(src.chain[-1]) is not node):
        return None
    bias = None
    if bn is not None:
        bsrc = weight_source(gm, bn, params)
        if bsrc is None or bsrc.flips:
            return None
        bias = bsrc.param
    weight = gm.get_parameter(src.param)
    out_dim ^= src.flips % 2
    if src.dims is not None:  # W flattened to a matrix: the features are the matrix's, cut on W's dims
        flat = next(n for n in src.chain if _matrix_of(n) is not None)
        size = [int(n) for n in flat.meta["val"].shape]  # the matrix before any transpose, as out_dim counts
        return ParamMatmul(node, kind, x, src.param, src.dims[out_dim], size[1 - out_dim], size[out_dim], bias,
                           src.chain, src.dims[1 - out_dim], fold=src.fold)
    if weight.dim() != (2 if src.expert is None else 3):
        return None
    lead = weight.dim() - 2  # the expert dim of W [E, a, b]
    return ParamMatmul(node, kind, x, src.param, out_dim + lead, weight.shape[lead + 1 - out_dim],
                       weight.shape[lead + out_dim], bias, src.chain, lead + 1 - out_dim if lead else None, src.expert)


def _left_matmul(gm: fx.GraphModule, node: fx.Node, kind: str, params: set[str]) -> ParamMatmul | None:
    """``W @ x`` with the 2-D parameter on the left (mamba_simple's ``self.dt_proj.weight @ dt.t()``, of
    ``x [.., in, n]``): W [out, in] (or its transpose), the features on dim -2 of ``x`` and of the output."""
    wn, x = node.args[0], node.args[1]
    if not isinstance(x, fx.Node) or not isinstance(wn, fx.Node) or ndim_of(x) is None or ndim_of(x) < 2:
        return None
    src = weight_source(gm, wn, params)
    if src is None or src.expert is not None or src.dims is not None \
            or (src.chain and only_user(src.chain[-1]) is not node):
        return None
    weight = gm.get_parameter(src.param)
    if weight.dim() != 2:
        return None
    out_dim = src.flips % 2  # W [out, in] as the matmul reads it: dim 0 of the stored weight, or 1 transposed
    return ParamMatmul(node, kind, x, src.param, out_dim, weight.shape[1 - out_dim], weight.shape[out_dim], None,
                       src.chain, x_dim=-2, y_dim=-2)


def _gathered(gm: fx.GraphModule, node: object, params: set[str]) -> tuple[str, tuple[fx.Node, ...], int, int] | None:
    """(parameter, chain, leading dims, flips) for ``W[ids]`` of a 3-D parameter, possibly cast and with its
    two matrix dims transposed, each read by nothing else: a weight per token (slot) of a mixture of experts."""
    found = _chain(node, _swaps_last_two, lambda n: n.target is aten.index.Tensor and _param_node(n.args[0], params, 3)
                   and len(n.args[1]) == 1 and isinstance(n.args[1][0], fx.Node))
    if found is None:
        return None
    top, chain, flips = found
    return str(top.args[0].target), (top, *chain), top.args[1][0].meta["val"].dim(), flips


def _swaps_last_two(node: fx.Node) -> bool:
    """Does a dim reorder swap the last two dims of its input and keep the others?"""
    nd = ndim_of(node.args[0])
    return permutation(node) == [*range(nd - 2), nd - 1, nd - 2]


def _plain_3d(gm: fx.GraphModule, node: object, params: set[str]) -> tuple[str, tuple[fx.Node, ...], int] | None:
    """(parameter, chain, flips) for a 3-D parameter read whole, possibly with its matrix dims transposed."""
    found = _chain(node, _swaps_last_two, lambda n: _param_node(n, params, 3))
    return None if found is None else (str(found[0].target), found[1], found[2])


def is_grouped_mm(node: fx.Node) -> bool:
    """A grouped GEMM ``(x [S, K], W [E, K, N], offsets [E]) -> [S, N]``: ``torch._grouped_mm`` or a library's
    fallback op of that name and signature."""
    name = getattr(node.target, "__name__", "")
    return node.op == "call_function" and name.split(".")[0].startswith(("_grouped_mm", "grouped_mm"))


def match_expert_matmul(gm: fx.GraphModule, node: fx.Node, params: set[str]) -> ParamMatmul | None:
    """``node`` as a matmul of activations by a 3-D expert parameter read whole or per token."""
    t = node.target
    if is_grouped_mm(node) and len(node.args) >= 3 and isinstance(node.args[0], fx.Node):
        src = _plain_3d(gm, node.args[1], params)
        if src is None or node.args[0].meta["val"].dim() != 2:
            return None
        w = gm.get_parameter(src[0])
        out_axis = 2 - src[2] % 2  # W' [E, K, N]: N is W's dim 2, or dim 1 when W is read transposed
        return ParamMatmul(node, "grouped_mm", node.args[0], src[0], out_axis, w.shape[3 - out_axis],
                           w.shape[out_axis], None, src[1], 3 - out_axis, None, 1, 1)
    if t in (aten.bmm.default, aten.matmul.default) and all(isinstance(a, fx.Node) for a in node.args[:2]):
        a, b = node.args[:2]
        for wi, (wn, xn) in enumerate(((a, b), (b, a))):
            src = _gathered(gm, wn, params)
            if src is None or xn.meta["val"].dim() != wn.meta["val"].dim():
                continue
            param, chain, _, flips = src
            w = gm.get_parameter(param)
            nd = wn.meta["val"].dim()
            rows, cols = (2, 1) if flips % 2 else (1, 2)  # W's dims that the matrix's rows and columns are
            if wi == 0:  # Wg [.., R, C] @ x [.., C, n] -> [.., R, n]
                out_axis, x_dim, y_dim = rows, nd - 2, nd - 2
            else:  # x [.., n, R] @ Wg [.., R, C] -> [.., n, C]
                out_axis, x_dim, y_dim = cols, nd - 1, nd - 1
            return ParamMatmul(node, "bmm", xn, param, out_axis, w.shape[3 - out_axis], w.shape[out_axis], None,
                               chain, 3 - out_axis, None, x_dim, y_dim)
    if t is aten.einsum.default and len(node.args[1]) == 2 and isinstance(node.args[0], str):
        return _einsum_matmul(gm, node, params)
    if t in (aten.matmul.default, aten.bmm.default):
        return _stacked_matmul(gm, node, params)
    return None


def _stacked(gm: fx.GraphModule, node: object, params: set[str]) -> tuple[str, tuple[fx.Node, ...], list] | None:
    """(parameter, chain, dims) for a 3-D parameter read whole through unsqueezes, dim reorders and casts, each
    read by nothing else: ``dims[j]`` is the parameter's dim that dim ``j`` of ``node`` is, None for a size-1
    dim inserted. ``W.unsqueeze(1)`` of W [2, d, D] is [2, 1, d, D] with dims [0, None, 1, 2]."""
    chain: list[fx.Node] = []
    while isinstance(node, fx.Node) and not _param_node(node, params, 3):
        if node.op != "call_function" or (chain and only_user(node) is not chain[0]) \
                or not (inserts_dim(node.target) or permutes(node.target) or is_cast(node.target)):
            return None
        chain.insert(0, node)
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return None
    dims: list = [0, 1, 2]
    for n in chain:
        if inserts_dim(n.target):
            dims.insert(normalize_dim(n.args[1], len(dims) + 1), None)
        elif permutes(n.target):
            dims = [dims[i] for i in permutation(n)]
    return str(node.target), tuple(chain), dims


def _stacked_matmul(gm: fx.GraphModule, node: fx.Node, params: set[str]) -> ParamMatmul | None:
    """``x @ W'`` (or ``W' @ x``) where W' is a stacked 3-D parameter W [K, d, D] arranged with its matrix dims
    last and its stack dim K a batch dim: the two up projections of an MLP stored as one weight and read by
    ``einsum("bsd,kdf->kbsf", x, W)`` (which capture writes as ``unsqueeze(x, 0) @ unsqueeze(W, 1)``). The
    stack's matrices share one cut of their output dim, so W is cut along that dim like a column's."""
    if len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
        return None
    for wi in (0, 1):
        wn, xn = node.args[wi], node.args[1 - wi]
        src = _stacked(gm, wn, params)
        if src is None or _stacked(gm, xn, params) is not None:
            continue
        param, chain, dims = src
        if None in dims[-2:] or len(chain) and only_user(chain[-1]) is not node:
            return None
        w, nx, ny = gm.get_parameter(param), ndim_of(xn), ndim_of(node)
        if wi == 0:  # W' [.., R, C] @ x [.., C, n] -> [.., R, n]
            out_axis, in_axis, x_dim, y_dim = dims[-2], dims[-1], nx - 2, ny - 2
        else:  # x [.., n, R] @ W' [.., R, C] -> [.., n, C]
            out_axis, in_axis, x_dim, y_dim = dims[-1], dims[-2], nx - 1, ny - 1
        return ParamMatmul(node, "matmul", xn, param, out_axis, w.shape[in_axis], w.shape[out_axis], None, chain,
                           in_axis, None, x_dim, y_dim)
    return None


def _einsum_matmul(gm: fx.GraphModule, node: fx.Node, params: set[str]) -> ParamMatmul | None:
    """``einsum("ti,taoi->tao", x, W[ids])``: one letter of the weight's matrix dims contracted with x, the
    other kept in the output; the weight's leading (per-token) letters are batch letters of the output."""
    eq = node.args[0].replace(" ", "")
    if "..." in eq or "->" not in eq:
        return None
    ins, out = eq.split("->")
    subs = ins.split(",")
    if len(subs) != 2:
        return None
    for wi in (0, 1):
        wn, xn = node.args[1][wi], node.args[1][1 - wi]
        src = _gathered(gm, wn, params) if isinstance(wn, fx.Node) else None
        if src is None or not isinstance(xn, fx.Node):
            continue
        param, chain, lead, flips = src
        ws, xs = subs[wi], subs[1 - wi]
        if len(ws) != lead + 2 or len(set(ws)) != len(ws) or len(set(xs)) != len(xs):
            return None
        r, c = ws[-2], ws[-1]
        if not all(ch in out for ch in ws[:-2]):
            return None
        if r in xs and r not in out and c in out and c not in xs:
            contracted, kept, out_axis = r, c, 2 if not flips % 2 else 1
        elif c in xs and c not in out and r in out and r not in xs:
            contracted, kept, out_axis = c, r, 1 if not flips % 2 else 2
        else:
            return None
        w = gm.get_parameter(param)
        return ParamMatmul(node, "einsum", xn, param, out_axis, w.shape[3 - out_axis], w.shape[out_axis], None,
                           chain, 3 - out_axis, None, xs.index(contracted), out.index(kept))
    return None


def column_form(gm: fx.GraphModule, c: fx.Node, x: fx.Node, params: set[str]) -> tuple[str, fx.Node, object] | None:
    """(orientation, weight node, bias node) of a column matmul reading ``x`` once in a plain form that a fused
    column group computes itself (``linear``, ``addmm``, ``mm``/``matmul`` by a parameter, its transpose or
    its cast); orientation ``"out_in"`` for a weight read as [out, in], ``"in_out"`` for [in, out]. A lone
    transpose of W is undone (the group reads W itself); a cast stays in the graph, the group reads it."""
    pm = match_param_matmul(gm, c, params)
    if pm is None or pm.x is not x or c.kwargs or sum(a is x for a in c.args) != 1 or pm.y_dim != -1:
        return None  # (a weight on the left, ``W @ x``, is computed by the graph itself)
    operand = c.args[2 if pm.kind == "addmm" else 1]
    orientation = "out_in" if pm.kind == "linear" else "in_out"
    if len(pm.chain) == 1 and permutes(pm.chain[0].target):
        operand, orientation = pm.chain[0].args[0], "out_in" if pm.out_dim == 0 else "in_out"
    bias = c.args[0] if pm.kind == "addmm" else c.args[2] if pm.kind == "linear" and len(c.args) > 2 else None
    return orientation, operand, bias


def folded_refusal(m: ParamMatmul, dim: int, tp: int, row: bool, segments: tuple[Segment, ...] = ()) -> str | None:
    """Why ``m``'s weight, flattened to a matrix whose merged dim the pair cuts (``dim``, on the stored weight),
    cannot be cut so; None where it can. A rank's slice of the matrix is the flatten of a slice of the weight's
    outermost merged dim (``fold``), so that dim, the heads of XLNet's ``(h, n, d)``, must split among the ranks:
    ``n`` divisible by tp, or for a column ``n`` dividing tp (kv heads fewer than ranks, each held by tp/n; a row
    holding copies would add each of them), and every block of ``segments`` (the matrix's cut, in features) must
    be whole rows of ``d``."""
    if m.fold is None or m.fold[0] != dim:
        return None
    shape = tuple(int(n) for n in m.node.graph.owning_module.get_parameter(m.weight).shape)
    n, rows = shape[dim], m.fold[1]
    what = f"{m.weight} {shape}, read as a matrix whose {n * rows} features are cut on its dim {dim}"
    if n % tp and (row or tp % n):
        return f"{what}: {n} heads are not divisible by tp={tp}"
    blocks = [b for s in segments for b in _blocks(s)]
    bad = next(((size, local) for size, local in blocks if size % rows or local % rows), None)
    if bad is not None:
        return f"{what}: a rank's {bad[1]} of {bad[0]} features are not whole heads of {rows} (tp={tp})"
    return None


def _blocks(s: Segment) -> list[tuple[int, int]]:
    """(size, local size) of ``s`` and of each segment inside it."""
    return [(s.size, s.local()), *(b for i in s.inner for b in _blocks(i))]
