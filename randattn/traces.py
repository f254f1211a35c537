"""Reading reasoning traces: any JSONL file with a ``"text"`` field per line."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["load_traces"]


def load_traces(path: "str | Path") -> list[str]:
    """The ``text`` field of every row of a traces JSONL file, with clear errors."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--traces {path}: no such file; make one with `python -m probes.traces --out {path}`")
    texts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--traces {path}: line {n} is not JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f'--traces {path}: line {n} has no string "text" field')
            texts.append(row["text"])
    if not texts:
        raise ValueError(f"--traces {path}: the file holds no traces")
    return texts
