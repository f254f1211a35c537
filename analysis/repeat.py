"""Reading the repeat task's outputs: the numbered copies a generation wrote (the grader and the docs' table share it).

The model is asked to copy a line of four-digit numbers :data:`LINES` times; its answer starts after the prompt's
``1. <line>\\n2.``. Two endpoints are read from the generated text alone (:func:`endpoints`), each measuring one thing:
how many copies the model wrote (generation behaviour: when it stopped or broke down) and how faithful the copies it
wrote are (content kept).
"""

from __future__ import annotations

import re
from typing import Optional

FOUR_DIGITS = re.compile(r"(?<!\d)\d{4}(?!\d)")
NUMBERED = re.compile(r"^\s*(\d+)\.\s*(.*)$")
DEGENERATE = re.compile(r"(\d)\1{30}")  # one digit 30+ times in a row: the model has broken down
LINES = 64  # the copies the prompt asks for ("Copy this line 64 times"), the prompt's own first line among them


def copies(text: str) -> list[re.Match]:
    """The complete numbered lines (``k. ...`` followed by a newline) of an answer, in order; a generation cut off at
    the length limit is cut inside its last line, which does not count. Text after the list is not a copy. The
    prompt's own ``1. <line>`` is not in ``text``: the answer's first line completes the prompt's ``2.``."""
    return [m for line in ("2." + text).split("\n")[:-1] if (m := NUMBERED.match(line))]


def fidelity(copy: re.Match, line: str) -> float:
    """The fraction of the reference line's numbers that ``copy`` has in place."""
    ref = line.split()
    got = FOUR_DIGITS.findall(copy.group(2))
    return sum(a == b for a, b in zip(got, ref)) / len(ref)


def endpoints(text: str, line: str, cap: int = LINES) -> tuple[int, Optional[float]]:
    """``(copies, fidelity)`` of a generated answer: the complete copies it wrote (:func:`copies`; the prompt's own
    first line not counted, so a model that stops after line 64 wrote 63), capped at ``cap``; and the mean
    :func:`fidelity` over every complete copy written (past ``cap`` too), None when it wrote none."""
    written = copies(text)
    return min(len(written), cap), (sum(fidelity(c, line) for c in written) / len(written) if written else None)
