"""``autotp plan --auto``'s explanation of its winner (cli/plan_auto.py): the terms named are the ones that favour
it, and layouts whose steps train different batches are compared per token. Built from estimates made up here:
no model is captured."""
from __future__ import annotations

from autotp.cli.plan_auto import Auto, beats_line, why
from autotp.search.auto import Search, Space
from autotp.search.cost import Candidate, Estimate, Memory, Training

SEQ = 32
MEMORY = Memory(state=1.0, activations=1.0, other=0.0, capacity=1e9)


def _estimate(lay: Candidate, *, compute: float, tp_comm: float = 0.0, dp_comm: float = 0.0,
              optimizer: float = 0.0) -> Estimate:
    return Estimate(lay, compute=compute, tp_comm=tp_comm, pp_bubble=0.0, pp_comm=0.0, dp_comm=dp_comm,
                    optimizer=optimizer, memory=MEMORY, tokens=lay.batch * SEQ, model_flops=1e9)


def _auto(*ranked: Estimate, per_replica: bool) -> Auto:
    space = Space(8, 8, 4, per_replica=per_replica)
    return Auto(None, None, space, Training(seq=SEQ), Search(ranked=ranked, rejected=(), considered=len(ranked)))


def test_one_global_batch_names_the_terms_that_favour_the_winner_first() -> None:
    """Both train 32 sequences a step: the winner's lead is its smaller tp comm; its larger dp comm and optimizer
    are said against it, not listed as if they explained the win."""
    winner = _estimate(Candidate(tp=1, dp=8, pp=1, micro_batch=4, microbatches=1), compute=1.2e-3, dp_comm=2e-6,
                       optimizer=6e-7)
    loser = _estimate(Candidate(tp=2, dp=4, pp=1, micro_batch=8, microbatches=1), compute=1.2e-3, tp_comm=1.3e-4)
    line = beats_line(_auto(winner, loser, per_replica=False))
    assert "both at 32 sequences per step" in line, line
    lead, against = line.split("; against it: ")
    assert lead.endswith("tp comm 130 µs less per step"), line
    assert against == "dp comm 2 µs more, optimizer 600 ns more", line
    assert f"by {(1.2e-3 + 1.3e-4) / (1.2e-3 + 2e-6 + 6e-7) - 1:.1%}" in line


def test_batches_per_replica_are_compared_per_token() -> None:
    """One example batch per replica (autotp shard --auto): dp 8 trains 32 sequences a step, dp 4 16, in the same
    1.2 ms of compute. Per step the winner's only lower term is tp comm (0.13 ms, not what doubles its
    throughput); per token its compute is half the other's, and that is named first."""
    winner = _estimate(Candidate(tp=1, dp=8, pp=1, micro_batch=4, microbatches=1), compute=1.2e-3, dp_comm=2e-6)
    loser = _estimate(Candidate(tp=2, dp=4, pp=1, micro_batch=4, microbatches=1), compute=1.2e-3, tp_comm=1.3e-4)
    auto = _auto(winner, loser, per_replica=True)
    line = beats_line(auto)
    assert "its step trains 32 sequences, the other's 16: compared per token" in line, line
    per_token = 1.2e-3 / (16 * SEQ) - 1.2e-3 / (32 * SEQ)  # 1.17 µs of compute less per token
    assert f": compute {per_token * 1e6:.3g} µs less, tp comm" in line and line.endswith(
        "per token; against it: dp comm 1.95 ns more"), line
    assert line in why(auto)  # it replaces the search's own line on the runner-up
    assert not any("terms are not compared" in x for x in why(auto))
