"""Analysis: the structure found in a captured graph (pairs, fused layouts, sharding propagation, vocab)."""
