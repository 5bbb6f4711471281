"""Checkpoints and weights: models built without weights, sharded DCP checkpoints, safe loading, weights
straight into shards, export. Reads a parallelized model through :func:`autotp.state.tp_state`."""
