"""Flags and helpers shared by every probe's command line."""

from __future__ import annotations

import argparse
import re
from pathlib import Path


def base_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the flags that mean the same in every probe."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="HF hub id or local directory; default: embedded SmolLM2-135M-Instruct")
    p.add_argument("--device", default="auto", help="'auto' (CUDA when present), 'cpu' or 'cuda[:N]'")
    p.add_argument("--seed", type=int, default=0, help="seed of the eviction draws (per seed, layer, round)")
    p.add_argument("--out", default=None, help="where to write results (default: under data/results/<probe>/)")
    return p


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


def policy_slug(name: str) -> str:
    """A file-name-safe policy name: ``my_selector:score`` -> ``my_selector.score``, ``dir/sel.py:f`` -> ``sel.f``."""
    where, sep, attr = name.rpartition(":")
    if sep:
        name = f"{Path(where).stem if where.endswith('.py') else where}.{attr}"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)
