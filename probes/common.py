"""Flags and helpers shared by every probe's command line."""

from __future__ import annotations

import argparse
from pathlib import Path

from analysis.names import policy_slug  # noqa: F401 (a policy's spelling in result names; re-exported)

from .config import SEED


def base_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the flags that mean the same in every probe."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="HF hub id or local directory; default: embedded SmolLM2-135M-Instruct")
    p.add_argument("--device", default="auto", help="'auto' (CUDA when present), 'cpu' or 'cuda[:N]'")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the eviction draws (per seed, layer, round)")
    p.add_argument("--out", type=result_file, default=None,
                   help="where to write results (default: under data/results/<probe>/)")
    return p


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


def result_file(text: str) -> str:
    """An argparse type for a JSON result file a command (re)writes whole: refused when it is a folder, lies under a
    file, or is a file randattn did not write (a JSON object with ``rows``), so no user file is ever overwritten."""
    import json

    path = Path(text)
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise argparse.ArgumentTypeError(f"{parent} is a file, so {text} cannot be created; give a path in a folder")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give the JSON file to write, e.g. {path / 'result.json'}")
    if path.exists():
        try:
            ours = isinstance(obj := json.loads(path.read_text()), dict) and "rows" in obj
        except (ValueError, UnicodeDecodeError, OSError):
            ours = False
        if not ours:
            raise argparse.ArgumentTypeError(f"{text} exists and is not a result file randattn wrote; nothing was "
                                             "changed. Give a new file name")
    return text


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
