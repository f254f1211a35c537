"""randattn.power against independent implementations: SciPy's exact binomial test, brute-force enumeration of
every outcome, the step-down / step-up definitions of Holm and BH, and planted-effect simulations (a synthetic
selector with a known advantage is found at the power the MDE predicts; known-null ones are not flagged more often
than alpha once adjusted)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy.stats import binom, binomtest

from randattn.power import (adjust, benjamini_hochberg, holm, mde_normal, mde_sign, noise_rate, sign_test_power,
                            units_for_mde)
from randattn.stats import sign_test

BOARD = 45  # the shipped board's family: 9 selectors x 5 tasks


def test_sign_test_p_is_scipys_exact_binomial():
    for wins, losses in [(7, 0), (7, 1), (3, 5), (0, 0), (10, 10), (30, 12), (1, 0), (50, 31)]:
        d = [1.0] * wins + [-1.0] * losses + [0.0] * 3
        p = sign_test(d).p
        ref = binomtest(wins, wins + losses, 0.5).pvalue if wins + losses else 1.0
        assert p == pytest.approx(ref, rel=1e-12), (wins, losses)
        assert float(_sign_p(np.array(wins), np.array(losses))) == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("n", [1, 3, 5, 7])
@pytest.mark.parametrize("noise,effect", [(0.0, 0.5), (0.1, 0.3), (0.25, 0.0), (0.05, 0.9)])
def test_power_equals_brute_force_enumeration(n, noise, effect):
    """Every sequence of win/tie/loss outcomes, its probability, and the sign test's own verdict on it."""
    alpha = 0.2  # large enough that small n can reject at all
    probs = {1.0: noise + effect, -1.0: noise, 0.0: 1 - 2 * noise - effect}
    total = 0.0
    for outcome in itertools.product((1.0, -1.0, 0.0), repeat=n):
        pr = math.prod(probs[o] for o in outcome)
        t = sign_test(outcome)
        if pr and t.p < alpha and t.wins > t.losses:
            total += pr
    assert sign_test_power(n, effect, noise=noise, alpha=alpha) == pytest.approx(total, abs=1e-12)


def _sign_p(wins, losses):
    """SciPy's exact two-sided binomial p for the sign test, vectorised (at P = 1/2 the two tails are mirror
    images, so binomtest's p is 2 * cdf(min) capped at 1; checked against binomtest above)."""
    n = wins + losses
    return np.where(n > 0, np.minimum(1.0, 2 * binom.cdf(np.minimum(wins, losses), np.maximum(n, 1), 0.5)), 1.0)


def _simulate_detections(n, effect, noise, alpha, trials, rng, comparisons=1):
    """Fraction of boards in which the first comparison (carrying ``effect``; the rest are null) is called better
    by the sign test at ``alpha`` after Holm across the board's ``comparisons``, and in which a null one is."""
    counts = rng.multinomial(n, [noise + effect, noise, 1 - 2 * noise - effect], size=(trials, 1))
    null = rng.multinomial(n, [noise, noise, 1 - 2 * noise], size=(trials, comparisons - 1))
    counts = np.concatenate([counts, null], axis=1)
    ps = _sign_p(counts[..., 0], counts[..., 1])
    found_true = found_any_null = 0
    for board, p in zip(counts, ps):
        adj = holm(p)
        found_true += adj[0] < alpha and board[0][0] > board[0][1]
        found_any_null += any(a < alpha for a in adj[1:])
    return found_true / trials, found_any_null / trials


def test_a_planted_effect_at_the_mde_is_found_at_the_predicted_power():
    """n = 64 units, 45 comparisons, Holm at 0.05: the planted selector's advantage equals mde_sign at the
    Holm first-step level (alpha / 45), so it must be found at (at least) the power the MDE promises."""
    rng = np.random.default_rng(0)
    n, noise, alpha = 64, 0.05, 0.05
    mde = mde_sign(n, noise=noise, alpha=alpha / BOARD)
    predicted = sign_test_power(n, mde, noise=noise, alpha=alpha / BOARD)
    assert predicted >= 0.8
    found, _ = _simulate_detections(n, mde, noise, alpha, trials=3000, rng=rng, comparisons=BOARD)
    se = math.sqrt(predicted * (1 - predicted) / 3000)
    assert abs(found - predicted) < 4 * se, (found, predicted)
    # half the MDE is found far less often than the promised power: the MDE is not a vacuous bound
    half, _ = _simulate_detections(n, mde / 2, noise, alpha, trials=600, rng=rng, comparisons=BOARD)
    assert half < 0.5


def test_known_null_selectors_are_not_flagged_more_often_than_alpha_after_holm():
    rng = np.random.default_rng(1)
    trials, n, noise, alpha = 3000, 32, 0.2, 0.05
    counts = rng.multinomial(n, [noise, noise, 1 - 2 * noise], size=(trials, BOARD))
    raw_any = holm_any = bh_any = 0
    for ps in _sign_p(counts[..., 0], counts[..., 1]):
        raw_any += ps.min() < alpha
        holm_any += min(holm(ps)) < alpha
        bh_any += min(benjamini_hochberg(ps)) < alpha  # all null: FDR = FWER
    se = math.sqrt(alpha * (1 - alpha) / trials)
    assert holm_any / trials <= alpha + 3 * se
    assert bh_any / trials <= alpha + 3 * se
    assert raw_any / trials > 3 * alpha  # unadjusted, a board of null selectors "finds" something often


def _holm_by_definition(p, alpha):
    """Step-down: sort, reject while p_(i) <= alpha / (m - i), stop at the first that is not."""
    order = sorted(range(len(p)), key=lambda i: p[i])
    rejected = set()
    for rank, i in enumerate(order):
        if p[i] > alpha / (len(p) - rank):
            break
        rejected.add(i)
    return rejected


def _bh_by_definition(p, alpha):
    """Step-up: the largest k with p_(k) <= k alpha / m; reject the k smallest."""
    order = sorted(range(len(p)), key=lambda i: p[i])
    k = max([r + 1 for r, i in enumerate(order) if p[i] <= (r + 1) * alpha / len(p)], default=0)
    return set(order[:k])


def test_adjusted_p_values_reject_exactly_what_the_procedures_reject():
    rng = np.random.default_rng(2)
    for _ in range(300):
        m = int(rng.integers(1, 20))
        p = np.where(rng.random(m) < 0.3, rng.random(m) * 0.01, rng.random(m)).tolist()
        if rng.random() < 0.2:
            p[0] = p[-1]  # ties
        h, b = holm(p), benjamini_hochberg(p)
        assert all(h[i] >= p[i] - 1e-15 and b[i] >= p[i] - 1e-15 for i in range(m))
        for alpha in (0.001, 0.01, 0.05, 0.1, 0.25):
            assert {i for i in range(m) if h[i] <= alpha} == _holm_by_definition(p, alpha)
            assert {i for i in range(m) if b[i] <= alpha} == _bh_by_definition(p, alpha)
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert benjamini_hochberg([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.04, 0.04])
    assert adjust([0.2, 0.01], "none") == [0.2, 0.01]


def test_eight_units_can_detect_nothing_across_a_45_comparison_board():
    """The shipped repeat/question boards' n = 8: even 8 wins, 0 losses give p = 0.0078 > 0.05 / 45."""
    assert sign_test([1.0] * 8).p > 0.05 / BOARD
    assert mde_sign(8, alpha=0.05 / BOARD) == math.inf
    assert mde_sign(8, alpha=0.05) < 1  # alone, an 80%-win effect is detectable


def test_mde_sign_is_the_first_effect_reaching_the_power():
    for n, noise in [(16, 0.0), (64, 0.1), (128, 0.25)]:
        mde = mde_sign(n, noise=noise, alpha=0.01)
        assert sign_test_power(n, mde, noise=noise, alpha=0.01) >= 0.8
        assert sign_test_power(n, max(0.0, mde - 2e-3), noise=noise, alpha=0.01) < 0.8


def test_units_for_mde_is_the_first_n_reaching_the_power():
    for target, noise in [(0.2, 0.0), (0.15, 0.1)]:
        n = units_for_mde(target, noise=noise, alpha=0.05 / BOARD)
        assert sign_test_power(n, target, noise=noise, alpha=0.05 / BOARD) >= 0.8
        assert all(sign_test_power(k, target, noise=noise, alpha=0.05 / BOARD) < 0.8 for k in range(1, n))


def test_mde_normal_matches_a_simulated_z_test():
    rng = np.random.default_rng(3)
    n, sd, alpha = 128, 1.5, 0.05 / BOARD
    mde = mde_normal(sd, n, alpha=alpha)
    z_crit = 3.2608  # z_{1 - alpha/2} at alpha = 0.05 / 45 (NormalDist().inv_cdf(1 - 0.05 / 90) = 3.2608...)
    d = rng.normal(mde, sd, size=(4000, n))
    z = d.mean(1) / (sd / math.sqrt(n))
    assert (z > z_crit).mean() == pytest.approx(0.8, abs=0.03)
    assert units_for_mde(mde, sd=sd, alpha=alpha) == n


def test_noise_rate_is_the_two_sided_discordance():
    assert noise_rate([1, 1, 1, -1, 0, 0, 0, 0]) == 1 / 8
    assert noise_rate([0, 0]) == 0.0


@pytest.mark.parametrize("bad", [0, 1, -0.1, 1.5, float("nan"), "0.1"])
def test_target_mde_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="--target-mde must be strictly between 0 and 1"):
        units_for_mde(bad)


def test_bad_levels_and_p_values_are_refused():
    with pytest.raises(ValueError, match="alpha must be"):
        mde_sign(10, alpha=0)
    with pytest.raises(ValueError, match="power must be"):
        mde_sign(10, power=1)
    with pytest.raises(ValueError, match="p-values must lie in"):
        holm([0.1, 1.2])
    with pytest.raises(ValueError, match="adjustment must be one of"):
        adjust([0.1], "bonferonni")
