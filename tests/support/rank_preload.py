"""What every rank imports before its job, imported once in the fork server the ranks are forked from.

Importing has no side effects here (no thread, no process group, no computation on real tensors: one capture
of a tiny block on meta warms the exporter), so a fork of a server that imported these starts as a fresh
process would after importing them, without paying it again: every module of
autotp (its analysis, passes and operators load on a rank's first ``parallelize``), the parts of torch export
and the compiler's caches that capture loads on first use, and the test helpers most jobs run.
"""
from __future__ import annotations

import gc
import importlib
import pkgutil

import torch
import torch.distributed  # noqa: F401
import transformers.models.gpt2.modeling_gpt2  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401

import autotp

# loaded by torch.export, the fake-tensor caches and FLOP counting on a rank's first capture
_TORCH = ["torch._inductor.codecache", "torch._inductor.fx_passes.dedupe_symint_uses", "torch.fx.experimental.validator",
          "torch._subclasses.schema_check_mode", "torch.utils.flop_counter", "torch.utils.module_tracker",
          "torch.fx._graph_pickler", "sympy.combinatorics", "sympy.tensor.tensor", "torch.export"]
# the helpers most rank jobs run (they import the models every parity test trains)
_HELPERS = ["ranks", "small_models", "parity_workers", "pattern_models"]

for _info in pkgutil.walk_packages(autotp.__path__, "autotp."):
    importlib.import_module(_info.name)
for _name in _TORCH + _HELPERS:
    try:  # a module another torch no longer has costs its rank the import, not the whole preload
        importlib.import_module(_name)
    except ImportError:
        pass


def _first_capture() -> None:
    """One capture of a tiny block on meta: what a process's first torch.export sets up once (the tracer's and
    the symbolic shapes' caches, dispatch tables, decompositions) is then the server's, not every rank's (about
    0.25 s of each rank's first capture). Meta tensors compute nothing, so no thread pool starts."""
    import torch.nn as nn
    import torch.nn.functional as F

    from autotp.capture.tracer import capture

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.proj = nn.Embedding(16, 8), nn.Linear(8, 8)

        def forward(self, idx, targets):
            h = F.layer_norm(self.emb(idx), (8,))
            h = (h @ h.transpose(-2, -1)).softmax(-1) @ h
            return F.cross_entropy(self.proj(F.gelu(h)).view(-1, 8), targets.view(-1).clamp(max=7))

    with torch.device("meta"):
        block = Block()
    ids = torch.zeros(2, 4, dtype=torch.long)
    capture(block, (ids, ids), {})


_first_capture()
# ranks forked from here leave what was imported out of their garbage collections: otherwise every full
# collection walks (and so copies, page by page) the whole imported heap in every rank
gc.freeze()
