"""Reading result files and formatting numbers for the docs' tables (used by figures.tables and figures.before_after)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Optional

from analysis.shipped import shipped_result


def result_path(rel: str) -> Path:
    mine = Path("data") / "results" / rel
    return mine if mine.exists() else shipped_result(rel)


def read_csv(rel: str) -> list[dict]:
    with open(result_path(rel), newline="") as f:
        return list(csv.DictReader(f))


def read_jsonl(rel: str) -> list[dict]:
    with open(result_path(rel)) as f:
        return [json.loads(line) for line in f if line.strip()]


def num(value) -> Optional[float]:
    if value in (None, ""):
        return None
    x = float(value)
    return None if math.isnan(x) else x


def f(value, digits: int = 3, signed: bool = False) -> str:
    x = num(value)
    if x is None:
        return "–"
    text = f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"
    return text.replace("-", "−")


def ci(row: dict, col: str, digits: int = 3, signed: bool = False) -> str:
    """``value [lo, hi]`` from the columns ``col``, ``col_lo``, ``col_hi``."""
    if num(row.get(col)) is None:
        return "–"
    lo, hi = row.get(f"{col}_lo"), row.get(f"{col}_hi")
    if num(lo) is None:
        return f(row[col], digits, signed)
    return f"{f(row[col], digits, signed)} [{f(lo, digits, signed)}, {f(hi, digits, signed)}]"


def markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def provenance(rows_file: str) -> str:
    """The revision and engine recorded in the rows (every probe row carries its configuration)."""
    revs, engines, dates = set(), set(), set()
    for r in read_jsonl(rows_file):
        config = r.get("config") or {}
        revs.add(str(config.get("revision", r.get("revision", "?"))))
        engines.add(str(config.get("engine", "?")))
        if config.get("date"):
            dates.add(str(config["date"]))
    when = f"measured {', '.join(sorted(dates))}, " if dates else ""
    return f"{when}revision {', '.join(sorted(revs))}, engine {', '.join(sorted(engines))}"


def read_json(rel: str) -> dict:
    return json.loads(result_path(rel).read_text())


def bench_footer(rel: str, command: str) -> str:
    """A benchmark's source line: its ``meta`` records the revision, engine and (newer files) the date."""
    meta = read_json(rel)["meta"]
    when = f"measured {meta['date']}, " if meta.get("date") else ""
    return (f"*From `data/results/{rel}` (`{command}`; {when}revision {meta.get('git', '?')}, "
            f"engine {meta.get('engine', 'before the paper')}).*")


def footer(rel: str, command: str, rows_file: Optional[str] = None) -> str:
    return f"*From `data/results/{rel}` (`{command}`; {provenance(rows_file or rel)}).*"
