"""Reading result files: JSONL rows, CSV summary tables, benchmark JSON. A wrong or corrupt file is a clear error
naming the file and the command that makes a good one."""

from __future__ import annotations

import csv
import json
from pathlib import Path

__all__ = ["read_rows", "read_table", "read_json"]


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
