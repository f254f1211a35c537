"""Argparse types and helpers shared by the command lines that are not a probe Config (the grid, compare_samples,
the demo)."""

from __future__ import annotations

import argparse

from analysis.names import policy_slug  # noqa: F401 (a policy's spelling in result names; re-exported)

from .config import SEED


def seed_int(text: str) -> int:
    """An argparse type: a seed, by the one seed check (:func:`probes.config.SEED`: an integer in [0, 2**64))."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    problem = SEED(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def ranges(sorted_positions) -> str:
    """[3,4,5,9,10] -> '3-5, 9-10'."""
    out, start, prev = [], None, None
    for p in sorted_positions:
        if start is None:
            start = prev = p
        elif p == prev + 1:
            prev = p
        else:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = prev = p
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ", ".join(out)
