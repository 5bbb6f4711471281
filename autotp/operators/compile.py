"""``parallelize(..., compile=True)``: ``torch.compile`` over each rewritten graph module.

The rewritten graph already holds everything a compiler needs to see: Megatron's f/g as autograd functions
over ``torch.distributed._functional_collectives`` (traceable: dynamo puts ``_c10d_functional.all_reduce`` /
``wait_tensor`` in the graph; on CPU the all-reduces are ``autotp.all_reduce``, a polled c10d all-reduce),
the vocab-parallel loss as an autograd function, and the vocab-parallel logits as a
:class:`~autotp.operators.gathered.GatheredOnUse` made outside the compiled region. :func:`compile_graph`
compiles with ``fullgraph=False`` so a construct dynamo cannot trace degrades to a graph break instead of an
error; :func:`graph_breaks` counts them (see ``tests/runtime/test_compile.py``).
"""
from __future__ import annotations

import torch
import torch._dynamo
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from autotp.operators.collectives import define_ops
from autotp.operators.gathered import local_outputs
from autotp.operators.pieces import PieceCall


# The vocab-parallel cross-entropy's backward picks the target column of the rows this rank owns with
# ``mine.nonzero()`` (autotp/operators/vocab_ops.py, _VocabCE.backward). Dynamo traces an autograd.Function's
# backward when it meets ``.apply`` in the forward; a data-dependent output shape there makes the whole Function fall
# back to eager, splitting the graph in three (2 breaks: "Dynamic shape operator aten.nonzero.default").
# Letting dynamo capture data-dependent output shapes (unbacked symints) keeps it in one graph.
DYNAMO_CONFIG = {"capture_dynamic_output_shape_ops": True}
# Inductor moves compute between a functional collective's launch and its wait where the graph allows (the
# backward all-reduces of the input gradients; on accelerators: CPU all-reduces are autotp.all_reduce, which
# it keeps whole). With functional collectives on CPU it measured 127 -> 121 ms per step at tp 2.
INDUCTOR_CONFIG = {"reorder_for_compute_comm_overlap": True}


class CompiledGraph(nn.Module):
    """``torch.compile`` of one rewritten graph module, traced under :data:`DYNAMO_CONFIG`.

    Vocab-parallel logits leave the compiled region as plain local tensors and are wrapped outside it: a
    tensor subclass output traced in would make AOTAutograd expect a subclass tangent for it, and a step
    that only calls ``loss.backward()`` hands it a plain zero tangent instead. The wrapping moves no data,
    so nothing is lost by doing it eagerly.
    """

    def __init__(self, gm: fx.GraphModule, **options) -> None:
        super().__init__()
        options.setdefault("fullgraph", False)
        # inductor's options for this compilation only (forward and backward), not the process-wide config
        if options.get("backend", "inductor") == "inductor":
            options["options"] = {**INDUCTOR_CONFIG, **options.get("options", {})}
        define_ops()
        self.__dict__["graph_module"] = gm  # not a submodule: parameters stay where TPModule put them
        inner, self._wrap = local_outputs(gm)
        self.compiled = torch.compile(inner, **options)

    def forward(self, *args, **kwargs):
        with torch._dynamo.config.patch(**DYNAMO_CONFIG):
            out = self.compiled(*args, **kwargs)
        if not self._wrap:
            return out
        leaves, spec = pytree.tree_flatten(out)
        for i, module in self._wrap.items():
            leaves[i] = module(leaves[i])
        return pytree.tree_unflatten(leaves, spec)


def compile_graph(gm: fx.GraphModule, **options) -> nn.Module:
    """``torch.compile(gm)`` (dynamic batch/sequence, as captured); options go to ``torch.compile``."""
    return CompiledGraph(gm, **options)


def compile_pieces(module: nn.Module, **options) -> None:
    """Each :class:`~autotp.operators.pieces.PieceCall` in ``module`` (a graph split at FSDP's units or at
    pipeline stages, or one piece) runs its piece compiled (:func:`compile_graph`); the top graph, which only
    calls the pieces (through FSDP's hooks), stays eager, as torchtitan compiles each block or stage and
    leaves FSDP's hooks around it."""
    for m in list(module.modules()):
        if isinstance(m, PieceCall) and not isinstance(m.piece, CompiledGraph):
            m.piece = compile_graph(m.piece, **options)


def uncompiled(module: nn.Module) -> nn.Module:
    """The graph module behind a :func:`compile_graph` result (or ``module`` itself)."""
    return module.__dict__["graph_module"] if isinstance(module, CompiledGraph) else getattr(module, "_orig_mod", module)


def graph_breaks(fn, *args, **kwargs) -> dict:
    """``torch._dynamo.explain`` of ``fn(*args, **kwargs)`` as plain data: graphs, breaks and their reasons."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(**DYNAMO_CONFIG):
        out = torch._dynamo.explain(fn)(*args, **kwargs)
    return {
        "graphs": out.graph_count,
        "breaks": out.graph_break_count,
        "reasons": [str(getattr(r, "reason", r)) for r in out.break_reasons],
        "ops": out.op_count,
    }
