"""A block whose forward branches on the data captures as one opaque call: the rest of the model is a graph.

The reference mixture-of-experts loop (``for i, expert in enumerate(self.experts): mask = idx == i; if
mask.any(): out.index_add_(0, torch.nonzero(mask)..., expert(x[mask]) * w)``, or ``torch.where(mask)``) asks
Python for a value only the batch decides; export cannot capture it, and before this the whole model failed.
When an export fails on such a data-dependent check, the module whose own code asked (the innermost module of
the model in the failure's stack, never the root) becomes an *island*: it is exported again with that
module's forward standing in as one ``autotp::island`` op, which takes the block's flat tensor inputs and
returns its flat outputs. The op's output shapes come from one eager run of the block on random tensors of the
inputs' sizes and random weights of its parameters' shapes (only shapes are read), each output size written
as the input size it equals (a dim, or the product of leading dims: ``b·s`` tokens), else as a constant.

The graph node names the block by its module path (``ISLANDS_KEY`` of the graph's meta lists them); at run
time it calls the block itself (:mod:`autotp.operators.islands`), sharded by :mod:`autotp.plan.islands`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import _disable_current_modes

from autotp.capture.structure import flatten, unflatten

__all__ = ["ISLANDS_KEY", "DTYPES", "define_island_op", "hint", "island_for", "islanded", "is_island"]

ISLANDS_KEY = "autotp_islands"  # the exported GraphModule's ``meta`` entry: the islands' module paths
# an output's dtype, by its index here (a custom op's schema has no list of dtypes)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
          torch.int8, torch.uint8, torch.int16, torch.complex64)


def define_island_op() -> None:
    """``torch.ops.autotp.island(path, xs, sizes, ranks, dtypes) -> Tensor[]`` (once per process): ``sizes``
    holds every output's sizes one after another, ``ranks`` each output's number of dims, ``dtypes`` each
    one's index in :data:`DTYPES`. Only its fake kernel runs: at run time the node calls the block."""
    if hasattr(torch.ops.autotp, "island"):
        return
    torch.library.define("autotp::island", "(str path, Tensor[] xs, SymInt[] sizes, int[] ranks, int[] dtypes) "
                                           "-> Tensor[]")

    @torch.library.impl("autotp::island", "CompositeExplicitAutograd")
    def _eager(path, xs, sizes, ranks, dtypes):
        raise RuntimeError(f"autotp: the island {path} runs through its graph's call (autotp.operators.islands)")

    @torch.library.register_fake("autotp::island")
    def _fake(path, xs, sizes, ranks, dtypes):
        device = xs[0].device if xs else torch.device("cpu")
        out, at = [], 0
        for rank, code in zip(ranks, dtypes):
            out.append(torch.empty(tuple(sizes[at:at + rank]), dtype=DTYPES[code], device=device))
            at += rank
        return out


def is_island(node: object) -> bool:
    return getattr(node, "op", None) == "call_function" and hasattr(torch.ops.autotp, "island") and \
        node.target is torch.ops.autotp.island.default


def _data_dependent(e: BaseException | None) -> bool:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    kinds = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)
    while e is not None:
        if isinstance(e, kinds) or "data-dependent" in str(e).split("\n", 1)[0]:
            return True
        e = e.__cause__ or e.__context__
    return False


def island_for(e: BaseException, model: nn.Module, user_code, known: Sequence[str]) -> str | None:
    """The module path to run as an island for export failure ``e``: the innermost module of ``model`` whose own
    code (``user_code(file)``) is in the failure's stack, where the failure is a data-dependent check; None
    for any other failure, for the root, or for a module already an island."""
    if not _data_dependent(e):
        return None
    paths = {id(m): p for p, m in model.named_modules()}
    found = None
    while e is not None:
        tb = e.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in paths and user_code(frame.f_code.co_filename):
                found = paths[id(owner)]
            tb = tb.tb_next
        if found is not None:
            break
        e = e.__cause__ or e.__context__
    return found if found and found not in known else None


@contextlib.contextmanager
def islanded(model: nn.Module, paths: Sequence[str], specs: dict) -> Iterator[None]:
    """Each module at ``paths`` exported as one island op (its forward replaced for the export; the caller's
    ``preserved`` puts the module's ``__dict__`` back); ``specs``: path -> the structure of its inputs, as
    the trace called it."""
    if paths:
        define_island_op()
    for path in paths:
        module = model.get_submodule(path)
        module.__dict__["forward"] = _island_forward(module, path, specs)
    yield


def _island_forward(module: nn.Module, path: str, specs: dict):
    def forward(*args, **kwargs):
        tensors, specs[path] = flatten((args, kwargs))
        outs, out_spec = _probe(module, args, kwargs)
        first = next((t for t in tensors if t.dim() > 0), None)
        sizes, ranks, codes = [], [], []
        for t in outs:
            sizes += [_size(n, t.shape, i, first) for i, n in enumerate(t.shape)]
            ranks.append(t.dim())
            codes.append(DTYPES.index(t.dtype))
        flat = torch.ops.autotp.island(path, list(tensors), sizes, ranks, codes)
        return unflatten(list(flat), out_spec)

    return forward


def hint(s: object) -> int:
    if isinstance(s, torch.SymInt):
        return int(s.node.hint) if s.node.hint is not None else int(s.node.shape_env.sizehint(s.node.expr))
    return int(s)


def _size(n: int, shape: torch.Size, i: int, first: torch.Tensor | None) -> object:
    """Output size ``n`` (dim ``i`` of ``shape``) as the input's size it equals: the same dim of an input of
    the same rank first, then any dim, then a product of leading dims; else the constant."""
    if first is None:
        return n
    dims = list(first.shape)
    if len(shape) == len(dims) and hint(dims[i]) == n:
        return dims[i]
    for d in dims:
        if hint(d) == n:
            return d
    prod = dims[0]
    for d in dims[1:]:
        prod = prod * d
        if hint(prod) == n:
            return prod
    return n


def _probe(module: nn.Module, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], object]:
    """The block run eagerly on random tensors of its inputs' (hinted) sizes, with random weights of its
    parameters' shapes: its flat outputs (shapes and dtypes are all that is read) and their structure."""
    gen = torch.Generator().manual_seed(0)

    def real(t: object) -> object:
        if not isinstance(t, torch.Tensor):
            return t
        shape = tuple(hint(s) for s in t.shape)
        if t.is_floating_point():
            return torch.randn(shape, generator=gen).to(t.dtype)
        return torch.zeros(shape, dtype=t.dtype)

    with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
        state = {n: real(t) for n, t in [*module.named_parameters(remove_duplicate=False),
                                         *module.named_buffers(remove_duplicate=False)]}
        a, k = pytree.tree_map(real, (tuple(args), dict(kwargs)))
        with _reparametrize_module(module, state):
            out = type(module).forward(module, *a, **k)
    tensors, spec = flatten(out)
    return list(tensors), spec
