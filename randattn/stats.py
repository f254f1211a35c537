"""Statistics for the probes: percentile bootstrap CIs, Recall R as a ratio of sums, paired differences.

Every interval here is a percentile bootstrap over *instances* (or problems): resample the
instance indices with replacement, recompute the statistic on the resampled rows of every array
at once (so paired arrays stay paired), and take the 2.5 / 97.5 percentiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

__all__ = ["Estimate", "bootstrap", "mean_ci", "recall", "recall_ci", "N_RESAMPLES"]

N_RESAMPLES = 4000


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its percentile-bootstrap interval."""

    value: float
    lo: float
    hi: float
    n: int

    def excludes(self, x: float = 0.0) -> bool:
        """True when the interval lies entirely above or below ``x``."""
        return self.lo > x or self.hi < x

    def as_dict(self, prefix: str) -> dict:
        return {prefix: self.value, f"{prefix}_lo": self.lo, f"{prefix}_hi": self.hi}

    def __format__(self, spec: str) -> str:
        spec = spec or ".3f"
        return f"{self.value:{spec}} [{self.lo:{spec}}, {self.hi:{spec}}]"


def _arrays(columns: Sequence) -> list[np.ndarray]:
    arrays = [np.asarray(c, dtype=np.float64) for c in columns]
    n = {len(a) for a in arrays}
    if len(n) != 1:
        raise ValueError(f"paired arrays must have the same length, got lengths {sorted(n)}")
    if 0 in n:
        raise ValueError("cannot estimate from zero instances")
    return arrays


def bootstrap(
    statistic: Callable[..., np.ndarray],
    *columns: Sequence[float],
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
    level: float = 0.95,
) -> Estimate:
    """Percentile bootstrap of ``statistic(*columns)`` over rows, rows resampled jointly.

    ``statistic`` gets arrays shaped ``[n_resamples, n]`` (one resample per row) and must reduce
    the last axis, returning ``[n_resamples]``; called on the original data it gets ``[1, n]``.
    """
    if n_resamples < 1000:
        raise ValueError(f"n_resamples={n_resamples} is too few for a 95% percentile interval; use >= 1000")
    arrays = _arrays(columns)
    n = len(arrays[0])
    point = float(statistic(*(a[None] for a in arrays))[0])
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_resamples, n))
    with np.errstate(divide="ignore", invalid="ignore"):
        stats = np.asarray(statistic(*(a[idx] for a in arrays)), dtype=np.float64)
    stats = stats[np.isfinite(stats)]
    if stats.size == 0:
        return Estimate(point, float("nan"), float("nan"), n)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(stats, [alpha, 1 - alpha])
    return Estimate(point, float(lo), float(hi), n)


def mean_ci(values: Sequence[float], **kw) -> Estimate:
    """Mean with a percentile-bootstrap CI (e.g. Retrieval = mean of 0/1 outcomes)."""
    return bootstrap(lambda v: v.mean(-1), values, **kw)


def recall(lp_cond: Sequence[float], lp_del: Sequence[float], lp_all: Sequence[float]) -> float:
    """Recall ``R = Σ(LP_cond − LP_del) / Σ(LP_all − LP_del)``: a ratio of sums over paired instances
    (not a mean of per-instance ratios, which explodes when one instance's endpoints nearly tie)."""
    c, d, a = _arrays([lp_cond, lp_del, lp_all])
    den = float((a - d).sum())
    return float((c - d).sum() / den) if den != 0 else float("nan")


def _recall_stat(c, d, a):
    return (c - d).sum(-1) / (a - d).sum(-1)


def recall_ci(lp_cond: Sequence[float], lp_del: Sequence[float], lp_all: Sequence[float], **kw) -> Estimate:
    """Recall R with a percentile-bootstrap CI over instances (the three arrays resampled together)."""
    return bootstrap(_recall_stat, lp_cond, lp_del, lp_all, **kw)
