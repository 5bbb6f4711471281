"""What every rank imports before its job, imported once in the fork server the ranks are forked from.

Importing has no side effects here (no thread, no process group, no computation), so a fork of a server that
imported these starts as a fresh process would after importing them, without paying it again: every module of
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
# ranks forked from here leave what was imported out of their garbage collections: otherwise every full
# collection walks (and so copies, page by page) the whole imported heap in every rank
gc.freeze()
