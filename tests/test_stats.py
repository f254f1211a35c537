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


# -- paired comparison (the paper's rule: bootstrap CI and exact sign test must both pass) ------------------
from randattn.stats import comparison_table, paired_comparison, sign_test  # noqa: E402


def test_sign_test_exact_values():
    t = sign_test([1, 1, 1, 1, 1, 1, 1, 1, -1, -1, 0, 0])
    assert (t.wins, t.losses, t.ties) == (8, 2, 2)
    assert t.p == pytest.approx(2 * (1 + 10 + 45) / 1024)  # 0.109375
    assert sign_test([1] * 6).p == pytest.approx(2 / 64)
    assert sign_test([0, 0]).p == 1.0


def test_paired_comparison_averages_runs_per_problem_and_needs_both_tests():
    # 30 problems, 4 runs each; A solves every problem B solves, plus 6 more on 3 of 4 runs.
    b = {i: [1, 1, 1, 1] if i < 12 else [0, 0, 0, 0] for i in range(30)}
    a = {i: v if i < 12 or i >= 18 else [1, 1, 1, 0] for i, v in b.items()}
    c = paired_comparison(a, b, seed=1)
    assert c.delta.value == pytest.approx(6 * 0.75 / 30)
    assert c.sign.wins == 6 and c.sign.losses == 0 and c.sign.p == pytest.approx(2 / 64)
    assert c.delta.lo > 0 and c.significant and c.verdict == "better"
    # Same mean gain from a single problem: the CI may exclude 0 but the sign test cannot pass.
    one = {i: v for i, v in b.items()}
    one[20] = [1, 1, 1, 1]
    c1 = paired_comparison(one, b, seed=1)
    assert c1.sign.p == 1.0 and not c1.significant and c1.verdict == "indistinguishable"
    assert paired_comparison(b, b).verdict == "indistinguishable"
    with pytest.raises(ValueError, match="share no problems"):
        paired_comparison({1: [1]}, {2: [0]})


def test_comparison_table_marks_significant_cells():
    b = {i: [1] if i < 12 else [0] for i in range(30)}
    a = {i: [1] if i < 20 else [0] for i in range(30)}
    res = {("random", "t1"): a, ("snapkv", "t1"): b, ("random", "t2"): b, ("snapkv", "t2"): b}
    md = comparison_table(res)
    assert "| snapkv | 0.400 (-0.267*) | 0.400 (+0.000) |" in md
    assert "$^{*}$" in comparison_table(res, fmt="latex")
    assert comparison_table(res, fmt="csv").splitlines()[0] == "method,t1,t2"
    with pytest.raises(ValueError, match="fmt"):
        comparison_table(res, fmt="html")


def test_sign_test_matches_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(5)
    for _ in range(20):
        d = rng.integers(-1, 2, size=rng.integers(1, 60))
        t = sign_test(d)
        if t.wins + t.losses:
            ref = scipy_stats.binomtest(t.wins, t.wins + t.losses, 0.5).pvalue
            assert t.p == pytest.approx(ref, rel=1e-9)


def test_the_bootstrap_resamples_problems_not_runs():
    # Runs of a problem agree perfectly: 8 runs carry no more information than one.
    rng = np.random.default_rng(0)
    per_problem = rng.integers(-1, 2, size=20)
    a = {i: [float(per_problem[i] == 1)] * 8 for i in range(20)}
    b = {i: [float(per_problem[i] == -1)] * 8 for i in range(20)}
    clustered = paired_comparison(a, b, seed=2).delta
    runs = mean_ci([x - y for i in range(20) for x, y in zip(a[i], b[i])], seed=2)  # wrongly treats runs as units
    assert clustered.value == pytest.approx(runs.value)
    assert (clustered.hi - clustered.lo) > 2 * (runs.hi - runs.lo)
