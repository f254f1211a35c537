"""Re-export of :mod:`randattn.shipped` for the analysis layer's callers."""

from randattn.shipped import shipped, shipped_result  # noqa: F401
