"""One module's spellings trained against the unsharded model on gloo ranks. The default run trains the
module's representative spellings (those whose sharding changes with tp, and one of each other family) at tp 2;
the ``extended`` run (tests/conftest.py) trains the rest at tp 2 and every spelling at tp 4. Each spelling's
plan is checked at tp 2 and 4 without a process group by its module's structural tests; the default run trains
at tp 4 the headline models (tests/runtime/test_parity.py), FSDP, pipelines with recompute and context parallelism's
pairings."""
from __future__ import annotations

import pytest

from parity_workers import pattern_parity
from ranks import Launches


class SpellingRuns(Launches):
    """``pattern_parity`` over ``kinds`` of ``models`` (a module of tests/support with ``build(kind)``);
    ``core``: the representative spellings (trained at tp 2 by default). ``params``: the (world, part) cases a
    test parametrizes over; ``kinds(part)``: the spellings a part ran."""

    def __init__(self, name: str, models: str, kinds, core, *, steps: int = 3, sequence_parallel: bool = False):
        kinds, core = list(kinds), list(core)
        assert set(core) <= set(kinds), set(core) - set(kinds)
        rest = [k for k in kinds if k not in core]
        self.parts = {name: core, f"{name} rest": rest, f"{name} at tp 4": core, f"{name} rest at tp 4": rest}

        def job(ks: list[str]) -> tuple:
            return pattern_parity, ks, steps, sequence_parallel, models

        # the default run: the core spellings at tp 2, one launch; the rest at tp 2 and every spelling at tp 4 in
        # the extended run (four ranks on CI's two cores cost the most of any launch)
        at2 = {f"{name} rest": job(rest)} if rest else {}
        at4 = {f"{name} at tp 4": job(core), **({f"{name} rest at tp 4": job(rest)} if rest else {})}
        super().__init__({2: {name: job(core)}}, extended={2: at2, 4: at4} if at2 else {4: at4})
        self.params = [pytest.param(2, name, id="2"),
                       pytest.param(4, f"{name} at tp 4", id="4", marks=pytest.mark.extended)]
        if rest:
            self.params[1:1] = [pytest.param(2, f"{name} rest", id="2-rest", marks=pytest.mark.extended)]
            self.params.append(pytest.param(4, f"{name} rest at tp 4", id="4-rest", marks=pytest.mark.extended))

    def kinds(self, part: str) -> list[str]:
        return self.parts[part]
