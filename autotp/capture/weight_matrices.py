"""A parameter of several dims read as a matrix, written as the linear map it is, so analysis reads a weight kept
as ``(d_model, n_head, d_head)`` (XLNet's attention, ``einsum("ibh,hnd->ibnd", x, W)`` and
``einsum("ibnd,hnd->ibh", a, O)``) as the column or row projection it is.

- An einsum of an activation ``x`` by a parameter ``W`` (through casts) in which every letter of ``W`` is
  either contracted with ``x`` (the input features ``C``) or kept in the output (the output features ``K``),
  ``W``'s letters being ``[C.., K..]`` or ``[K.., C..]`` in that order, ``x`` ending with ``C`` and the output
  being ``x``'s other letters then ``K``, is the matmul of ``x`` flattened over ``C`` by ``W`` flattened to a
  matrix, viewed back to ``K``: the same values and gradients. An einsum where a letter of ``W`` is also a
  batch letter (a weight per head, ``"ibnd,snd->ibns"``) is left as it is.
- ``torch.tensordot(x, W, dims)`` is that einsum (``x``'s free dims, then ``W``'s), rewritten alike.
- ``W.reshape(h, -1)`` (or ``view``) of such a parameter to a matrix that merges its leading or its trailing
  dims is ``W.flatten(..)``.

``W`` is flattened with ``flatten`` (no sizes written down, so a rank's slice of ``W`` flattens to its own
slice of the matrix) and ``x``'s ``C`` and the output's ``K`` with views of their sizes (those a sharded dim
changes are rewritten where they are cut, as the model's own ``view(b, s, heads, d)`` is).

Before::

    q = aten.einsum("ibh,hnd->ibnd", [x, W])          # W (h, n, d)
    o = aten.einsum("ibnd,hnd->ibh", [a, O])          # O (h, n, d)

After::

    q = aten.view(aten.matmul(x, aten.flatten(W, 1, 2)), [i, b, n, d])    # W as (h, n·d): [in, out]
    o = aten.linear(aten.reshape(a, [i, b, n·d]), aten.flatten(O, 1, 2))  # O as (h, n·d): [out, in]
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

aten = torch.ops.aten

# casts a weight may pass through on its way to the einsum (mixed precision)
_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default)


def _parameter(gm: fx.GraphModule, node: object) -> bool:
    """Is ``node`` a floating parameter of 3 or more dims, read whole or through casts?"""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _CASTS:
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return False
    try:
        p = gm.get_parameter(node.target)
    except AttributeError:  # a buffer or constant: not a weight the plan cuts
        return False
    return p.dim() >= 3 and p.dtype.is_floating_point


def _call(gm: fx.GraphModule, op, args: tuple, meta: dict) -> fx.Node:
    node = gm.graph.call_function(op, args)
    vals = fx.node.map_arg(args, lambda a: a.meta["val"])  # (sizes in a list are nodes too)
    node.meta = {k: v for k, v in meta.items() if k not in ("val", "tensor_meta")}
    node.meta["val"] = op(*vals)  # on the captured fake tensors: shapes (symbolic ones too) and dtypes
    return node


def _sizes(gm: fx.GraphModule, x: fx.Node, dims: range, meta: dict) -> list:
    """The sizes of ``x``'s ``dims`` as a view writes them: ints, ``sym_size`` reads for the symbolic ones."""
    out = []
    for d in dims:
        n = x.meta["val"].shape[d]
        if isinstance(n, int):
            out.append(n)
        else:
            out.append(_call(gm, aten.sym_size.int, (x, d), meta))
    return out


def _rewrite(gm: fx.GraphModule, node: fx.Node, x: fx.Node, w: fx.Node, xs: str, ws: str, out: str) -> bool:
    contracted = [c for c in ws if c in xs and c not in out]
    kept = [c for c in ws if c in out and c not in xs]
    if len(contracted) + len(kept) != len(ws) or not contracted or not kept or len(ws) < 3:
        return False
    c, k = "".join(contracted), "".join(kept)
    if ws not in (c + k, k + c) or not xs.endswith(c) or out != xs[:-len(c)] + k:
        return False
    shape = w.meta["val"].shape
    lead = xs[:-len(c)]
    meta = node.meta
    with gm.graph.inserting_before(node):
        # W as a matrix: its C letters one dim, its K letters the other, in the order it stores them
        first = len(c) if ws == c + k else len(k)
        wm = w
        if first > 1:
            wm = _call(gm, aten.flatten.using_ints, (wm, 0, first - 1), meta)
        if len(ws) - first > 1:
            wm = _call(gm, aten.flatten.using_ints, (wm, 1, 1 + len(ws) - first - 1), meta)
        xm = x
        if len(c) > 1:  # (.., C..) -> (.., prod C)
            width = math.prod(int(shape[ws.index(ch)]) for ch in c)
            xm = _call(gm, aten.reshape.default, (x, [*_sizes(gm, x, range(len(lead)), meta), width]), meta)
        op = aten.matmul.default if ws == c + k else aten.linear.default  # W [in, out] or [out, in]
        y = _call(gm, op, (xm, wm), meta)
        if len(k) > 1:  # (.., prod K) -> (.., K..)
            y = _call(gm, aten.view.default,
                      (y, [*_sizes(gm, y, range(len(lead)), meta), *(int(shape[ws.index(ch)]) for ch in k)]), meta)
    y.meta = dict(node.meta)
    node.replace_all_uses_with(y)
    gm.graph.erase_node(node)
    return True


def _letters(n: int, start: int = 0) -> str:
    return "".join(chr(ord("a") + start + i) for i in range(n))


def _tensordot_terms(node: fx.Node) -> tuple[str, str, str] | None:
    """``tensordot(x, W, dims_x, dims_w)`` as einsum terms (x's, W's, the output's), or None."""
    x, w = node.args[:2]
    dx, dw = node.args[2:4] if len(node.args) >= 4 else (None, None)
    if not (isinstance(dx, (list, tuple)) and isinstance(dw, (list, tuple)) and len(dx) == len(dw)):
        return None
    nx, nw = x.meta["val"].dim(), w.meta["val"].dim()
    dx, dw = [d % nx for d in dx], [d % nw for d in dw]
    xs, ws = list(_letters(nx)), list(_letters(nw, nx))
    for a, b in zip(dx, dw):
        ws[b] = xs[a]
    out = [c for i, c in enumerate(xs) if i not in dx] + [c for i, c in enumerate(ws) if i not in dw]
    return "".join(xs), "".join(ws), "".join(out)


# what reads a weight as a matrix: a matmul, or a transpose before one
_MATRIX_READS = (aten.matmul.default, aten.mm.default, aten.linear.default, aten.t.default, aten.transpose.int,
                 aten.permute.default)


def _reshape_as_flatten(gm: fx.GraphModule, node: fx.Node) -> bool:
    """``W.reshape(sizes)`` of a parameter to a matrix merging its leading or trailing dims, read as a matrix, as a
    flatten (a reshape read otherwise, a depthwise filter's, is left as the model wrote it)."""
    w, val = node.args[0], node.meta.get("val")
    if not _parameter(gm, w) or not isinstance(val, torch.Tensor) or val.dim() != 2 \
            or not node.users or any(u.target not in _MATRIX_READS for u in node.users):
        return False
    shape = [int(n) for n in w.meta["val"].shape]
    if list(val.shape) == [shape[0], math.prod(shape[1:])]:
        span = (1, len(shape) - 1)
    elif list(val.shape) == [math.prod(shape[:-1]), shape[-1]]:
        span = (0, len(shape) - 2)
    else:
        return False
    with gm.graph.inserting_before(node):
        flat = _call(gm, aten.flatten.using_ints, (w, *span), node.meta)
    flat.meta = dict(node.meta)
    node.replace_all_uses_with(flat)
    gm.graph.erase_node(node)
    return True


def weight_matrices_as_linears(gm: fx.GraphModule) -> bool:
    """Rewrite the reads described in the module doc, in place; whether any was."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.target in (aten.reshape.default, aten.view.default):
            changed |= _reshape_as_flatten(gm, node)
            continue
        if node.target is aten.tensordot.default and all(isinstance(a, fx.Node) for a in node.args[:2]):
            terms = _tensordot_terms(node)
            x, w = node.args[:2]
            if terms is not None and not _parameter(gm, x) and _parameter(gm, w):
                changed |= _rewrite(gm, node, x, w, *terms)
            continue
        if node.target is not aten.einsum.default or not isinstance(node.args[0], str) or len(node.args[1]) != 2:
            continue
        eq = node.args[0].replace(" ", "")
        if "->" not in eq or "." in eq or eq.count(",") != 1:
            continue
        ins, out = eq.split("->")
        subs = ins.split(",")
        if any(len(set(s)) != len(s) for s in (*subs, out)):
            continue
        for wi in (0, 1):
            w, x = node.args[1][wi], node.args[1][1 - wi]
            if not isinstance(x, fx.Node) or not isinstance(x.meta.get("val"), torch.Tensor) \
                    or _parameter(gm, x) or not _parameter(gm, w):
                continue
            if _rewrite(gm, node, x, w, subs[1 - wi], subs[wi], out):
                changed = True
                break
    return changed
