"""Survival analysis of keep-logs pooled per (policy, mode): metric means, merged curves, Random's analytic curves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from randattn.keepstats import SurvivalCurve


METRICS = ("slot_coverage", "prompt_union", "prompt_head", "jaccard", "entropy")


@dataclass
class Pooled:
    """All sequences of one (policy, mode): metric means, merged curves, Random's analytic curves."""

    policy: str
    mode: str
    n: int
    rounds: list
    metrics: dict
    by_rounds: SurvivalCurve
    by_age: SurvivalCurve
    analytic_rounds: tuple  # (per head, union) expected under Random for these observations
    analytic_age: tuple


def _pool_curves(rows: list[dict], key: str) -> tuple[SurvivalCurve, tuple]:
    curves = [SurvivalCurve.from_dict(r[key]) for r in rows]
    merged = curves[0]
    for c in curves[1:]:
        merged = merged.merge(c)
    # Rows may differ in q (prompt length), so the analytic curve is pooled from per-row sums.
    head, union = np.zeros(len(merged.total)), np.zeros(len(merged.total))
    for c, r in zip(curves, rows):
        h, u = c.analytic_sums(r["q"])
        head[: len(h)] += h
        union[: len(u)] += u
    with np.errstate(invalid="ignore", divide="ignore"):
        return merged, (head / merged.total, union / merged.total)


def pool(rows: Sequence[dict]) -> dict[tuple[str, str], Pooled]:
    """Rows grouped by (policy, mode) in first-seen order."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["policy"], r["mode"]), []).append(r)
    out = {}
    for (policy, mode), g in groups.items():
        by_rounds, an_rounds = _pool_curves(g, "by_rounds")
        by_age, an_age = _pool_curves(g, "by_age")
        metrics = {m: float(np.nanmean([r[m] for r in g])) if any(r[m] == r[m] for r in g) else float("nan")
                   for m in METRICS}
        out[(policy, mode)] = Pooled(policy, mode, len(g), sorted({r["rounds"] for r in g}), metrics, by_rounds,
                                     by_age, an_rounds, an_age)
    return out


def mean_deficit(curve: SurvivalCurve) -> float:
    """Independent-heads union minus measured union, averaged over observations (rounds bins)."""
    ok = curve.total > 0
    return float(np.sum(curve.deficit[ok] * curve.total[ok]) / np.sum(curve.total[ok]))
