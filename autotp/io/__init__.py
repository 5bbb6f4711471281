"""Checkpoints and weights: sharded DCP checkpoints, safe loading, weights straight into shards, export."""
