"""Distributed: the rank grid (TP x CP x DP x PP) and the launcher."""
