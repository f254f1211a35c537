"""randattn.stats against hand-computed cases."""

import numpy as np
import pytest

from randattn.stats import bootstrap, mean_ci, recall, recall_ci


def test_recall_is_a_ratio_of_sums_not_a_mean_of_ratios():
    lp_del, lp_all, lp_cond = [-10.0, -10.0], [0.0, -2.0], [-5.0, -10.0]
    # (5 + 0) / (10 + 8); the mean of per-instance ratios would be (0.5 + 0) / 2 = 0.25.
    assert recall(lp_cond, lp_del, lp_all) == pytest.approx(5 / 18)
    assert recall(lp_all, lp_del, lp_all) == 1.0
    assert recall(lp_del, lp_del, lp_all) == 0.0


def test_recall_ci_brackets_the_point_and_is_reproducible():
    rng = np.random.default_rng(0)
    d = rng.normal(-12, 2, 60)
    a = d + rng.normal(10, 2, 60)
    c = d + 0.4 * (a - d) + rng.normal(0, 1, 60)
    est = recall_ci(c, d, a, seed=3)
    assert est.lo < est.value < est.hi
    assert est.lo > 0.2 and est.hi < 0.6
    assert recall_ci(c, d, a, seed=3) == est
    assert est.value == pytest.approx(recall(c, d, a))


def test_mean_ci_of_retrieval_outcomes():
    assert mean_ci([1, 1, 1, 1]).lo == 1.0
    est = mean_ci([1, 0] * 50, seed=1)
    assert est.value == 0.5 and 0.38 < est.lo < 0.45 and 0.55 < est.hi < 0.62
    narrow = mean_ci([1, 0] * 500, seed=1)
    assert narrow.hi - narrow.lo < (est.hi - est.lo) / 2


def test_paired_columns_are_resampled_together():
    x = np.arange(40.0)
    # Differences of a column with itself are 0 in every resample only if rows stay paired.
    est = bootstrap(lambda a, b: (a - b).mean(-1), x, x.copy())
    assert est.lo == est.hi == 0.0


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="same length"):
        recall([1.0], [0.0, 1.0], [2.0])
    with pytest.raises(ValueError, match="zero instances"):
        mean_ci([])
    with pytest.raises(ValueError, match="n_resamples"):
        mean_ci([1, 0], n_resamples=10)
