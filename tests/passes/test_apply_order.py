"""The steps after planning run in one named order (:data:`autotp.parallel.apply.APPLY_ORDER`), and the
module that holds it says why each step comes where it does, naming the steps in the order they run."""
from __future__ import annotations

import inspect
import re

import autotp.parallel.apply as applying
import autotp.passes as passes


def _documented() -> list[str]:
    """The steps the module's docstring lists, in its numbered order (each item opens with their names)."""
    names = []
    for line in applying.__doc__.splitlines():
        found = re.match(r"\s*\d+\.\s+((?:``\w+``(?:,\s*)?)+)", line)
        if found:
            names += re.findall(r"``(\w+)``", found[1])
    return names


def test_the_apply_order_is_documented_as_it_runs() -> None:
    steps = [step.__name__ for step in applying.APPLY_ORDER]
    assert len(set(steps)) == len(steps), steps
    assert _documented() == steps
    # each a plain function of the one record, defined where the order is written
    for step in applying.APPLY_ORDER:
        assert inspect.getmodule(step) is applying and list(inspect.signature(step).parameters) == ["a"], step


def test_the_model_regions_are_outlined_by_passes_innermost_first() -> None:
    """The outlining steps call the rewrites of the passes package (operators keep the modules they put in
    the graph): a Function inside an autocast region inside a checkpointed one stays nested."""
    steps = [step.__name__ for step in applying.APPLY_ORDER]
    outlines = [s for s in steps if s.startswith("outline_")]
    assert outlines == ["outline_functions", "outline_autocast", "outline_recompute"]
    assert steps.index("bind_streams") < steps.index("outline_recompute") < steps.index("compile_graph")
    for name in outlines:
        assert getattr(passes, name).__module__ == f"autotp.passes.{name}"


def test_the_plans_passes_run_in_their_documented_order() -> None:
    """The rewrite step's passes: the sequence edges taken before f and g go on them, a row's bias moved after
    its collective, context parallelism on the finished tensor-parallel graph."""
    order = [p.__name__ for p in passes.DEFAULT_PASSES]
    at = order.index
    assert at("sequence_split") < at("insert_collectives") and at("sequence_grads") < at("insert_collectives")
    assert at("insert_collectives") < at("row_bias_after_reduce")
    assert order[-1] == "context_parallel"
