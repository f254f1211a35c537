"""Figures drawn from saved results under ``data/results/`` (never by rerunning a model)."""
