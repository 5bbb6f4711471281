"""Every spelling the parity tests train, planned at tp 2 and 4 without a process group: nothing replicated,
every weight of two or more dims cut or listed with its reason, and each rank's share of the parameters about
1/tp. The parity tests train each module's representative spellings at tp 2 by default and every spelling at
tp 2 and 4 in the extended run (tests/support/spelling_runs.py); this is what holds the plans of the others
between extended runs. Each capture is shared with the family's own structural tests
(tests/support/shared_graphs.py)."""
from __future__ import annotations

import importlib
import math

import pytest

from autotp.plan.planner import make_plan
from shared_graphs import SHARED, spelling

# module -> its spellings that keep a block whole by design (only exact, not 1/tp; the reason in the plan);
# pattern_models' are those whose kv heads several ranks hold (tests/analysis/test_patterns.py)
MODULES = {
    "pattern_models": (), "autocast_models": (), "einsum_models": ("mqa",), "function_models": ("grad_norm",),
    "loss_layout_models": (), "tied_head_models": (), "torch_rule_models": (), "gap_models": (),
    "view_gap_models": (), "shared_weight_models": ("unlike",), "grad_mode_models": ("enable_inside",),
}


def _cases() -> list:
    from test_patterns import KV_HEADS, SHARDED

    cases = []
    for module, whole in MODULES.items():
        kinds = SHARDED if module == "pattern_models" else importlib.import_module(module).KINDS
        for kind in kinds:
            partial = kind in whole or (module == "pattern_models" and kind in KV_HEADS)
            cases.append(pytest.param(module, kind, partial, id=f"{module}-{kind}"))
    return cases


@SHARED
@pytest.mark.parametrize("module,kind,partial", _cases())
def test_every_spelling_plans_fully_at_tp_2_and_4(module: str, kind: str, partial: bool):
    model, _, _, gm = spelling(module, kind)
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    # a parameter several modules hold (a block listed twice, tied weights): the plan names it once, by any name
    every = dict(model.named_parameters(remove_duplicate=False))
    aliases: dict[str, list[str]] = {n: [m for m, q in every.items() if q is p] for n, p in every.items()}
    for tp in (2, 4):
        plan = make_plan(gm, tp)
        shards = {n: s for name, s in plan.params for n in aliases.get(name, [name])}
        listed = {n for w in plan.whole for n in aliases.get(w.name, [w.name])}
        unexplained = [n for n, p in params.items() if p.dim() >= 2 and n not in shards and n not in listed]
        assert unexplained == [], (kind, tp, unexplained)
        if partial:  # a block whole by design (its reason in plan.replicated), or kv heads held by several ranks
            continue
        assert plan.replicated == () and not listed, (kind, tp, plan.replicated, listed)
        held = sum(math.prod(shards[n].local_shape) if n in shards else p.numel() for n, p in params.items())
        assert held / total <= 1 / tp + 0.12, (kind, tp, held / total)
