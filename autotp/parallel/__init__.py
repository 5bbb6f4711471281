"""Orchestration: :func:`~autotp.parallel.parallelize.parallelize` runs capture, planning and the passes on the
user's model and binds the result to this rank; gradient norms and data helpers for the training script."""
