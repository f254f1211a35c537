"""Statistics for the probes: percentile bootstrap CIs, Recall R as a ratio of sums, paired differences.

Every interval here is a percentile bootstrap over *instances* (or problems): resample the
instance indices with replacement, recompute the statistic on the resampled rows of every array
at once (so paired arrays stay paired), and take the 2.5 / 97.5 percentiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

__all__ = ["Estimate", "bootstrap", "mean_ci", "recall", "recall_ci", "N_RESAMPLES", "SignTest", "sign_test",
           "PairedComparison", "paired_comparison", "per_problem_means", "comparison_table"]

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


# -- paired comparison of two methods on the same problems (the paper's significance rule) -------------
@dataclass(frozen=True)
class SignTest:
    wins: int  # problems where A beat B
    losses: int
    ties: int  # dropped from the test
    p: float  # exact two-sided binomial p under P(win) = 1/2


def sign_test(d: Sequence[float]) -> SignTest:
    """Exact two-sided sign test on paired differences, ties dropped."""
    d = np.asarray(d, dtype=np.float64)
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    n, k = wins + losses, min(wins, losses)
    if n == 0:
        return SignTest(wins, losses, len(d), 1.0)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return SignTest(wins, losses, len(d) - n, min(1.0, 2 * tail))


@dataclass(frozen=True)
class PairedComparison:
    """A vs B on the same problems: mean per-problem difference with its bootstrap CI and p, the sign test,
    and the verdict (significant only when the CI excludes 0 *and* the sign test has p < alpha)."""

    delta: Estimate
    p_bootstrap: float
    sign: SignTest
    alpha: float

    @property
    def significant(self) -> bool:
        return self.delta.excludes(0.0) and self.sign.p < self.alpha

    @property
    def verdict(self) -> str:
        if not self.significant:
            return "indistinguishable"
        return "better" if self.delta.value > 0 else "worse"


def per_problem_means(grades: dict) -> dict:
    """``{problem: [grade per run]}`` -> ``{problem: mean over runs}`` (the problem is the unit of resampling)."""
    return {k: float(np.mean(v)) for k, v in grades.items() if len(v)}


def paired_comparison(a: dict, b: dict, *, n_resamples: int = 10_000, seed: int = 0, alpha: float = 0.05,
                      level: float = 0.95) -> PairedComparison:
    """Compare method A with method B on the problems both were run on.

    ``a`` and ``b`` map problem id -> list of per-run scores (e.g. 0/1 accuracy). Per problem the runs
    are averaged, ``d = acc_A - acc_B``; the mean of ``d`` gets a percentile-bootstrap CI over problems
    (problem-clustered: runs of a problem stay together) and a two-sided bootstrap p
    (``2 * min(P(d* <= 0), P(d* >= 0))``); the exact sign test drops ties.
    """
    ma, mb = per_problem_means(a), per_problem_means(b)
    common = sorted(set(ma) & set(mb), key=str)
    if not common:
        raise ValueError("the two methods share no problems; compare runs on the same problem set")
    d = np.array([ma[k] - mb[k] for k in common])
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(n_resamples, len(d)))].mean(-1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    p_boot = float(min(1.0, 2 * min((means <= 0).mean(), (means >= 0).mean())))
    return PairedComparison(Estimate(float(d.mean()), float(lo), float(hi), len(d)), p_boot, sign_test(d), alpha)


def comparison_table(results: dict, *, reference: str = "random", fmt: str = "markdown", n_resamples: int = 10_000,
                     seed: int = 0) -> str:
    """Methods x tasks: accuracy and the delta vs ``reference`` (``*`` = significant by both tests).

    ``results[(method, task)] = {problem: [scores per run]}``. ``fmt``: markdown, csv or latex.
    """
    if fmt not in ("markdown", "csv", "latex"):
        raise ValueError(f"fmt must be 'markdown', 'csv' or 'latex', got {fmt!r}")
    methods = list(dict.fromkeys(m for m, _ in results))
    tasks = list(dict.fromkeys(t for _, t in results))
    header = ["method"] + tasks
    rows = []
    for m in methods:
        cells = [m]
        for t in tasks:
            g = results.get((m, t))
            if g is None:
                cells.append("")
                continue
            acc = float(np.mean(list(per_problem_means(g).values())))
            if m == reference or (reference, t) not in results:
                cells.append(f"{acc:.3f}")
                continue
            c = paired_comparison(g, results[(reference, t)], n_resamples=n_resamples, seed=seed)
            mark = "*" if c.significant else ""
            cells.append(f"{acc:.3f} ({c.delta.value:+.3f}{mark})")
        rows.append(cells)
    if fmt == "csv":
        return "\n".join(",".join(f'"{c}"' if "," in c else c for c in r) for r in [header] + rows) + "\n"
    if fmt == "latex":
        body = " \\\\\n".join(" & ".join(c.replace("*", "$^{*}$") for c in r) for r in rows)
        return (f"\\begin{{tabular}}{{l{'r' * len(tasks)}}}\n\\toprule\n" + " & ".join(header) + " \\\\\n\\midrule\n"
                + body + " \\\\\n\\bottomrule\n\\end{tabular}\n")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"
