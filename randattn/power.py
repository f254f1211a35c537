"""Power and multiplicity for paired comparisons: what a verdict could have detected, and what a board of them means.

A verdict of "no detectable difference" says nothing without the difference that *could* have been detected, and a
board of ~45 comparisons that calls one p = 0.016 "better" has not controlled its error rate. This module gives:

- :func:`holm` and :func:`benjamini_hochberg`: adjusted p-values across a family of comparisons (Holm controls the
  family-wise error rate, BH the false discovery rate); :func:`adjust` picks one by name.
- :func:`sign_test_power`: the exact power of the two-sided sign test (the paper's rule's distribution-free half,
  :func:`randattn.stats.sign_test`) for ``n`` paired units, when a unit is a win with probability ``noise + effect``,
  a loss with probability ``noise`` and a tie otherwise.
- :func:`mde_sign`: the minimum detectable effect of that test: the smallest ``effect`` = P(win) - P(loss) that it
  detects with the given power. For a 0/1 endpoint with one run per unit it *is* the mean accuracy difference
  (each paired difference is -1, 0 or +1, so its mean is the win rate minus the loss rate). ``math.inf`` when no
  effect is detectable at this ``n`` (even all wins, no losses, stay above ``alpha``).
- :func:`mde_normal`: the normal-approximation MDE in the endpoint's own units, for a continuous paired endpoint
  (log-probabilities) with a known or observed standard deviation of the differences.
- :func:`units_for_mde`: how many units a target MDE needs (the ``--target-mde`` planner).

Every function is exact arithmetic on the binomial (log-space sums), no sampling and no SciPy, so the core stays
torch + numpy; the tests check them against SciPy, brute-force enumeration and a planted-effect simulation.
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist
from typing import Sequence

import numpy as np

__all__ = ["holm", "benjamini_hochberg", "adjust", "ADJUSTMENTS", "sign_test_power", "mde_sign", "mde_normal",
           "units_for_mde", "noise_rate", "POWER"]

#: The power every MDE is stated at unless told otherwise (the usual planning value).
POWER = 0.8
#: Adjustment methods by the name a verdict row records.
ADJUSTMENTS = ("holm", "bh", "none")


def _check_p(pvalues: Sequence[float]) -> np.ndarray:
    p = np.asarray(pvalues, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"p-values must be a flat sequence, got shape {p.shape}")
    if p.size and (not np.all(np.isfinite(p)) or p.min() < 0 or p.max() > 1):
        raise ValueError(f"p-values must lie in [0, 1], got {p.tolist()}")
    return p


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order: rejecting those ``<= alpha`` controls the
    family-wise error rate at ``alpha`` under any dependence between the comparisons."""
    p = _check_p(pvalues)
    m = p.size
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])  # (m - i) p_(i), i from 0
    adjusted = np.empty(m)
    adjusted[order] = np.maximum.accumulate(scaled)  # step-down: never below an earlier (smaller) one
    return adjusted.tolist()


def benjamini_hochberg(pvalues: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg step-up adjusted p-values (q-values), in the input's order: rejecting those ``<= alpha``
    controls the false discovery rate at ``alpha`` for independent or positively dependent comparisons."""
    p = _check_p(pvalues)
    m = p.size
    order = np.argsort(p, kind="stable")
    scaled = p[order] * m / np.arange(1, m + 1)
    adjusted = np.empty(m)
    adjusted[order] = np.minimum(1.0, np.minimum.accumulate(scaled[::-1])[::-1])  # step-up: never above a later one
    return adjusted.tolist()


def adjust(pvalues: Sequence[float], method: str = "holm") -> list[float]:
    """Adjusted p-values by ``method``: ``holm`` (family-wise), ``bh`` (false discovery rate) or ``none``."""
    if method == "holm":
        return holm(pvalues)
    if method == "bh":
        return benjamini_hochberg(pvalues)
    if method == "none":
        return _check_p(pvalues).tolist()
    raise ValueError(f"adjustment must be one of {', '.join(ADJUSTMENTS)}, got {method!r}")


def _check_level(name: str, x: float) -> float:
    if not (isinstance(x, (int, float)) and 0 < x < 1):
        raise ValueError(f"{name} must be a number strictly between 0 and 1, got {x!r}")
    return float(x)


_LOG_FACTORIALS = np.zeros(1)  # log k! for k = 0..len - 1, grown on demand (the power sums ask for every m <= n)


def _log_factorials(n: int) -> np.ndarray:
    global _LOG_FACTORIALS
    if len(_LOG_FACTORIALS) <= n:
        size = max(n + 1, 2 * len(_LOG_FACTORIALS))
        _LOG_FACTORIALS = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, size, dtype=np.float64)))])
    return _LOG_FACTORIALS


def _log_binom_pmf(n: int, p: float) -> np.ndarray:
    """log P(X = k), k = 0..n, for X ~ Binomial(n, p); exact limits at p = 0 and p = 1."""
    k = np.arange(n + 1)
    if not 0 < p < 1:
        return np.where(k == (n if p >= 1 else 0), 0.0, -np.inf)
    lf = _log_factorials(max(n, 1))
    return lf[n] - lf[k] - lf[n - k] + k * math.log(p) + (n - k) * math.log1p(-p)


@lru_cache(maxsize=4096)
def _max_rejected_minority(m: int, alpha: float) -> int:
    """The largest ``k`` with the two-sided sign-test p of ``min(wins, losses) = k`` among ``m`` discordant units
    below ``alpha`` (``p = min(1, 2 P(Bin(m, 1/2) <= k))``, as :func:`randattn.stats.sign_test`); -1 when even
    ``k = 0`` is not."""
    if m == 0:
        return -1
    cdf = np.cumsum(np.exp(_log_binom_pmf(m, 0.5)))
    below = np.nonzero(np.minimum(1.0, 2 * cdf) < alpha)[0]
    return int(below[-1]) if below.size else -1


def sign_test_power(n: int, effect: float, *, noise: float = 0.0, alpha: float = 0.05) -> float:
    """Exact power of the two-sided sign test (``p < alpha``) on ``n`` paired units, each a win with probability
    ``noise + effect``, a loss with probability ``noise`` and a tie otherwise (ties dropped, as the test does).

    Power counts rejections in the effect's direction only (a "better" verdict for a better selector); the
    opposite-direction rejections of a two-sided test are left out, so at ``effect = 0`` this is alpha's half
    that lands on the "better" side."""
    if not (isinstance(n, int) and n >= 0):
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    alpha = _check_level("alpha", alpha)
    w, l = noise + effect, noise
    if noise < 0 or effect < 0 or w + l > 1 + 1e-12:
        raise ValueError(f"need noise >= 0, effect >= 0 and 2 * noise + effect <= 1, got noise={noise}, "
                         f"effect={effect}")
    q = min(1.0, w + l)
    if n == 0 or q == 0:
        return 0.0
    log_m = _log_binom_pmf(n, q)  # how many units are discordant
    power = 0.0
    for m in range(1, n + 1):
        k = _max_rejected_minority(m, alpha)
        if k < 0 or log_m[m] == -np.inf:
            continue
        # losses are the minority in the effect's direction: losses <= k among m discordant units
        power += math.exp(log_m[m]) * float(np.exp(_log_binom_pmf(m, l / q)[: k + 1]).sum())
    return min(1.0, power)


def mde_sign(n: int, *, noise: float = 0.0, alpha: float = 0.05, power: float = POWER, tol: float = 1e-4) -> float:
    """The smallest effect (P(win) - P(loss)) the two-sided sign test at level ``alpha`` detects with ``power``
    on ``n`` units whose two arms disagree both ways at rate ``noise`` (see :func:`noise_rate`); ``math.inf``
    when none is (``n`` too small for ``alpha``: even every unit a win stays at p >= alpha)."""
    power = _check_level("power", power)
    alpha = _check_level("alpha", alpha)
    if not 0 <= noise <= 0.5:
        raise ValueError(f"noise must lie in [0, 0.5], got {noise!r}")
    top = 1.0 - 2 * noise
    if top <= 0 or sign_test_power(n, top, noise=noise, alpha=alpha) < power:
        return math.inf
    lo, hi = 0.0, top  # power grows with the effect at fixed noise: bisect the first effect that reaches it
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if sign_test_power(n, mid, noise=noise, alpha=alpha) >= power:
            hi = mid
        else:
            lo = mid
    return hi


def mde_normal(sd: float, n: int, *, alpha: float = 0.05, power: float = POWER) -> float:
    """Normal-approximation MDE of a paired mean difference in the endpoint's units:
    ``(z_{1-alpha/2} + z_{power}) * sd / sqrt(n)``; ``math.inf`` for ``n < 2`` or an unknown ``sd``."""
    alpha, power = _check_level("alpha", alpha), _check_level("power", power)
    if n < 2 or not math.isfinite(sd):
        return math.inf
    z = NormalDist()
    return (z.inv_cdf(1 - alpha / 2) + z.inv_cdf(power)) * sd / math.sqrt(n)


def noise_rate(differences: Sequence[float]) -> float:
    """The rate at which two arms disagree in *both* directions on these paired differences:
    ``min(wins, losses) / n``, the part of the discordance an effect does not explain."""
    d = np.asarray(differences, dtype=np.float64)
    if d.size == 0:
        raise ValueError("cannot estimate a noise rate from zero units")
    return float(min((d > 0).sum(), (d < 0).sum()) / d.size)


def units_for_mde(target: float, *, noise: float = 0.0, alpha: float = 0.05, power: float = POWER,
                  sd: float | None = None, max_units: int = 100_000) -> int:
    """How many paired units make ``target`` detectable: the sign test's exact count (the smallest ``n`` with
    :func:`sign_test_power` ``>= power`` at ``effect = target``; the discrete test's power is not monotone in
    ``n``, so this is the first ``n`` that reaches it), or with ``sd`` the normal approximation's
    ``ceil(((z_{1-alpha/2} + z_power) * sd / target) ** 2)``."""
    if not (isinstance(target, (int, float)) and 0 < target < 1):
        raise ValueError(f"--target-mde must be strictly between 0 and 1, got {target!r}")
    alpha, power = _check_level("alpha", alpha), _check_level("power", power)
    if sd is not None:
        z = NormalDist()
        n = ((z.inv_cdf(1 - alpha / 2) + z.inv_cdf(power)) * sd / target) ** 2
        return max(2, math.ceil(n - 1e-9))  # the guard: an n that is exact up to rounding is not rounded up
    if target + 2 * noise > 1:
        raise ValueError(f"an effect of {target} cannot occur with noise {noise} (needs effect + 2 * noise <= 1)")
    lo = 1
    hi = 1
    while sign_test_power(hi, target, noise=noise, alpha=alpha) < power:  # doubling, then a linear scan back
        lo, hi = hi, hi * 2
        if hi > max_units:
            raise ValueError(f"an effect of {target} needs more than {max_units} units at alpha={alpha}, "
                             f"noise={noise}")
    for n in range(lo, hi + 1):
        if sign_test_power(n, target, noise=noise, alpha=alpha) >= power:
            return n
    return hi
