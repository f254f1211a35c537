"""Reading result files: JSONL rows, CSV summary tables, benchmark JSON. A wrong or corrupt file is a clear error
naming the file and the command that makes a good one."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

__all__ = ["read_rows", "read_table", "read_json", "BadRow", "check_row"]


class BadRow(ValueError):
    """A result row read back with a field of the wrong type, or without a field its summary needs."""


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# The type of each field a summary reads, wherever it appears in a row; and which fields a kind of row (told by the
# fields it has) must hold. A row that breaks either would count as an extra row, a NaN or a traceback downstream.
_KINDS = {"an integer": _integer, "a finite number": _finite, "true or false": lambda v: isinstance(v, bool),
          "a string": lambda v: isinstance(v, str), "a finite number or null": lambda v: v is None or _finite(v)}
FIELD_TYPES = {
    **dict.fromkeys(("instance", "fact", "sequence", "run", "rounds", "copies", "ref_tokens"), "an integer"),
    **dict.fromkeys(("lp", "nll", "digit_acc", "mean_lp", "grade", "ref_lp_sum"), "a finite number"),
    **dict.fromkeys(("fidelity", "ref_lp"), "a finite number or null"),  # none: no copy written, no reference token
    **dict.fromkeys(("retrieved", "protect", "terminated"), "true or false"),
    **dict.fromkeys(("condition", "policy", "arm", "mode", "task", "problem"), "a string"),
}
REQUIRED = [  # (fields that tell the kind of row, the fields its summary needs); a row is the first kind it matches
    (("condition", "fact"), ("instance", "lp", "retrieved")),  # planted-fact probes
    (("instance", "protect"), ("policy", "digit_acc", "mean_lp")),  # prompt protection
    (("sequence", "arm"), ("nll",)),  # next-token loss (blocks, shared_draw)
    (("problem", "run", "ref_lp"), ("policy", "ref_lp_sum", "ref_tokens")),  # accuracy --reference-lp
    (("problem", "run"), ("policy", "grade", "terminated")),  # accuracy
]


def check_row(row: dict, where: str) -> None:
    """Raise :class:`BadRow` (``where``: ``FILE:LINE``) naming the first field of ``row`` a summary cannot use."""
    for tells, needs in REQUIRED:
        if all(k in row for k in tells):
            for k in needs:
                if k not in row:
                    raise BadRow(f"{where}: field {k!r} is missing (a row with {' and '.join(map(repr, tells))} "
                                 "needs it)")
            break
    for k, kind in FIELD_TYPES.items():
        if k in row and not _KINDS[kind](row[k]):
            raise BadRow(f"{where}: field {k!r} must be {kind}, got {json.dumps(row[k])}")


def _exists(path: Path, command: str) -> None:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no results; `{command}` produces them")
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give the result file itself")


def read_rows(path: "str | Path", command: str = "the probe") -> list[dict]:
    """The rows of a JSONL results file (every line a JSON object with a ``config``)."""
    path = Path(path)
    _exists(path, command)
    rows = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}: line {n} is not JSON; it is not a result file of `{command}`") from None
        if not isinstance(row, dict) or "config" not in row:
            raise ValueError(f"{path}: line {n} is not a result row; it is not a result file of `{command}`")
        check_row(row, f"{path}:{n}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no rows; run `{command}`")
    return rows


def read_table(path: "str | Path", command: str = "the probe") -> list[dict]:
    """The rows of a CSV summary table."""
    path = Path(path)
    _exists(path, command)
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{path} is not a CSV table ({exc}); it is not a summary of `{command}`") from None
    if not rows:
        raise ValueError(f"{path} holds no rows; run `{command}`")
    return rows


def read_json(path: "str | Path", command: str = "the benchmark") -> dict:
    """A benchmark result: ``{"meta": {...}, "rows": [...]}``."""
    path = Path(path)
    _exists(path, command)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{path} is not JSON; it is not a result of `{command}`") from None
    if not isinstance(data, dict) or "rows" not in data:
        raise ValueError(f"{path} has no 'rows'; it is not a result of `{command}`")
    return data
