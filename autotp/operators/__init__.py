"""Graph operators: what the rewritten graph runs (collectives, sequence- and vocab-parallel operators,
expert operators, gathered outputs, RNG streams, autocast) and ``torch.compile`` of it. They know no plan."""
