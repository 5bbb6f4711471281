"""Distributed: the rank layout (TP x DP x PP) and the launcher."""
