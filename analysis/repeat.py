"""Reading the repeat task's outputs: the numbered copies a generation wrote (the grader and the docs' table share it).

The model is asked to copy a line of four-digit numbers 64 times; its answer starts after the prompt's ``1. <line>\\n2.``.
"""

from __future__ import annotations

import re

FOUR_DIGITS = re.compile(r"(?<!\d)\d{4}(?!\d)")
NUMBERED = re.compile(r"^\s*(\d+)\.\s*(.*)$")
DEGENERATE = re.compile(r"(\d)\1{30}")  # one digit 30+ times in a row: the model has broken down


def copies(text: str) -> list[re.Match]:
    """The complete numbered lines (``k. ...`` followed by a newline) of an answer, in order; a generation cut off at
    the length limit is cut inside its last line, which does not count. Text after the list is not a copy."""
    return [m for line in ("2." + text).split("\n")[:-1] if (m := NUMBERED.match(line))]


def fidelity(copy: re.Match, line: str) -> float:
    """The fraction of the reference line's numbers that ``copy`` has in place."""
    ref = line.split()
    got = FOUR_DIGITS.findall(copy.group(2))
    return sum(a == b for a, b in zip(got, ref)) / len(ref)
