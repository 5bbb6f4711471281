"""Runtime: parallelize() and what the rewritten graph runs (collectives, RNG, gathered outputs, compile)."""
