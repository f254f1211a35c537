"""Experiments on the randattn core, each runnable as ``python -m probes.<name>``."""
