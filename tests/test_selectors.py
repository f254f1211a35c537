"""The attention-based selectors (h2o, snapkv, rkv, vase) in randattn/selectors.py.

1. Each vectorised ``policy.score(view)`` equals a slow reference written here from the docstring
   formulas (plain Python loops over batch, KV heads, query heads, window queries and slots; float64
   math; nothing from randattn.selectors), on random hand-built ``CacheView``s.
2. Behaviour on hand-built caches: H2O keeps the heavy hitters, SnapKV what the recent queries look
   at, R-KV drops the older of two identical keys, VaSE keeps its value-range top set and sinks.
3. Every registered policy (triattention has its own file) passes the physical-eviction oracle and
   replay == token-by-token on tiny Llama, Qwen3 and Phi-3; HF generate == replay.
4. Prompt protection holds for every policy; without it the same check catches evictions.
5. (slow) Every policy runs end to end on the embedded SmolLM2 under generate and replay.
6. Bad options and a model without the capture hooks give clear errors.
"""

import itertools
import math

import pytest
import torch
import transformers

import randattn
from randattn.policies import CacheView
from randattn.testing import tiny_config

from conftest import assert_matches_masked_reference, random_ids

SELECTORS = ["h2o", "snapkv", "rkv", "vase"]
# triattention needs calibration statistics and is tested in tests/test_triattention.py.
POLICIES = [p for p in randattn.known_policies() if p != "triattention"]


def test_selectors_are_registered():
    assert set(SELECTORS) <= set(POLICIES)


# ---------------------------------------------------------------------------------------------
# 1. Slow references from the docstring formulas
# ---------------------------------------------------------------------------------------------

INF = float("inf")


def _ref_window_attention(view, aggregate):
    """A[b][h][t][j]: attention of recent query t over slot j for KV head h, combined over the
    query heads of its group; query t sees slot j iff position_j <= position of t."""
    q = view.queries.double().tolist()
    k = view.keys.double().tolist()
    pos = view.positions.tolist()
    qpos = view.query_positions.tolist()
    n_b, n_hq, n_w, n_d = view.queries.shape
    n_h, n_s = view.keys.shape[1], view.keys.shape[2]
    group = n_hq // n_h
    scale = view.scaling if view.scaling is not None else 1.0 / math.sqrt(n_d)
    out = [[[[0.0] * n_s for _ in range(n_w)] for _ in range(n_h)] for _ in range(n_b)]
    for b in range(n_b):
        for h in range(n_h):
            for t in range(n_w):
                per_query_head = []
                for g in range(group):
                    hq = h * group + g  # HF's repeat_kv: query head hq reads KV head hq // group
                    logits = {}
                    for j in range(n_s):
                        if pos[b][h][j] <= qpos[t]:
                            logits[j] = scale * sum(q[b][hq][t][d] * k[b][h][j][d] for d in range(n_d))
                    top = max(logits.values())
                    z = sum(math.exp(x - top) for x in logits.values())
                    per_query_head.append([math.exp(logits[j] - top) / z if j in logits else 0.0 for j in range(n_s)])
                for j in range(n_s):
                    column = [p[j] for p in per_query_head]
                    out[b][h][t][j] = sum(column) / group if aggregate == "mean" else max(column)
    return out


def _ref_pool(row, kernel, pooling):
    """Pool one head's scores over ``kernel`` neighbouring slots: slot i takes slots
    i - kernel//2 ... i - kernel//2 + kernel - 1 (centred for odd kernels), clipped to the cache."""
    if kernel <= 1:
        return list(row)
    out = []
    for i in range(len(row)):
        lo = i - kernel // 2
        hood = [row[j] for j in range(max(lo, 0), min(lo + kernel - 1, len(row) - 1) + 1)]
        out.append(max(hood) if pooling == "max" else sum(hood) / len(hood))
    return out


def _ref_snapkv_importance(view, kernel, pooling, aggregate):
    att = _ref_window_attention(view, aggregate)
    n_b, n_h, n_s = view.shape
    return [
        [_ref_pool([sum(att[b][h][t][j] for t in range(len(att[b][h]))) for j in range(n_s)], kernel, pooling) for h in range(n_h)]
        for b in range(n_b)
    ]


def _ref_pin_recent(scores, view, count):
    pos = view.positions.tolist()
    for b, heads in enumerate(scores):
        for h, row in enumerate(heads):
            for j in range(len(row)):
                if count > 0 and pos[b][h][j] >= view.seq_len - count:
                    row[j] = INF
    return scores


def ref_h2o(view, recent_fraction=0.5, aggregate="mean"):
    att = view.attention.double().tolist()
    n_b, n_h, n_s = view.shape
    group = len(att[0]) // n_h
    scores = []
    for b in range(n_b):
        heads = []
        for h in range(n_h):
            row = []
            for j in range(n_s):
                column = [att[b][h * group + g][j] for g in range(group)]
                row.append(sum(column) / group if aggregate == "mean" else max(column))
            heads.append(row)
        scores.append(heads)
    return _ref_pin_recent(scores, view, round(recent_fraction * view.budget))


def ref_snapkv(view, window=32, kernel=7, pooling="max", aggregate="mean"):
    return _ref_pin_recent(_ref_snapkv_importance(view, kernel, pooling, aggregate), view, window)


def ref_rkv(view, window=8, kernel=7, pooling="max", aggregate="max", lam=0.1, threshold=0.5):
    importance = _ref_snapkv_importance(view, kernel, pooling, aggregate)
    keys = view.keys.double().tolist()
    pos = view.positions.tolist()
    n_b, n_h, n_s = view.shape
    scores = []
    for b in range(n_b):
        heads = []
        for h in range(n_h):
            norms = [math.sqrt(sum(x * x for x in keys[b][h][i])) for i in range(n_s)]
            red = []
            for i in range(n_s):
                total = 0.0
                for j in range(n_s):
                    if pos[b][h][j] <= pos[b][h][i]:  # only newer copies count
                        continue
                    cos = sum(x * y for x, y in zip(keys[b][h][i], keys[b][h][j])) / (norms[i] * norms[j])
                    if cos >= threshold:
                        total += cos
                red.append(total / max(n_s - 1, 1))
            imp = importance[b][h]
            i_max, c_max = max(imp), max(red)
            row = []
            for i in range(n_s):
                i_hat = imp[i] / i_max if i_max > 0 else 0.0
                c_hat = red[i] / c_max if c_max > 0 else 0.0
                row.append(lam * i_hat + (1 - lam) * (1 - c_hat))
            heads.append(row)
        scores.append(heads)
    return _ref_pin_recent(scores, view, window)


def ref_vase(view, gumbel_seed, n_top=None, n_sink=4, window=32, kernel=7, pooling="max", aggregate="mean"):
    snap = _ref_snapkv_importance(view, kernel, pooling, aggregate)
    # The implementation draws u ~ U(0, 1) once, shaped like the scores, from the view's generator.
    u = torch.rand(view.shape, generator=torch.Generator().manual_seed(gumbel_seed), dtype=torch.float32).tolist()
    values = view.values.double().tolist()
    pos = view.positions.tolist()
    n_b, n_h, n_s = view.shape
    top_count = min(n_top if n_top is not None else max(1, view.budget // 8), n_s)
    scores = []
    for b in range(n_b):
        heads = []
        for h in range(n_h):
            vrange = [max(values[b][h][i]) - min(values[b][h][i]) for i in range(n_s)]
            top = set(sorted(range(n_s), key=lambda i: -vrange[i])[:top_count])
            row = []
            for i in range(n_s):
                if i in top or pos[b][h][i] < n_sink:
                    row.append(INF)
                else:
                    ui = min(max(u[b][h][i], 1e-20), 1.0 - 1e-7)
                    row.append(math.log(max(snap[b][h][i], 1e-30)) - math.log(-math.log(ui)))
            heads.append(row)
        scores.append(heads)
    return scores


def random_view(seed, *, batch=2, kv_heads=2, group=2, dim=8, slots=24, window=6, new=6, budget=None,
                scaling=None, gumbel_seed=0, duplicates=True):
    """A random CacheView as a round would see it: per head a chronological random subset of the
    older positions plus the ``new`` positions written since the last round, the last ``window``
    queries, accumulated attention per query head. Some keys are (scaled) copies of older ones, so
    R-KV's redundancy term is exercised with exact duplicates too."""
    g = torch.Generator().manual_seed(seed)
    seq_len = 3 * slots
    positions = torch.empty(batch, kv_heads, slots, dtype=torch.long)
    for b in range(batch):
        for h in range(kv_heads):
            old = torch.randperm(seq_len - new, generator=g)[: slots - new].sort().values
            positions[b, h] = torch.cat([old, torch.arange(seq_len - new, seq_len)])
    keys = torch.randn(batch, kv_heads, slots, dim, generator=g) * 1.5
    if duplicates:
        for b, h in itertools.product(range(batch), range(kv_heads)):
            src, dst = torch.randperm(slots, generator=g)[:2].sort().values.tolist()
            keys[b, h, dst] = keys[b, h, src] * 1.7
    values = torch.randn(batch, kv_heads, slots, dim, generator=g) * torch.rand(batch, kv_heads, slots, 1, generator=g) * 3
    queries = torch.randn(batch, kv_heads * group, window, dim, generator=g) * 1.5
    query_positions = torch.arange(seq_len - window, seq_len)
    assert int(positions[..., 0].max()) <= seq_len - window, "every window query must see some slot"
    attention = torch.rand(batch, kv_heads * group, slots, generator=g) * 4
    return CacheView(
        keys=keys,
        values=values,
        positions=positions,
        layer_idx=0,
        round_idx=3,
        prompt_len=4,
        seq_len=seq_len,
        budget=budget if budget is not None else slots - new,
        buffer=new,
        generator=torch.Generator().manual_seed(gumbel_seed),
        queries=queries,
        query_positions=query_positions,
        scaling=scaling,
        attention=attention,
    )


def _as_tensor(nested):
    return torch.tensor(nested, dtype=torch.float64)


def _check(policy, view, expected, atol=1e-6, rtol=1e-5):
    got = policy.score(view)
    assert got.shape == view.shape
    expected = _as_tensor(expected)
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol)
    finite = torch.isfinite(expected)
    assert finite.any() and (~finite).any(), "the case must have both pinned and scored slots"
    # has teeth: scores of the unpinned slots are not all equal
    assert expected[finite].std() > 1e-3


def test_window_attention_matches_reference():
    from randattn.selectors import window_attention

    for seed, group, aggregate in [(0, 2, "mean"), (1, 2, "max"), (2, 1, "mean")]:
        view = random_view(seed, group=group, window=8, scaling=0.4 if seed else None)
        got = window_attention(view, aggregate)
        torch.testing.assert_close(got.double(), _as_tensor(_ref_window_attention(view, aggregate)), atol=1e-6, rtol=1e-5)
        assert (got == 0).any(), "some slots are newer than early window queries (causal mask exercised)"


@pytest.mark.parametrize("group,aggregate", [(1, "mean"), (2, "mean"), (2, "max")])
@pytest.mark.parametrize("recent_fraction", [0.0, 0.3, 0.5, 0.75])
def test_h2o_matches_reference(group, aggregate, recent_fraction):
    view = random_view(11, group=group, slots=20, budget=14)
    policy = randattn.make_policy("h2o", recent_fraction=recent_fraction, aggregate=aggregate)
    expected = ref_h2o(view, recent_fraction, aggregate)
    if recent_fraction == 0.0:  # nothing pinned: compare everything directly
        torch.testing.assert_close(policy.score(view).double(), _as_tensor(expected), atol=1e-6, rtol=1e-5)
    else:
        _check(policy, view, expected)


SNAP_CASES = [
    (i, group, aggregate, pooling, kernel, window)
    for i, ((group, aggregate, pooling, kernel), window) in enumerate(zip(
        itertools.product([1, 2], ["mean", "max"], ["max", "avg"], [1, 3, 4, 7]), itertools.cycle([1, 4, 8])
    ))
]


@pytest.mark.parametrize("seed,group,aggregate,pooling,kernel,window", SNAP_CASES)
def test_snapkv_matches_reference(seed, group, aggregate, pooling, kernel, window):
    view = random_view(seed, group=group, window=window, scaling=None if kernel % 2 else 0.3)
    policy = randattn.make_policy("snapkv", window=window, kernel=kernel, pooling=pooling, aggregate=aggregate)
    _check(policy, view, ref_snapkv(view, window, kernel, pooling, aggregate))


RKV_CASES = [
    (group, aggregate, pooling, kernel, lam, threshold)
    for (group, aggregate, pooling), (kernel, lam, threshold) in zip(
        itertools.product([1, 2], ["mean", "max"], ["max", "avg"]),
        itertools.cycle([(7, 0.1, 0.5), (3, 0.0, 0.0), (1, 0.6, 0.5), (4, 1.0, -0.2), (7, 0.3, 0.9)]),
    )
] + [(2, "max", "max", 7, 0.1, 0.5)]


@pytest.mark.parametrize("group,aggregate,pooling,kernel,lam,threshold", RKV_CASES)
def test_rkv_matches_reference(group, aggregate, pooling, kernel, lam, threshold):
    window = 5
    view = random_view(int(100 * lam) + kernel + group, group=group, window=window, slots=26)
    policy = randattn.make_policy(
        "rkv", window=window, kernel=kernel, pooling=pooling, aggregate=aggregate, lam=lam, threshold=threshold
    )
    _check(policy, view, ref_rkv(view, window, kernel, pooling, aggregate, lam, threshold))


def test_rkv_defaults_match_reference():
    view = random_view(5, window=8, slots=30)
    _check(randattn.make_policy("rkv"), view, ref_rkv(view))


VASE_CASES = [
    (group, aggregate, pooling, n_top, n_sink)
    for (group, aggregate, pooling), (n_top, n_sink) in zip(
        itertools.product([1, 2], ["mean", "max"], ["max", "avg"]),
        itertools.cycle([(None, 4), (3, 0), (1, 2), (500, 4)]),
    )
]


@pytest.mark.parametrize("group,aggregate,pooling,n_top,n_sink", VASE_CASES)
def test_vase_matches_reference_with_the_same_gumbel_draws(group, aggregate, pooling, n_top, n_sink):
    window, kernel, gumbel_seed = 6, 3, 1234 + group
    view = random_view(7 + group, group=group, window=window, slots=28, budget=20, gumbel_seed=gumbel_seed)
    policy = randattn.make_policy(
        "vase", n_top=n_top, n_sink=n_sink, window=window, kernel=kernel, pooling=pooling, aggregate=aggregate
    )
    expected = ref_vase(view, gumbel_seed, n_top, n_sink, window, kernel, pooling, aggregate)
    if n_top == 500:  # more than the slots: everything is in the top set
        assert torch.isposinf(policy.score(view)).all() and torch.isposinf(_as_tensor(expected)).all()
        return
    _check(policy, view, expected, atol=1e-5, rtol=1e-5)
    # The Gumbel noise really depends on the generator: another seed gives other scores.
    other = random_view(7 + group, group=group, window=window, slots=28, budget=20, gumbel_seed=gumbel_seed + 1)
    finite = torch.isfinite(_as_tensor(expected))
    assert not torch.allclose(policy.score(other).double()[finite], _as_tensor(expected)[finite])


# ---------------------------------------------------------------------------------------------
# 2. Behaviour on hand-built caches (driven without a model, as the capture hook drives them)
# ---------------------------------------------------------------------------------------------


def _drive(cache, keys, values, queries, scaling=1.0, layer=0):
    """Feed one token per step: hand the step's queries to the cache first (what the capture hook
    does before the attention's ``cache.update``), then its key/value pair."""
    for t in range(keys.shape[2]):
        cache._observe_queries(layer, queries[:, :, t : t + 1], scaling)
        cache.update(keys[:, :, t : t + 1], values[:, :, t : t + 1], layer)


def _kept(cache, layer=0):
    pos = cache.positions(layer)
    return [[set(pos[b, h].tolist()) for h in range(pos.shape[1])] for b in range(pos.shape[0])]


def test_h2o_keeps_the_most_attended_positions():
    budget, buffer, dim = 16, 8, 16
    total = budget + buffer  # exactly one round, at the last token
    hot = {0: [1, 3, 4, 7, 9, 11, 12, 15], 1: [0, 2, 5, 6, 8, 10, 13, 14]}  # 8 = budget - recent pins
    keys = torch.zeros(1, 2, total, dim)
    for h, where in hot.items():
        for j in range(total):
            keys[0, h, j, 1 + j % (dim - 1)] = 1.0  # ordinary keys: orthogonal to the queries
        keys[0, h, where, :] = 0.0
        keys[0, h, where, 0] = 1.0  # heavy hitters: aligned with every query
    queries = torch.zeros(1, 4, total, dim)
    queries[..., 0] = 8.0
    values = torch.randn(1, 2, total, dim)
    cache = randattn.EvictingCache("h2o", budget=budget, buffer=buffer, protect_prompt=False, prompt_len=1)
    _drive(cache, keys, values, queries)
    assert cache.events == [1]
    recent = set(range(total - budget // 2, total))  # recent_fraction 0.5 pins the last K/2
    for h in (0, 1):
        assert _kept(cache)[0][h] == set(hot[h]) | recent
    # The accumulated attention moved with the kept slots: per query head, the heavy hitters (the
    # oldest kept slots) still hold more of it than any recent slot.
    att, pos = cache.layers[0].attention, cache.positions(0)
    assert att.shape == (1, 4, budget)
    for hq in range(4):
        is_hot = torch.isin(pos[0, hq // 2], torch.tensor(hot[hq // 2]))
        assert is_hot.sum() == 8 and att[0, hq][is_hot].min() > 10 * att[0, hq][~is_hot].max()


def test_snapkv_keeps_what_the_recent_queries_look_at():
    total, window, dim = 40, 4, 40
    keys = torch.eye(dim)[:total].expand(1, 2, total, dim).clone()  # one orthogonal key per position
    values = torch.randn(1, 2, total, dim)
    # KV head 0 serves query heads 0, 1; KV head 1 serves 2, 3. Each query head looks at one target.
    targets = {0: 5, 1: 17, 2: 9, 3: 28}
    queries = torch.zeros(1, 4, total, dim)
    for hq, j in targets.items():
        queries[0, hq, -window:, j] = 20.0
    cache = randattn.EvictingCache(
        "snapkv", budget=window + 2, buffer=total - window - 2, protect_prompt=False, prompt_len=1,
        window=window, kernel=1,
    )
    _drive(cache, keys, values, queries)
    assert cache.events == [1]
    last = set(range(total - window, total))
    assert _kept(cache)[0] == [{5, 17} | last, {9, 28} | last]

    # With max pooling over 7 neighbours the targets' neighbourhoods survive too.
    targets = {0: 10, 1: 10, 2: 25, 3: 25}
    queries = torch.zeros(1, 4, total, dim)
    for hq, j in targets.items():
        queries[0, hq, -window:, j] = 20.0
    cache = randattn.EvictingCache(
        "snapkv", budget=window + 7, buffer=total - window - 7, protect_prompt=False, prompt_len=1,
        window=window, kernel=7, pooling="max",
    )
    _drive(cache, keys, values, queries)
    assert _kept(cache)[0] == [set(range(7, 14)) | last, set(range(22, 29)) | last]


@pytest.mark.parametrize("copies", [(6, 13), (4, 9, 15)])
def test_rkv_drops_the_older_copies_of_identical_keys(copies):
    """Everything else equal (orthogonal keys, uniform attention), R-KV evicts the older copies of
    a repeated key and keeps the newest one."""
    total, dim, window = 22, 24, 4
    evicted = len(copies) - 1
    keys = torch.eye(dim)[:total].expand(1, 2, total, dim).clone()
    keys[0, 0, list(copies)] = keys[0, 0, copies[-1]].clone()  # head 0: identical keys at `copies`
    keys[0, 1, [2, 3]] = keys[0, 1, 3].clone()  # head 1: another pair
    queries = torch.zeros(1, 4, total, dim)  # uniform attention: importance equal for every old slot
    values = torch.randn(1, 2, total, dim)
    cache = randattn.EvictingCache(
        "rkv", budget=total - evicted, buffer=evicted, protect_prompt=False, prompt_len=1, window=window
    )
    _drive(cache, keys, values, queries)
    assert cache.events == [1]
    kept = _kept(cache)[0]
    assert kept[0] == set(range(total)) - set(copies[:-1])
    assert {3} <= kept[1] and 2 not in kept[1]


def test_vase_keeps_its_value_range_top_set_and_sinks():
    total, dim, window, budget = 48, 8, 4, 16
    big = [9, 21, 30]  # largest value ranges (not sinks, not recent)
    loud = [6, 26, 35]  # large magnitude but a tiny range: range, not magnitude, picks the top set
    looked_at = 14  # the window queries put almost all attention here
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, total, dim, generator=g) * 0.1
    keys[0, :, looked_at] = 0.0
    keys[0, :, looked_at, 0] = 1.0
    values = torch.randn(1, 2, total, dim, generator=g) * 0.1
    values[0, :, big] = torch.randn(2, len(big), dim, generator=g) * 10
    values[0, :, loud] = 50.0 + torch.randn(2, len(loud), dim, generator=g) * 0.01
    queries = torch.zeros(1, 4, total, dim)
    queries[..., 0] = 30.0
    union = set()
    for seed in range(6):
        cache = randattn.EvictingCache(
            "vase", budget=budget, buffer=total - budget, protect_prompt=False, prompt_len=1, seed=seed,
            n_top=len(big), n_sink=4, window=window, kernel=1,
        )
        _drive(cache, keys, values, queries)
        assert cache.events == [1]
        for kept in _kept(cache)[0]:
            assert set(big) | {0, 1, 2, 3} | {looked_at} <= kept
            union |= kept
    # The other places are sampled: different seeds fill them differently.
    assert len(union) > budget


def test_vase_without_sinks_survives_a_query_whose_keys_were_all_evicted():
    """VaSE does not pin its observation window, so with n_sink=0 and no prompt protection a recent
    query can find its own key and every older one evicted (budget < window - buffer). Its masked
    masked softmax would be all NaN; such a query has nothing left to attend to and must contribute
    nothing (and the scores stay finite)."""
    g = torch.Generator().manual_seed(0)
    cache = randattn.EvictingCache(
        "vase", budget=4, buffer=4, protect_prompt=False, prompt_len=1, seed=0, n_sink=0, window=32
    )
    keys, values = torch.randn(1, 2, 60, 8, generator=g), torch.randn(1, 2, 60, 8, generator=g)
    _drive(cache, keys, values, torch.randn(1, 4, 60, 8, generator=g), scaling=8**-0.5)
    assert min(cache.events) >= 10


# ---------------------------------------------------------------------------------------------
# 3. Physical-eviction oracle and replay for every policy on tiny models
# ---------------------------------------------------------------------------------------------



@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
@pytest.mark.parametrize("policy", POLICIES)
def test_oracle_and_replay_for_every_policy(tiny, arch, policy):
    """Token-by-token decoding equals a full forward with the evicted positions masked per layer
    and head (atol 1e-5), and chunked replay equals token-by-token (same kept positions)."""
    model = tiny(arch)
    ids = random_ids(2, 136, seed=21)
    c1 = randattn.EvictingCache(policy, budget=48, buffer=8, keep_log=True, seed=4)
    slow = randattn.replay_tokenwise(model, ids, c1, prompt_len=10)
    assert min(c1.events) >= 10, "the test must run many rounds"
    assert_matches_masked_reference(model, ids, slow, c1.keep_log)

    c2 = randattn.EvictingCache(policy, budget=48, buffer=8, keep_log=True, seed=4)
    fast = randattn.replay(model, ids, c2, prompt_len=10)
    assert fast.forwards < slow.forwards / 4
    assert c1.events == c2.events
    for l1, l2 in zip(c1.layers, c2.layers):
        assert torch.equal(l1.positions, l2.positions)
    assert len(c1.keep_log) == len(c2.keep_log)
    assert all((a == b).all() for a, b in zip(c1.keep_log.kept, c2.keep_log.kept))
    torch.testing.assert_close(fast.logprobs, slow.logprobs, atol=1e-5, rtol=0, equal_nan=True)


@pytest.mark.parametrize("policy", SELECTORS)
def test_hf_generate_equals_replay_for_selectors(tiny, policy):
    """The capture hooks feed HF generate the same queries as replay: same keep-sets, same scores."""
    model = tiny("qwen3")
    ids = random_ids(2, 12, seed=5)
    c1 = randattn.EvictingCache(policy, budget=44, buffer=4, seed=2, keep_log=True)
    out = randattn.generate(model, ids, c1, max_new_tokens=56, do_sample=False, output_scores=True, return_dict_in_generate=True)
    c2 = randattn.EvictingCache(policy, budget=44, buffer=4, seed=2, keep_log=True)
    rep = randattn.replay(model, out.sequences, c2, prompt_len=12)
    gen_lp = torch.gather(torch.log_softmax(torch.stack(out.scores, 1).float(), -1), -1, out.sequences[:, 12:, None])[..., 0]
    assert min(c1.events) >= 5
    # generate never feeds its last token, so replay may run one more round at the end
    assert len(c2.keep_log) - len(c1.keep_log) in (0, len(c1.layers))
    for i in range(len(c1.keep_log)):
        assert (c1.keep_log.layers[i], c1.keep_log.rounds[i]) == (c2.keep_log.layers[i], c2.keep_log.rounds[i])
        assert (c1.keep_log.kept[i] == c2.keep_log.kept[i]).all()
    torch.testing.assert_close(gen_lp, rep.logprobs[:, 12:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("policy,window,buffer", [("snapkv", 4, 12), ("rkv", 8, 12), ("vase", 32, 12),
                                                   ("snapkv", 6, 6)])
def test_queries_are_captured_only_where_a_round_reads_them(tiny, monkeypatch, policy, window, buffer):
    """The capture hook skips steps too far from the next round for their queries to be in its window;
    every round must see exactly the queries it sees when every step is captured."""
    model = tiny("llama")
    ids = random_ids(2, 10, seed=3)

    def run(always: bool):
        cache = randattn.EvictingCache(policy, budget=30, buffer=buffer, seed=1, keep_log=True, window=window)
        seen = []
        real = cache._observe_queries
        cache._observe_queries = lambda layer, q, scaling: (seen.append(q.shape[2]), real(layer, q, scaling))
        if always:
            monkeypatch.setattr(cache, "wants_queries", lambda layer, n: True)
        out = randattn.generate(model, ids, cache, max_new_tokens=60, min_new_tokens=60, do_sample=False,
                                output_scores=True, return_dict_in_generate=True)
        return cache, out, len(seen)

    skip, out_skip, n_skip = run(False)
    every, out_every, n_every = run(True)
    assert min(skip.events) >= 3
    assert len(skip.keep_log) == len(every.keep_log)
    assert all((a == b).all() for a, b in zip(skip.keep_log.kept, every.keep_log.kept))
    assert torch.equal(out_skip.sequences, out_every.sequences)
    torch.testing.assert_close(torch.stack(out_skip.scores), torch.stack(out_every.scores), atol=0, rtol=0)
    if window < buffer:  # only then are there steps no round reads
        assert n_skip < n_every
    else:
        assert n_every - n_skip <= len(skip.layers) * (30 + buffer - window)  # only before the first round


# ---------------------------------------------------------------------------------------------
# 4. Prompt protection
# ---------------------------------------------------------------------------------------------


def _prompt_evictions(cache, prompt_len):
    """Number of (round, batch row, head) records from which a prompt position is missing."""
    prompt = torch.arange(prompt_len)
    missing = 0
    for kept in cache.keep_log.kept:
        kept = torch.from_numpy(kept).long()
        for row in kept.reshape(-1, kept.shape[-1]):
            missing += int(not bool(torch.isin(prompt, row).all()))
    for layer in cache.layers:
        for row in layer.positions.reshape(-1, layer.positions.shape[-1]):
            missing += int(not bool(torch.isin(prompt, row).all()))
    return missing


def _run_for_protection(model, ids, policy, protect, prompt_len):
    cache = randattn.EvictingCache(policy, budget=48, buffer=8, keep_log=True, seed=6, protect_prompt=protect)
    randattn.replay(model, ids, cache, prompt_len=prompt_len)
    assert min(cache.events) >= 15
    return _prompt_evictions(cache, prompt_len)


def test_prompt_protection_holds_for_every_policy(tiny):
    model, prompt_len = tiny("llama"), 14
    ids = random_ids(2, 200, seed=8)
    protected = {p: _run_for_protection(model, ids, p, True, prompt_len) for p in POLICIES}
    assert all(n == 0 for n in protected.values()), protected
    # The same check catches evictions when protection is off (attention selectors included).
    unprotected = {p: _run_for_protection(model, ids, p, False, prompt_len) for p in POLICIES}
    assert any(unprotected[p] > 0 for p in SELECTORS), unprotected
    assert unprotected["recency"] > 0, unprotected


# ---------------------------------------------------------------------------------------------
# 5. The embedded model, end to end (slow)
# ---------------------------------------------------------------------------------------------


def _short_prompt(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 23 * 47?"}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_end_to_end_on_the_embedded_model(embedded, policy):
    model, tok = embedded
    ids = _short_prompt(tok)
    prompt_len, budget, buffer, new = ids.shape[1], 64, 16, 100
    # H2O and SnapKV pin 32 recent positions on top of the protected prompt.
    assert prompt_len <= 30
    cache = randattn.EvictingCache(policy, budget=budget, buffer=buffer, seed=0)
    out = randattn.generate(model, ids, cache, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    assert out.shape == (1, prompt_len + new)
    rounds = (prompt_len + new - 1 - budget) // buffer  # pairs written: everything but the last token
    assert rounds >= 3 and cache.events == [rounds] * model.config.num_hidden_layers
    assert cache.physical_length(0) < budget + buffer
    text = tok.decode(out[0, prompt_len:], skip_special_tokens=True)
    assert text.strip(), text
    assert len(set(out[0, prompt_len:].tolist())) >= 5, text  # not one token repeated

    rcache = randattn.EvictingCache(policy, budget=budget, buffer=buffer, seed=0)
    rep = randattn.replay(model, out, rcache, prompt_len=prompt_len)
    assert rcache.events == [(prompt_len + new - budget) // buffer] * model.config.num_hidden_layers
    lp = rep.logprobs[0, 1:]
    assert torch.isfinite(lp).all() and (lp <= 0).all()
    # Replay sees the caches greedy decoding saw, so its greedy prediction is the generated token
    # wherever min_new_tokens did not suppress an end-of-sequence token.
    eos = model.generation_config.eos_token_id
    eos = torch.tensor(eos if isinstance(eos, (list, tuple)) else [eos])
    pred, gen = rep.argmax[0, prompt_len:], out[0, prompt_len:]
    free = ~torch.isin(pred, eos)
    assert free.sum() >= new // 2
    assert torch.equal(pred[free], gen[free]), (free.nonzero()[:, 0][pred[free] != gen[free]], text)


# ---------------------------------------------------------------------------------------------
# 6. Clear errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy,options,message",
    [
        ("snapkv", dict(pooling="median"), "snapkv: pooling must be 'max' or 'avg', got 'median'"),
        ("rkv", dict(pooling="median"), "pooling must be 'max' or 'avg'"),
        ("vase", dict(pooling="sum"), "pooling must be 'max' or 'avg'"),
        ("h2o", dict(aggregate="sum"), r"h2o: aggregate must be one of \('mean', 'max'\), got 'sum'"),
        ("snapkv", dict(aggregate="sum"), "snapkv: aggregate must be one of"),
        ("rkv", dict(aggregate="sum"), "aggregate must be one of"),
        ("vase", dict(aggregate="sum"), "aggregate must be one of"),
        ("rkv", dict(lam=2), r"rkv: lam must be in \[0, 1\], got 2"),
        ("rkv", dict(lam=-0.1), r"rkv: lam must be in \[0, 1\]"),
        ("rkv", dict(threshold=1.5), r"rkv: threshold is a cosine similarity in \[-1, 1\]"),
        ("snapkv", dict(window=0), "snapkv: window must be a positive integer, got 0"),
        ("snapkv", dict(kernel=2.5), "snapkv: kernel must be a positive integer, got 2.5"),
        ("snapkv", dict(window=True), "snapkv: window must be a positive integer, got True"),
        ("rkv", dict(window=-1), "window must be a positive integer"),
        ("h2o", dict(recent_fraction=1.0), r"h2o: recent_fraction must be in \[0, 1\)"),
        ("h2o", dict(recent_fraction=-0.5), r"h2o: recent_fraction must be in \[0, 1\)"),
        ("vase", dict(n_top=0), "vase: n_top must be a positive integer, got 0"),
        ("vase", dict(n_sink=-1), "vase: n_sink must be a non-negative integer, got -1"),
        ("h2o", dict(kernel=3), r"policy 'h2o' does not take option\(s\) \['kernel'\]"),
        ("snapkv", dict(lam=0.5), r"policy 'snapkv' does not take option\(s\) \['lam'\]; it accepts"),
    ],
)
def test_bad_options_are_clear_errors(policy, options, message):
    with pytest.raises(ValueError, match=message):
        randattn.EvictingCache(policy, budget=8, **options)


def test_pins_beyond_the_budget_are_a_clear_error(tiny):
    """SnapKV's window (32) plus the protected prompt cannot fit K=24: said at the first round."""
    model = tiny("llama")
    with pytest.raises(ValueError, match=r"pairs are pinned .*the policy's own pins.* K=24"):
        randattn.replay(model, random_ids(1, 60), randattn.EvictingCache("snapkv", budget=24, buffer=4), prompt_len=4)


def _raw_model():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("policy", SELECTORS)
def test_raw_model_without_capture_hooks_says_what_is_missing(policy):
    model = _raw_model()
    ids = random_ids(1, 40, seed=3)  # a prefill of K + r pairs runs a round in the first forward
    cache = randattn.EvictingCache(policy, budget=32, buffer=8, protect_prompt=False)
    message = "no queries were captured" if policy == "h2o" else "needs the recent queries"
    with pytest.raises(RuntimeError, match=message) as err:
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
    assert "install_guards" in str(err.value)
    # It is the missing hooks: the same call works once they are installed.
    randattn.install_guards(model)
    cache = randattn.EvictingCache(policy, budget=32, buffer=8, protect_prompt=False)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    assert cache.events == [1, 1] and cache.physical_length(0) == 32
