"""Keep-log statistics: hand-built keep-sets give hand-computed metrics, and Random's survival curves
from the core alone (no model) match the analytic ones."""

import math

import numpy as np
import pytest
import torch

import randattn
from randattn import keepstats as ks


def _log(records):
    """A KeepLog from ``{layer: [(seq_len, [[head0 positions], [head1 positions]]), ...]}`` (batch 1)."""
    log = randattn.KeepLog()
    for layer, recs in records.items():
        for r, (seq_len, heads) in enumerate(recs):
            log.record(layer, r, seq_len, torch.tensor([heads]))
    return log


# Two layers, two heads, K=4, prompt = positions 0-1; rounds at seq_len 6 and 8. Physically consistent:
# a head only keeps, at a later round, what it held before plus the positions written since.
HAND = _log({
    0: [(6, [[0, 1, 2, 3], [1, 2, 4, 5]]), (8, [[0, 2, 3, 6], [1, 4, 5, 6]])],
    1: [(6, [[1, 2, 3, 4], [2, 3, 4, 5]]), (8, [[1, 3, 4, 6], [3, 4, 5, 6]])],
})


def test_slot_coverage_counts_positions_some_head_kept_at_some_round():
    # generated candidates 2..7 (seq_len 8 at the last round); position 7 never kept in either layer
    assert ks.slot_coverage(HAND, 2) == pytest.approx(5 / 6)
    # with the prompt: layer 0 covers 0..6 (7 of 8), layer 1 covers 1..6 (6 of 8)
    assert ks.slot_coverage(HAND, 0) == pytest.approx((7 / 8 + 6 / 8) / 2)


def test_prompt_survival_union_and_per_head_at_the_last_round():
    # last round: layer 0 heads hold {0} and {1} (union 2/2, per head 1/2); layer 1 {1} and {} (1/2, 1/4)
    out = ks.prompt_survival(HAND, 2)
    assert out["union"] == pytest.approx((1.0 + 0.5) / 2)
    assert out["per_head"] == pytest.approx((0.5 + 0.25) / 2)
    assert math.isnan(ks.prompt_survival(HAND, 0)["union"])


def test_head_jaccard_of_generated_keep_sets():
    # layer 0: {2,3,6} vs {4,5,6} -> 1/5; layer 1: {3,4,6} vs {3,4,5,6} -> 3/4
    assert ks.head_jaccard(HAND, 2) == pytest.approx((1 / 5 + 3 / 4) / 2)
    same = _log({0: [(6, [[2, 3, 4, 5], [2, 3, 4, 5]])]})
    assert ks.head_jaccard(same, 2) == 1.0


def test_coverage_entropy_over_age_bins():
    # two bins over 2..7: [2,5) and [5,8). Layer 0 kept slots 2,3,4 | 5,6,6 -> (1/2, 1/2) -> 1.
    # Layer 1: 3,4,3,4 | 5,6,6 -> (4/7, 3/7).
    h1 = -(4 / 7 * math.log(4 / 7) + 3 / 7 * math.log(3 / 7)) / math.log(2)
    assert ks.coverage_entropy(HAND, 2, n_bins=2) == pytest.approx((1.0 + h1) / 2)
    window = _log({0: [(20, [[16, 17, 18, 19], [16, 17, 18, 19]])]})  # everything in the newest bin
    assert ks.coverage_entropy(window, 0, n_bins=4) == 0.0
    spread = _log({0: [(8, [[0, 2, 4, 6], [1, 3, 5, 7]])]})  # two slots in each of four bins
    assert ks.coverage_entropy(spread, 0, n_bins=4) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="n_bins"):
        ks.coverage_entropy(HAND, 2, n_bins=1)


def test_keep_metrics_bundles_the_functions():
    m = ks.keep_metrics(HAND, 2, n_bins=2)
    assert m == {"slot_coverage": ks.slot_coverage(HAND, 2), "prompt_union": 0.75, "prompt_head": 0.375,
                 "jaccard": ks.head_jaccard(HAND, 2), "entropy": ks.coverage_entropy(HAND, 2, 2)}


def test_survival_curve_by_rounds_hand_computed():
    layer0 = _log({0: [(6, [[0, 1, 2, 3], [1, 2, 4, 5]]), (8, [[0, 2, 3, 6], [1, 4, 5, 6]])]})
    c = ks.survival_curve(layer0, 2, by="rounds")
    # n=1: round 0 sees 2..5 (h0 keeps 2,3; h1 keeps 2,4,5), round 1 sees new 6,7 (both keep 6)
    # n=2: round 1 sees 2..5 again (h0 keeps 2,3; h1 keeps 4,5)
    assert c.total.tolist() == [6, 4]
    assert c.head.tolist() == pytest.approx([7 / 12, 4 / 8])
    assert c.union.tolist() == pytest.approx([5 / 6, 1.0])
    # independent heads with s = (3/6, 4/6) and (1/2, 1/2): unions 5/6 and 3/4
    assert c.independent_union.tolist() == pytest.approx([5 / 6, 3 / 4])
    assert c.deficit.tolist() == pytest.approx([0.0, -0.25])
    assert c.rounds_hist.tolist() == [[0, 6, 0], [0, 0, 4]]
    age = ks.survival_curve(layer0, 2, by="age", width=2)
    # round 0: ages 4,3,2,1 -> bins 1,1,0,0; round 1: ages 6..1 -> bins 2,2,1,1,0,0
    assert age.total.tolist() == [4, 4, 2]
    late = ks.survival_curve(layer0, 2, by="age", width=2, skip_initial=True)
    assert late.total.tolist() == [2, 0, 0]  # only 6 and 7 were written after the first round (seq_len 6)


def test_survival_curve_merge_round_trip_and_errors():
    c = ks.survival_curve(HAND, 2)
    back = ks.SurvivalCurve.from_dict(c.to_dict())
    assert back.total.tolist() == c.total.tolist() and back.rounds_hist.tolist() == c.rounds_hist.tolist()
    both = c.merge(ks.survival_curve(ks.select_rows(HAND, [0]), 2))
    assert both.total.tolist() == (2 * c.total).tolist() and both.head.tolist() == pytest.approx(c.head.tolist())
    with pytest.raises(ValueError, match="merge"):
        c.merge(ks.survival_curve(HAND, 2, by="age", width=2))
    with pytest.raises(ValueError, match="no records"):
        ks.survival_curve(randattn.KeepLog(), 0)
    with pytest.raises(ValueError, match="by must be"):
        ks.survival_curve(HAND, 2, by="tokens")


def test_analytic_curves():
    # the paper's engine: the newest r never compete, so q = (T - r - lp) / (T - lp)
    assert ks.random_round_survival(1024, 64, 0) == pytest.approx(0.9375)
    assert ks.random_survival(3, 48, 16) == pytest.approx((32 / 48) ** 3)
    assert ks.random_survival([0, 2], 48, 16, prompt_len=8, protected=True).tolist() == pytest.approx([1, (24 / 40) ** 2])
    assert ks.random_survival(2, 48, 16, prompt_len=8) == pytest.approx((32 / 48) ** 2)  # unprotected: prompt irrelevant
    # recent=0 (everything competes): q = (T - lp) / (T + r - lp)
    assert ks.random_survival(3, 48, 16, recent=0) == pytest.approx(0.75**3)
    assert ks.random_survival(2, 48, 16, prompt_len=8, protected=True, recent=0) == pytest.approx((40 / 56) ** 2)
    assert ks.union_survival(0.5, 3) == pytest.approx(0.875)
    with pytest.raises(ValueError, match="no free slot"):
        ks.random_round_survival(8, 4, prompt_len=8, protected=True)


# -- the analytic curves against the core, no model --------------------------------------------------
def _feed(cache, layer, n, b, h, d=2):
    start = cache.get_seq_length(layer) if layer < len(cache.layers) else 0
    k = torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1).expand(b, h, n, d).clone()
    cache.update(k, -k, layer)


def _simulate(policy, protect, *, b=4, h=8, budget=48, buffer=16, prompt=8, layers=2, rounds=20, seed=7, recent=None):
    cache = randattn.EvictingCache(policy, budget=budget, buffer=buffer, protect_prompt=protect, seed=seed,
                                   keep_log=True, recent=recent)
    for layer in range(layers):
        _feed(cache, layer, prompt, b, h)
    while cache.events[0] < rounds:
        for layer in range(layers):
            _feed(cache, layer, 1, b, h)
    return cache


def _misfits(curve, q, n_heads, min_obs=500):
    """Bins where per-head or union survival misses the analytic value by more than
    4 binomial standard errors + 0.005 (rounds with fewer than ``min_obs`` observations skipped)."""
    head, union = curve.analytic(q)
    bad, checked = [], 0
    for i in range(len(curve.total)):
        if curve.total[i] < min_obs:
            continue
        checked += 1
        se_h = math.sqrt(head[i] * (1 - head[i]) / (curve.total[i] * n_heads))
        se_u = math.sqrt(union[i] * (1 - union[i]) / curve.total[i])
        if abs(curve.head[i] - head[i]) > 4 * se_h + 0.005:
            bad.append(("head", i + 1, curve.head[i], head[i]))
        if abs(curve.union[i] - union[i]) > 4 * se_u + 0.005:
            bad.append(("union", i + 1, curve.union[i], union[i]))
    return bad, checked


@pytest.mark.parametrize("recent", [None, 0])
@pytest.mark.parametrize("protect", [True, False])
def test_random_core_matches_analytic_per_head_and_union_survival(protect, recent):
    """Random: per head q^n with q = (T-recent-lp)/(T+r-recent-lp) (lp = 0 unprotected; recent = r by
    default, so (T-r-lp)/(T-lp)); union 1-(1-q^n)^H, n the rounds competed in. Tolerance per bin:
    4 binomial standard errors + 0.005 (draws within a round are without replacement, so the binomial
    error is an upper bound)."""
    h, budget, buffer, prompt = 8, 48, 16, 8
    cache = _simulate("random", protect, h=h, budget=budget, buffer=buffer, prompt=prompt, recent=recent)
    q = ks.random_round_survival(budget, buffer, prompt, protect, recent=recent)
    curve = ks.survival_curve(cache.keep_log, prompt)
    bad, checked = _misfits(curve, q, h)
    assert checked >= 15 and not bad, bad
    # the analytic curve given each observation's rounds is exactly q^n for rounds bins
    assert curve.analytic(q)[0][:checked].tolist() == pytest.approx((q ** np.arange(1, checked + 1)).tolist())
    assert np.nanmax(np.abs(curve.deficit[curve.total >= 500])) < 0.02  # independent heads: no deficit
    # without the initial fill, age bins of r tokens are rounds competed in: bin k holds n = k + 1 only, or
    # n = k with the recent window of r (the newest r sat their first round out)
    age = ks.survival_curve(cache.keep_log, prompt, by="age", width=buffer, skip_initial=True)
    hist = age.rounds_hist[age.total > 0]
    shift = 0 if recent == 0 else 1
    assert all(row.nonzero()[0].tolist() == [k + 1 - shift] for k, row in enumerate(hist))
    bad, _ = _misfits(age, q, h)
    assert not bad, bad


@pytest.mark.parametrize("policy,which", [("recency", "head"), ("random-shared", "union")])
def test_the_survival_check_fails_for_other_policies(policy, which):
    """The same check rejects recency (a window, not geometric) and one draw shared by all heads
    (right per head, but the union is no larger than one head: a large deficit)."""
    h, budget, buffer, prompt = 8, 48, 16, 8
    cache = _simulate(policy, True, h=h, budget=budget, buffer=buffer, prompt=prompt)
    curve = ks.survival_curve(cache.keep_log, prompt)
    bad, _ = _misfits(curve, ks.random_round_survival(budget, buffer, prompt, True), h)
    assert any(kind == which for kind, *_ in bad)
    if policy == "random-shared":
        assert curve.union.tolist() == pytest.approx(curve.head.tolist())
        assert np.nanmax(curve.deficit) > 0.4 and np.nanmean(curve.deficit[:6]) > 0.3
        assert ks.head_jaccard(cache.keep_log, prompt) == 1.0


def test_core_metrics_random_vs_shared_draws():
    """Per-head draws almost never drop a new pair in all 8 heads at once (coverage 1 - (r/(T-lp))^8 per
    round ~ 1); a shared draw drops r of them everywhere each round (a share r/(T-lp) = 0.4 at its first)."""
    prompt = 8
    per_head = ks.keep_metrics(_simulate("random", True).keep_log, prompt)
    shared = ks.keep_metrics(_simulate("random-shared", True).keep_log, prompt)
    assert per_head["slot_coverage"] > 0.999 and shared["slot_coverage"] < 0.9
    assert per_head["prompt_union"] == per_head["prompt_head"] == 1.0  # pinned
    assert per_head["jaccard"] < 0.5 < shared["jaccard"] == 1.0
    unprotected = ks.keep_metrics(_simulate("random", False).keep_log, prompt)
    # 20 rounds unprotected: the prompt survives about ((T-r)/T)^20 per head, 1-(1-that)^8 in the union
    # (tolerance 4 binomial standard errors: 8 prompt positions x 4 rows x 2 layers, x 8 heads per head)
    q = (48 - 16) / 48
    s, u, obs = q**20, 1 - (1 - q**20) ** 8, 8 * 4 * 2
    assert unprotected["prompt_head"] == pytest.approx(s, abs=4 * math.sqrt(s * (1 - s) / (obs * 8)))
    assert unprotected["prompt_union"] == pytest.approx(u, abs=4 * math.sqrt(u * (1 - u) / obs))
