"""What the parity tests assert on the results of ``parity_workers.pattern_parity``, written once.

Each result ``r`` is one spelling trained 3 AdamW steps on every rank against the unsharded model: its largest
differences (loss, gradients, parameters after the steps), what was left replicated or whole, the fraction of
the parameters each rank holds, and the collectives of one step.
"""
from __future__ import annotations

from collections.abc import Callable

from parity_workers import dense_step_collectives


def assert_exact(r: dict, where: tuple, param_tol: float = 1e-5) -> None:
    """The single-device numbers: loss and gradients within 1e-5 (fp32), parameters after the steps within
    ``param_tol``."""
    assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["param_diff"] <= param_tol, (*where, r)


def assert_fully_sharded(r: dict, world: int, where: tuple, slack: float = 0.12) -> None:
    """Nothing replicated, every weight cut or listed whole with its reason, and each rank holding at most
    1/world of the parameters plus ``slack`` (norms, biases, position tables)."""
    assert not r["replicated"] and r["unexplained"] == [], (*where, r["replicated"], r["unexplained"])
    assert r["fraction"] <= 1 / world + slack, (*where, r["fraction"])


def assert_megatron_step(r: dict, bsh: int, tokens: int, layers: int, where: tuple, extra_backward: list = ()) -> None:
    """Exactly Megatron's all-reduces of a dense LM's step (:func:`dense_step_collectives`), and in the
    backward ``extra_backward`` besides (weight gradients of heads every rank holds)."""
    forward, backward = dense_step_collectives(bsh, tokens, layers)
    assert sorted(r["forward"]) == forward, (*where, r["forward"])
    assert sorted(r["backward"]) == sorted(backward + list(extra_backward)), (*where, r["backward"])


def assert_patterns_train_exactly(results: dict[int, dict[str, dict]], kinds: list[str], world: int, *, bsh: int,
                                  tokens: int, layers: int = 2,
                                  extra_backward: Callable[[str], list] = lambda kind: [],
                                  sharded: Callable[[str], bool] = lambda kind: True) -> None:
    """Every rank ran every kind, in order; each is exact, fully sharded and communicates as Megatron does
    (kinds where ``sharded`` is False are only exact: the caller asserts what they keep whole)."""
    for rank, by_kind in results.items():
        assert list(by_kind) == list(kinds), (rank, list(by_kind))
        for kind, r in by_kind.items():
            where = (rank, kind)
            assert_exact(r, where)
            if sharded(kind):
                assert_fully_sharded(r, world, where)
                assert_megatron_step(r, bsh, tokens, layers, where, extra_backward(kind))
