"""Result files for long runs: one JSON row per item, appended as it finishes, resumable.

Every row carries the run's ``config`` (model, K, r, policy, seed, ...), so a file can always be
traced back to what produced it and a figure regenerated from it. Reopening a file with a
different config is refused rather than mixed.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Iterable

__all__ = ["ResultsFile", "git_revision", "REPO_ROOT"]

REPO_ROOT = Path(__file__).resolve().parents[1]


def git_revision() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class ResultsFile:
    """Append-only JSONL of result rows keyed by ``key_fields``; knows which keys are done.

    ``config`` is stored in every row under ``"config"``; its ``revision`` entry (the git
    revision) is informational and not compared on resume.
    """

    def __init__(self, path: "str | os.PathLike", config: dict, key_fields: tuple[str, ...], *, restart: bool = False):
        self.path = Path(path)
        self.config = dict(config)
        self.key_fields = key_fields
        self.rows: list[dict] = []
        if restart and self.path.exists():
            self.path.unlink()
        if self.path.exists():
            self._load()
        self.done = {self.key(r) for r in self.rows}

    def _load(self) -> None:
        mine = {k: v for k, v in self.config.items() if k != "revision"}
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            # A run killed mid-write leaves one torn last line: cut it off so new rows start clean.
            data = data[: data.rfind(b"\n") + 1]
            self.path.write_bytes(data)
        for n, line in enumerate(data.decode().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{self.path}: line {n} is not JSON; fix or remove it (or pass --restart)") from None
            theirs = {k: v for k, v in row.get("config", {}).items() if k != "revision"}
            if theirs != mine:
                diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
                raise ValueError(
                    f"{self.path} holds results of a different configuration (differs in {', '.join(diff)}: "
                    + "; ".join(f"{k}: file {theirs.get(k)!r} vs now {mine.get(k)!r}" for k in diff[:4])
                    + "). Pass --out to write elsewhere, or --restart to discard the old results."
                )
            self.rows.append(row)

    def key(self, row: dict) -> tuple:
        return tuple(row[k] for k in self.key_fields)

    def append(self, rows: Iterable[dict]) -> None:
        """Write rows now (flushed and synced), so an interrupted run loses only what was in flight."""
        rows = [{**r, "config": self.config} for r in rows]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.rows.extend(rows)
        self.done.update(self.key(r) for r in rows)
