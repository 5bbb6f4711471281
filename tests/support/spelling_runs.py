"""One module's spellings trained against the unsharded model on gloo ranks: every spelling at tp 2 in the
default run; at tp 4, in the ``extended`` run (tests/conftest.py), the spellings named for tp 4 (those whose
sharding changes with tp, and one of each other family) and the rest. Each spelling's plan is checked at tp 2
and 4 without a process group by its module's structural tests; the default run trains at tp 4 the headline
models (tests/test_parity.py), sequence parallelism, experts and context parallelism's pairings."""
from __future__ import annotations

import pytest

from parity_workers import pattern_parity
from ranks import Launches


class SpellingRuns(Launches):
    """``pattern_parity`` over ``kinds`` of ``models`` (a module of tests/support with ``build(kind)``).
    ``params``: the (world, part) cases a test parametrizes over; ``kinds(part)``: the spellings a part ran."""

    def __init__(self, name: str, models: str, kinds, at_tp4, *, steps: int = 3, sequence_parallel: bool = False):
        kinds, at_tp4 = list(kinds), list(at_tp4)
        assert set(at_tp4) <= set(kinds), set(at_tp4) - set(kinds)
        rest = [k for k in kinds if k not in at_tp4]
        self.parts = {name: kinds, f"{name} at tp 4": at_tp4, f"{name} rest at tp 4": rest}

        def job(ks: list[str]) -> tuple:
            return pattern_parity, ks, steps, sequence_parallel, models

        # the tp 4 parts share one extended launch: four ranks on CI's two cores cost the most of any launch
        at4 = {f"{name} at tp 4": job(at_tp4), **({f"{name} rest at tp 4": job(rest)} if rest else {})}
        super().__init__({2: {name: job(kinds)}}, extended={4: at4})
        self.params = [pytest.param(2, name, id="2"),
                       pytest.param(4, f"{name} at tp 4", id="4", marks=pytest.mark.extended)]
        if rest:
            self.params.append(pytest.param(4, f"{name} rest at tp 4", id="4-rest", marks=pytest.mark.extended))

    def kinds(self, part: str) -> list[str]:
        return self.parts[part]
