"""A matrix's cases split between the test tiers (tests/conftest.py): the core cases run by default, the rest
only in the ``extended`` run."""
from __future__ import annotations

from collections.abc import Iterable

import pytest


def core_first(cases: Iterable, core: Iterable, ids=None) -> list:
    """``cases`` for ``pytest.mark.parametrize``: those in ``core`` as they are, every other one marked
    ``extended``. A case of several arguments is a tuple; ``ids`` names a case (a function of it) where its
    values do not."""
    cases, core = list(cases), list(core)
    assert all(c in cases for c in core), [c for c in core if c not in cases]
    out = []
    for case in cases:
        values = case if isinstance(case, tuple) else (case,)
        name = {} if ids is None else {"id": ids(case)}
        marks = () if case in core else (pytest.mark.extended,)
        out.append(pytest.param(*values, marks=marks, **name))
    return out
