"""One capture per test model, shared by the structural tests that plan it: tests/analysis/test_spelling_plans.py and
each family's own module plan the same spellings, and tests/passes/test_structure.py and tests/passes/test_sequence.py the
same small models; torch.export of a tiny model costs seconds where planning it or copying its graph costs a
fraction of one. The tests that share them are in one xdist group (:data:`SHARED`), so that one worker
captures each model once."""
from __future__ import annotations

import copy
import functools
import importlib
import warnings

import pytest
import torch.fx as fx
import torch.nn as nn

from autotp.capture.tracer import capture

# the xdist group of the tests that read these captures (pyproject's ``--dist loadgroup``)
SHARED = pytest.mark.xdist_group("shared-graphs")


def _build(module: str, kind: str) -> tuple[nn.Module, tuple, dict]:
    """A module of tests/support's model and inputs: ``build(kind)``, small_models' ``MODELS[kind]()`` or
    toy_models' ``toy(kind)``."""
    models = importlib.import_module(module)
    if module == "small_models":
        return models.MODELS[kind]()
    if module == "toy_models":
        return models.toy(kind)
    return models.build(kind)


@functools.cache
def _captured(module: str, kind: str) -> tuple[nn.Module, tuple, dict, fx.GraphModule]:
    model, args, kwargs = _build(module, kind)
    return model, args, kwargs, capture(model, args, kwargs)[0]


def spelling(module: str, kind: str) -> tuple[nn.Module, tuple, dict, fx.GraphModule]:
    """The model, inputs and graph of ``module``'s ``kind`` (:func:`_build`), captured once per process.
    Callers read the model and plan the graph (``make_plan``); a pass that rewrites the graph takes
    :func:`copy_graph` of it, and a call that changes the model needs a capture of its own. Planning writes its
    facts on the graph's nodes (``node.meta["autotp"]``), which a later analysis reads: they are dropped here,
    so each caller plans the graph as captured."""
    model, args, kwargs, gm = _captured(module, kind)
    for n in gm.graph.nodes:
        n.meta.pop("autotp", None)
    return model, args, kwargs, gm


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a shared graph for the passes to rewrite (its nodes keep their names, which a plan reads)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own copy of the graph's pytree specs
        return copy.deepcopy(gm)
