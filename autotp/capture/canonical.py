"""Rewrite a captured graph into the canonical spellings analysis reads, each computing the same values
with the same gradients: index lists of consecutive positions as slices, ``view_as``/``reshape_as`` as views
to the other tensor's sizes, ``unflatten`` as the view it is, an einsum that is a linear map of its last dim
by a matrix as the matmul it is (and one by a parameter whose matrix dims are several letters, in
``weight_matrices.py``), and no identity nodes (views, casts and copies whose output is their input)."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from autotp.capture.autocast import inline_autocast
from autotp.capture.grad_mode import detach_no_grad_regions
from autotp.operators.functions import is_marker
from autotp.capture.einsum import einsums_as_batched_matmuls
from autotp.capture.lookups import row_reads_as_embeddings
from autotp.capture.weight_matrices import weight_matrices_as_linears

aten = torch.ops.aten


def canonicalize(gm: fx.GraphModule) -> None:
    """All the rewrites of this module, in place; the graph is recompiled where one changed it. First the
    bodies of autocast regions are inlined (:mod:`autotp.capture.autocast`), so the rest rewrite them too."""
    changed = [inline_autocast(gm), index_lists_as_slices(gm), row_reads_as_embeddings(gm), views_as_views(gm),
               unflattens_as_views(gm), weight_matrices_as_linears(gm), einsums_as_matmuls(gm),
               einsums_as_batched_matmuls(gm), drop_identities(gm), drop_dtype_asserts(gm), detach_no_grad_regions(gm)]
    if any(changed):
        gm.recompile()


def drop_dtype_asserts(gm: fx.GraphModule) -> bool:
    """Drop export's ``_assert_tensor_metadata`` checks (the dtype each ``.to()`` saw). A capture on meta
    stand-ins (a model on a GPU whose weights are already shards) runs outside that device's autocast, so
    under ``torch.autocast`` the rewritten graph sees bf16 where the capture saw fp32 and the check would
    fail; the ops themselves follow the autocast the call runs in, as the eager model does."""
    asserts = [n for n in gm.graph.nodes if n.target is aten._assert_tensor_metadata.default]
    for node in asserts:
        gm.graph.erase_node(node)
    return bool(asserts)


def views_as_views(gm: fx.GraphModule) -> bool:
    """``x.view_as(other)`` (and ``reshape_as``) as ``x.view(sizes)``: the sizes of ``other`` as captured, with
    ``sym_size`` reads of ``other`` for the symbolic ones (batch, sequence). A view's sizes are what the view
    rule rewrites when it cuts a dim (``view_as(v)`` of a value embedding: [b, s, h] -> [b, s, heads, d])."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.target not in (aten.view_as.default, aten.reshape_as.default) or len(node.args) != 2:
            continue
        x, other = node.args
        val = other.meta.get("val") if isinstance(other, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        with gm.graph.inserting_before(node):
            sizes = []
            for d, n in enumerate(val.shape):
                if isinstance(n, int):
                    sizes.append(n)
                    continue
                size = gm.graph.call_function(aten.sym_size.int, (other, d))
                size.meta["val"] = n
                sizes.append(size)
            view = gm.graph.call_function(aten.view.default if node.target is aten.view_as.default
                                          else aten.reshape.default, (x, sizes))
        view.meta = dict(node.meta)
        node.replace_all_uses_with(view)
        gm.graph.erase_node(node)
        changed = True
    return changed


def unflattens_as_views(gm: fx.GraphModule) -> bool:
    """``x.unflatten(d, sizes)`` as the ``x.view(sizes of x with d replaced by sizes)`` ATen computes it by
    (``[b, s, 3·h] -> [b, s, 4, 3, h/4]``, a fused projection read as chunks): the view rule cuts it and rewrites
    its sizes. The other dims' sizes as captured, ``sym_size`` reads of ``x`` for the symbolic ones."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.target is not aten.unflatten.int or len(node.args) != 3 or node.kwargs:
            continue
        x, dim, sizes = node.args
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(val, torch.Tensor) or not isinstance(dim, int) or not isinstance(sizes, (list, tuple)):
            continue
        dim %= val.dim()
        with gm.graph.inserting_before(node):
            shape = []
            for d, n in enumerate(val.shape):
                if d == dim:
                    shape.extend(sizes)
                elif isinstance(n, int):
                    shape.append(n)
                else:
                    size = gm.graph.call_function(aten.sym_size.int, (x, d))
                    size.meta["val"] = n
                    shape.append(size)
            view = gm.graph.call_function(aten.view.default, (x, shape))
        view.meta = dict(node.meta)
        node.replace_all_uses_with(view)
        gm.graph.erase_node(node)
        changed = True
    return changed


def _einsum_terms(term: str) -> list[str] | None:
    """An einsum operand's subscripts as tokens (``"...bd"`` -> ``["...", "b", "d"]``); None where a letter
    repeats or an ellipsis is anywhere but first."""
    lead = term.startswith("...")
    rest = term[3:] if lead else term
    if not rest.isalpha() or len(set(rest)) != len(rest):
        return None
    return (["..."] if lead else []) + list(rest)


def einsums_as_matmuls(gm: fx.GraphModule) -> bool:
    """``einsum('bnd,vd->bnv', x, W)`` as ``linear(x, W)`` and ``einsum('...d,de->...e', x, W)`` as
    ``matmul(x, W)``: an einsum that contracts the last dim of ``x`` with one dim of a matrix and appends the
    other is that matmul (same values, same gradients), which analysis reads as a projection (an LM head tied
    to the embedding by einsum, a projection written as einsum). Other einsums are left as they are."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.target is not aten.einsum.default or len(node.args) != 2 or not isinstance(node.args[0], str):
            continue
        eq, operands = node.args[0].replace(" ", ""), node.args[1]
        if "->" not in eq or len(operands) != 2 or eq.count(",") != 1:
            continue
        ins, out = eq.split("->")
        subs = [_einsum_terms(t) for t in ins.split(",")]
        outs = _einsum_terms(out)
        if outs is None or any(t is None for t in subs):
            continue
        for wi in (0, 1):
            ws, xs, w, x = subs[wi], subs[1 - wi], operands[wi], operands[1 - wi]
            if len(ws) != 2 or "..." in ws or not xs or xs[-1] not in ws:
                continue
            c = xs[-1]
            k = ws[1] if ws[0] == c else ws[0]
            if k in xs or outs != [*xs[:-1], k]:
                continue
            op = aten.matmul.default if ws == [c, k] else aten.linear.default  # W [in, out] or [out, in]
            with gm.graph.inserting_before(node):
                mm = gm.graph.call_function(op, (x, w))
            mm.meta = dict(node.meta)
            node.replace_all_uses_with(mm)
            gm.graph.erase_node(node)
            changed = True
            break
    return changed


def index_lists_as_slices(gm: fx.GraphModule) -> bool:
    """Read ``x[..., [-2], :]`` as ``x[..., -2:-1, :]``: an index of one dim by a constant list of consecutive
    ascending positions is the slice it equals (same values, same gradient). Public code picks a fused
    projection's key and value heads this way (Falcon's ``qkv[..., [-2], :]``); as a slice, analysis reads
    the fused layout like any other offset slice."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.target is not aten.index.Tensor:
            continue
        x, indices = node.args[0], list(node.args[1])
        picked = [i for i, ix in enumerate(indices) if ix is not None]
        if len(picked) != 1 or picked[0] != len(indices) - 1:
            continue
        d, ix = picked[0], indices[-1]
        size = x.meta["val"].shape[d] if isinstance(x, fx.Node) and "val" in x.meta else None
        values = _constant(gm, ix)
        if not isinstance(size, int) or values is None or values.dim() != 1 or values.numel() == 0 \
                or values.dtype not in (torch.int64, torch.int32) or ((values < -size) | (values >= size)).any():
            continue
        pos = [int(v) % size for v in values]
        if pos != list(range(pos[0], pos[0] + len(pos))):
            continue
        with gm.graph.inserting_before(node):
            sl = gm.graph.call_function(aten.slice.Tensor, (x, d, pos[0], pos[0] + len(pos)))
        sl.meta = dict(node.meta)
        node.replace_all_uses_with(sl)
        gm.graph.erase_node(node)
        for dead in (ix, *ix.all_input_nodes):
            if not dead.users:
                gm.graph.erase_node(dead)
        changed = True
    return changed


def _constant(gm: fx.GraphModule, node: object) -> torch.Tensor | None:
    """The value of a constant tensor node (``get_attr``, or ``lift_fresh_copy`` of one); None otherwise, or on
    meta (a meta capture loses it)."""
    if isinstance(node, fx.Node) and node.target is aten.lift_fresh_copy.default:
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None
    value = gm
    for part in node.target.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) and not value.is_meta else None


# ops that give their input itself, or a view of all of it, when the output has the input's shape, strides,
# dtype and device: ``x.view_as(x)``, ``x.reshape(b, s, c)``, ``x[:]``, ``x.expand_as(x)``, ``x.to(x.dtype)``
_ALIASING = frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default,
    aten.view_as.default, aten.reshape_as.default, aten.expand.default,
    aten.expand_as.default, aten.broadcast_to.default, aten.alias.default,
    aten.slice.Tensor, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
    aten.to.other, aten.type_as.default})
_CASTS = frozenset({aten.to.dtype, aten.to.dtype_layout, aten.to.other, aten.type_as.default, aten._to_copy.default})
# ops that copy: the same values, but a fresh tensor, which only an in-place write can tell from the input
_COPYING = frozenset({aten.clone.default, aten._to_copy.default, aten.contiguous.default})


def drop_identities(gm: fx.GraphModule) -> bool:
    """Remove the nodes whose output is their input: identity views (``x.view_as(x)``, ``x.view(x.shape)``, a
    reshape to the same shape, ``x[:]``, ``x.expand_as(x)``, ``aten.alias``), moves to the device the tensor is
    on, and copies (``x.clone()``, ``contiguous()``) that no in-place write can tell from their input. Casts
    of the dtype (``x.float()``, ``x.type_as(y)``, ``x.to(torch.float32)``) are kept even where the capture saw
    the dtype already: under ``torch.autocast`` the tensor arrives in bf16, and the cast is what the model does.

    Analysis keys a column group by the node its projections read: q, k and v each reading their own
    ``x.view_as(x)`` would each get an all-reduce of the input gradient instead of sharing one. ``detach``
    stops gradients and is kept; so is a copy where any alias of its input or output is written in place or
    returned (the caller could tell them apart), and any node the graph returns itself."""
    changed = False
    for node in list(gm.graph.nodes):
        t = node.target
        if node.op != "call_function" or t not in _ALIASING and t not in _COPYING or not node.args \
                or not isinstance(node.args[0], fx.Node) or any(u.op == "output" for u in node.users):
            continue
        x = node.args[0]
        if not _same_tensor_meta(x.meta.get("val"), node.meta.get("val")):
            continue
        if is_marker(node):
            continue  # where a custom Function's tensor enters or leaves: the runtime calls the Function there
        if t in _CASTS:
            continue  # an identity as captured, but not under autocast: `x.float()` of a bf16 activation
        if (t in _COPYING or _schema_arg(node, "copy") is True) and (_aliases_touched(x) or _aliases_touched(node)):
            continue
        inputs = node.all_input_nodes
        node.replace_all_uses_with(x)
        gm.graph.erase_node(node)
        _erase_dead_sizes(gm.graph, inputs)
        changed = True
    return changed


def _schema_arg(node: fx.Node, name: str) -> object:
    """The argument ``name`` of an aten call, passed by position or keyword (None where it is not)."""
    schema = getattr(node.target, "_schema", None)
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name)
    return None


def _same_tensor_meta(a: object, b: object) -> bool:
    """Same dtype, device, layout and shape, and the same strides on every dim of more than one element
    (symbolic sizes compared by what the shape environment knows, never guarded on)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype \
            or a.device != b.device or a.layout != b.layout or a.layout != torch.strided or a.dim() != b.dim():
        return False
    if not all(statically_known_true(m == n) for m, n in zip(a.shape, b.shape)):
        return False
    return all(statically_known_true(n == 1) or statically_known_true(p == q)
               for n, p, q in zip(a.shape, a.stride(), b.stride()))


def _aliases_touched(node: fx.Node) -> bool:
    """Whether a tensor sharing ``node``'s memory (``node``, the base it views, any view of either) is written
    in place by an op of the graph, or returned by it."""
    base = node
    while _is_alias(base) and isinstance(base.args[0], fx.Node):
        base = base.args[0]
    seen, todo = set(), [base]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u.op == "output" or n in _written(u):
                return True
            if _is_alias(u) and u.args and u.args[0] is n:
                todo.append(u)
    return False


def _is_alias(node: fx.Node) -> bool:
    """``node`` returns (a list of) views of its first argument: a view op by schema (``Tensor(a)``), an op
    that may give its input itself, or an item of a split."""
    t = node.target
    if node.op != "call_function":
        return False
    if t is operator.getitem:
        return isinstance(node.args[0], fx.Node) and _is_alias(node.args[0])
    if t in _ALIASING:
        return True
    schema = getattr(t, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None \
        and bool(schema.arguments) and schema.arguments[0].alias_info is not None


def _written(node: fx.Node) -> list[fx.Node]:
    """The tensors ``node`` writes in place: its schema's ``Tensor(a!)`` arguments; every tensor argument of a
    call whose effects are unknown (a submodule, a higher-order op), apart from export's input guards."""
    t = node.target
    if node.op == "call_module":
        return [] if str(t).startswith("_guards") else list(node.all_input_nodes)
    if node.op != "call_function" or t is operator.getitem:
        return []
    schema = getattr(t, "_schema", None) if isinstance(t, torch._ops.OpOverload) else None
    if schema is None:
        return [x for x in node.all_input_nodes if isinstance(x.meta.get("val"), torch.Tensor)]
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            out += [x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, fx.Node)]
    return out


def _erase_dead_sizes(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase the size computations (``sym_size``, products of sizes) that only a removed node read."""
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if n.users or n.op != "call_function" or isinstance(n.meta.get("val"), torch.Tensor) \
                or not isinstance(n.meta.get("val"), (int, torch.SymInt)):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        todo.extend(inputs)
