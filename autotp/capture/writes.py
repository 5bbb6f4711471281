"""What a forward writes on its model, seen while it is exported, so every later call writes it too.

A forward may leave state on the model: ``self.last_loss = F.cross_entropy(...)``, a rotary or mask cache
built on first use (``if self.cache is None: self.cache = build(n)``), a buffer re-registered or grown, a
dict of masks filled, a counter or a flag. Capture puts the model back as it was
(:mod:`autotp.capture.preserve`), so the captured graph alone would never write any of it. Here the
exported forward is watched: each module's ``__dict__`` (its buffers, and the entries of the dicts it holds)
is compared before and after the call, and every write becomes part of the captured call:

* a tensor value (or a structure holding tensors: a tuple of cos and sin tables) is returned by the graph
  as extra flat outputs after the forward's own, and assigned after each call (sharded values gathered on
  use, as outputs are);
* a Python value is replayed as it was written (``self.ready = True``); a size read off the inputs
  (``self.seq_len_cached = n``) is returned as the length of an empty tensor, so no value is synchronised;
* a parameter or buffer of the model assigned to an attribute is assigned by reference;
* a write that cannot be replayed (a list grown in place, a parameter replaced, a value computed from a
  float the trace made symbolic) is named in :attr:`Writes.named` and said once at run time.

A buffer re-assigned in forward is a new object on one device (``self.freqs_cis = self.freqs_cis.to(dev)``
rebinds the name, it never writes the table autograd saved): export records it as a ``copy_`` into the
buffer at the end of the graph, which bumps the version of the tensor a backward needs. :func:`drop_buffer_copies`
removes those copies: a value that is the buffer itself (a ``.to`` that changes nothing) writes nothing, and
any other is rebound after the call, as one device does. In-place writes the forward makes (a KV cache's
``cache[:, pos] = k``) stay in the graph where they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from autotp.capture.structure import Spec, flatten

__all__ = ["Write", "Writes", "StateWatch", "drop_buffer_copies", "WRITES_KEY"]

WRITES_KEY = "autotp_writes"  # the exported GraphModule's ``meta`` entry holding its :class:`Writes`

# torch's own bookkeeping in every module's __dict__ (and the forward capture patches in): never the model's state
_INTERNAL = frozenset(nn.Module().__dict__) | {"forward"}  # autotp's own state object is never rebound in forward
_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)
_ALIASES = {torch.ops.aten.to.dtype_layout, torch.ops.aten.to.dtype, torch.ops.aten.to.device,
            torch.ops.aten.to.other, torch.ops.aten._to_copy.default, torch.ops.aten.alias.default,
            torch.ops.aten.detach.default, torch.ops.aten.clone.default, torch.ops.aten.contiguous.default,
            torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.lift_fresh_copy.default}


@dataclass(frozen=True)
class Write:
    """One piece of state a call writes: ``kind`` "attr" (``module.name = value``), "buffer" (the buffer
    ``name`` rebound to value), "item" (``getattr(module, name)[key] = value``) or "delete" (``del
    module.name``). ``value``'s "tensor" leaves index the extra outputs; "size" leaves are an int read off an
    extra output's first dim; "ref" leaves name a parameter or buffer of the model."""

    path: str  # the module's path in the model ("" for the root)
    name: str
    kind: str
    value: Spec | None = None
    key: object = None
    persistent: bool = True  # a buffer registered by the write: whether it is saved in the state dict

    @property
    def where(self) -> str:
        at = f"{self.path}.{self.name}" if self.path else self.name
        return f"{at}[{self.key!r}]" if self.kind == "item" else at


@dataclass(frozen=True)
class Writes:
    """A captured call's writes: the flat output index of its first extra output, the writes in the order the
    forward made them, and those that cannot be replayed, each as ``"where: why"``."""

    first: int
    items: tuple[Write, ...] = ()
    named: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.items or self.named)


class StateWatch:
    """Snapshot every module's state before the exported forward runs; :meth:`writes` compares after it."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = list(model.named_modules())  # one path per module: the one named_buffers keeps
        self.before = [(dict(m.__dict__), dict(m._buffers), dict(m._parameters),
                        {k: dict(v) for k, v in m.__dict__.items() if type(v) is dict and k not in _INTERNAL},
                        {k: list(v) for k, v in m.__dict__.items() if type(v) is list and k not in _INTERNAL})
                       for _, m in self.modules]
        # parameters and buffers as the forward sees them (export's fake ones): an attribute set to one is a reference
        self.refs = {id(t): f"{p}.{n}" if p else n for p, m in self.modules
                     for n, t in [*m._parameters.items(), *m._buffers.items()] if t is not None}

    def writes(self, first: int) -> tuple[list[torch.Tensor], Writes, set[str]]:
        """The extra outputs (tensors the forward wrote), the :class:`Writes` replaying them from flat output
        ``first`` on, and the buffers (by path) the forward rebound to a new value."""
        extra: list[torch.Tensor] = []
        items: list[Write] = []
        named: list[str] = []
        rebound: set[str] = set()

        def value(v: object, where: str) -> Spec | None:
            sizes: set[int] = set()

            def carry(x: object) -> object:
                if isinstance(x, torch.SymInt):  # the size as an empty tensor's length: no value is read back
                    t = torch.empty((x, 0))
                    sizes.add(id(t))
                    return t
                return x

            v = carry(v) if isinstance(v, _SYM) else pytree.tree_map(carry, v)
            if isinstance(v, _SYM) or any(isinstance(x, _SYM) for x in pytree.tree_leaves(v)):
                named.append(f"{where}: a value computed from a traced float or bool, which a graph cannot return")
                return None
            tensors, spec = flatten(v)
            spec = _relink(spec, tensors, first, self.refs, extra, sizes)
            if spec is None:
                named.append(f"{where}: a traced size inside an object the graph cannot return")
            return spec

        for (path, m), (attrs, buffers, params, dicts, lists) in zip(self.modules, self.before):
            at = f"{path}." if path else ""
            for name, v in m.__dict__.items():
                if name in _INTERNAL:
                    continue
                if name not in attrs or v is not attrs[name]:
                    spec = value(v, at + name)
                    if spec is not None:
                        items.append(Write(path, name, "attr", spec))
                elif name in dicts and type(v) is dict:
                    old = dicts[name]
                    for k, x in v.items():
                        if k not in old or x is not old[k]:
                            spec = value(x, f"{at}{name}[{k!r}]")
                            if spec is not None:
                                items.append(Write(path, name, "item", spec, key=k))
                    if any(k not in v for k in old):
                        named.append(f"{at}{name}: entries removed from a dict in forward are not replayed")
                elif name in lists and type(v) is list and (len(v) != len(lists[name]) or
                                                              any(a is not b for a, b in zip(v, lists[name]))):
                    named.append(f"{at}{name}: a list changed in place in forward is not replayed")
            for name in attrs:
                if name not in m.__dict__ and name not in _INTERNAL:
                    items.append(Write(path, name, "delete"))
            for name, b in m._buffers.items():
                if name not in buffers or b is not buffers[name]:
                    spec = value(b, at + name)
                    if spec is not None:
                        items.append(Write(path, name, "buffer", spec,
                                           persistent=name not in m._non_persistent_buffers_set))
                        rebound.add(at + name)
            for name, p in m._parameters.items():
                if name not in params or p is not params[name]:
                    named.append(f"{at}{name}: a parameter replaced in forward is not replayed (its optimizer "
                                 "state and shards are the ones parallelize made)")
        return extra, Writes(first, tuple(items), tuple(named)), rebound


def _relink(spec: Spec, tensors: list[torch.Tensor], first: int, refs: dict[int, str],
            extra: list[torch.Tensor], sizes: set[int]) -> Spec | None:
    """``spec`` (from :func:`flatten` of a written value) with its tensors appended to ``extra`` (flat output
    ``first + i`` is ``extra[i]``): a size carrier (in ``sizes``) as a "size" leaf, a parameter or buffer of
    the model as a "ref"; None where a traced value is left in it (an object walked through its fields)."""
    if spec.kind == "tensor":
        t = tensors[spec.value]
        if id(t) in refs:
            return Spec("ref", refs[id(t)])
        extra.append(t)
        return Spec("size" if id(t) in sizes else "tensor", first + len(extra) - 1)
    if spec.kind == "const":
        return None if isinstance(spec.value, _SYM) else spec
    if spec.kind == "object" and spec.value in (torch.SymInt, torch.SymFloat, torch.SymBool):
        return None
    children = tuple(_relink(c, tensors, first, refs, extra, sizes) for c in spec.children)
    if any(c is None for c in children):
        return None
    return Spec(spec.kind, spec.value, spec.keys, children)


def drop_buffer_copies(gm: fx.GraphModule, rebound: set[str]) -> None:
    """Remove the ``copy_`` export puts at the end of the graph for a buffer the forward re-assigned: one
    whose value is the buffer itself (through ``.to``/views that change nothing) writes nothing; one in
    ``rebound`` (paths) is returned and rebound after the call (:class:`Write` "buffer"). A ``copy_`` is
    export's when nothing reads it and nothing after it reads the buffer."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    dropped = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default or node.users:
            continue
        dst, src = node.args[0], node.args[1]
        if not isinstance(dst, fx.Node) or dst.op != "get_attr" or not isinstance(src, fx.Node):
            continue
        if any(order[u] > order[node] for u in dst.users):
            continue
        if dst.target in rebound or _same_as(src, dst):
            gm.graph.erase_node(node)
            dropped = True
    if dropped:
        gm.recompile()


def _same_as(src: fx.Node, dst: fx.Node) -> bool:
    """Whether ``src`` is ``dst`` through ops that keep its values, shape and dtype."""
    want = dst.meta.get("val")
    node = src
    while isinstance(node, fx.Node) and node is not dst and node.op == "call_function" and node.target in _ALIASES:
        node = node.args[0]
    got = src.meta.get("val")
    return node is dst and isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and \
        got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
