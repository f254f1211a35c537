"""The attention-based selectors in randattn/selectors.py: what tests/test_conformance.py does not cover.

The paper's selectors (snapkv, rkv, rkv-official, vase) are checked against an independent reference of the
paper's engine in tests/test_conformance.py. Here:

1. H2O (not in the paper's grid) and SnapKV's LongBench variant against slow references written from their
   docstrings (plain loops, float64, nothing from randattn.selectors), on random hand-built ``CacheView``s.
2. Behaviour on hand-built caches: H2O keeps the heavy hitters, SnapKV what the recent queries look at, R-KV
   drops copies of identical keys, VaSE keeps its value-range top set and sinks.
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

SELECTORS = ["h2o", "snapkv", "snapkv-longbench", "rkv", "rkv-official", "vase"]
# triattention needs calibration statistics and is tested in tests/test_triattention.py.
POLICIES = [p for p in randattn.known_policies() if p != "triattention"]
# Policies defined with one protection mode (they protect the prompt, or part of it, themselves).
EITHER_MODE = [p for p in POLICIES if randattn.make_policy(p).native_protection is None]


def test_selectors_are_registered():
    assert set(SELECTORS) <= set(POLICIES)


# ---------------------------------------------------------------------------------------------
# 1. Slow references from the docstring formulas
# ---------------------------------------------------------------------------------------------

INF = float("inf")


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




def ref_snapkv_longbench(view, window=32, kernel=7):
    """Per query head: mean over the last ``window`` queries of softmax(q . k / sqrt(D)) over the slots a query
    sees (SnapKV sums; the same ranking); max-pooled over ``kernel`` neighbouring slots; mean over the KV head's group; the last ``window``
    positions pinned."""
    q, k = view.queries.double()[:, :, -window:], view.keys.double()
    qpos = view.query_positions[-window:].tolist()
    pos = view.positions.tolist()
    n_b, n_hq, n_w, n_d = q.shape
    n_h, n_s = k.shape[1], k.shape[2]
    group = n_hq // n_h
    scores = []
    for b in range(n_b):
        heads = []
        for h in range(n_h):
            per_q = []
            for g in range(h * group, (h + 1) * group):
                total = [0.0] * n_s
                for t in range(n_w):
                    seen = [j for j in range(n_s) if pos[b][h][j] <= qpos[t]]
                    if not seen:
                        continue
                    logits = [float(q[b, g, t] @ k[b, h, j]) / math.sqrt(n_d) for j in seen]
                    top = max(logits)
                    z = sum(math.exp(x - top) for x in logits)
                    for j, x in zip(seen, logits):
                        total[j] += math.exp(x - top) / z / n_w
                half = kernel // 2
                per_q.append([max(total[i] for i in range(max(0, j - half), min(n_s, j + half + 1)))
                              for j in range(n_s)])
            heads.append([sum(col) / group for col in zip(*per_q)])
        scores.append(heads)
    return _ref_pin_recent(scores, view, window)


@pytest.mark.parametrize("seed,group", [(0, 2), (1, 1), (2, 3)])
def test_snapkv_longbench_matches_reference(seed, group):
    view = random_view(seed, group=group, slots=40, window=36, new=36, budget=30)
    policy = randattn.make_policy("snapkv-longbench")
    _check(policy, view, ref_snapkv_longbench(view))


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
    cache = randattn.EvictingCache("h2o", budget=budget, buffer=buffer, recent=0, protect_prompt=False, prompt_len=1)
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
        "snapkv", budget=window + 2, buffer=total - window - 2, recent=0, protect_prompt=False, prompt_len=1,
        window=window, kernel=1, keep_window=True,
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
        "snapkv", budget=window + 7, buffer=total - window - 7, recent=0, protect_prompt=False, prompt_len=1,
        window=window, kernel=7, pooling="max", keep_window=True,
    )
    _drive(cache, keys, values, queries)
    assert _kept(cache)[0] == [set(range(7, 14)) | last, set(range(22, 29)) | last]


def test_rkv_official_drops_the_older_copies_of_identical_keys():
    """Everything else equal (orthogonal keys, uniform attention), the R-KV authors' redundancy spares the newest
    of three identical keys and evicts the two older copies; the paper's attn_rkv penalises every copy alike."""
    total, dim = 22, 24
    keys = torch.eye(dim)[:total].expand(1, 2, total, dim).clone()
    copies = (4, 9, 15)
    keys[0, 0, list(copies)] = keys[0, 0, copies[-1]].clone()  # head 0: identical keys at `copies`
    keys[0, 1, [2, 3]] = keys[0, 1, 3].clone()  # head 1: a pair
    queries = torch.zeros(1, 4, total, dim)  # uniform attention: importance equal for every old slot
    values = torch.randn(1, 2, total, dim)
    cache = randattn.EvictingCache("rkv-official", budget=total - 2, buffer=2, recent=0, protect_prompt=False,
                                   prompt_len=1)
    _drive(cache, keys, values, queries)
    assert cache.events == [1]
    kept = _kept(cache)[0]
    assert kept[0] == set(range(total)) - {4, 9}
    from randattn.selectors import cosine_redundancy

    red = cosine_redundancy(keys)[0, 1]  # the paper's attn_rkv: both copies alike, above every other key
    assert red[2] == red[3] and red[2] > red[torch.arange(total) > 3].max()


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
            "vase", budget=budget, buffer=total - budget, recent=0, protect_prompt=False, prompt_len=1, seed=seed,
            n_top=len(big) + 4, n_sink=4, window=window, kernel=1,  # the 4 sinks are in the top set
        )
        _drive(cache, keys, values, queries)
        assert cache.events == [1]
        for kept in _kept(cache)[0]:
            assert set(big) | {0, 1, 2, 3} | {looked_at} <= kept
            union |= kept
    # The other places are sampled: different seeds fill them differently.
    assert len(union) > budget


def test_vase_without_sinks_survives_a_query_whose_keys_were_all_evicted():
    """VaSE does not pin its observation window, so with n_sink=0, no prompt protection and no recent window
    (recent=0) a recent query can find its own key and every older one evicted (budget < window - buffer). Its
    masked softmax would be all NaN; such a query has nothing left to attend to and must contribute
    nothing (and the scores stay finite)."""
    g = torch.Generator().manual_seed(0)
    cache = randattn.EvictingCache(
        "vase", budget=4, buffer=4, recent=0, protect_prompt=False, prompt_len=1, seed=0, n_sink=0, window=32
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
    protected = {p: _run_for_protection(model, ids, p, True, prompt_len) for p in EITHER_MODE + ["random-ppp"]}
    assert all(n == 0 for n in protected.values()), protected
    # The same check catches evictions when protection is off (attention selectors included).
    unprotected = {p: _run_for_protection(model, ids, p, False, prompt_len) for p in EITHER_MODE}
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
        ("rkv-official", dict(threshold=1.5), r"rkv-official: threshold is a cosine similarity in \[-1, 1\]"),
        ("rkv-official", dict(lam=3), r"rkv-official: lam must be in \[0, 1\]"),
        ("random-block", dict(align="token"), "align must be 'slot'"),
        ("random-pmix", dict(p=1.5), "p must be a probability"),
        ("random-pcap", dict(cap=-1), "cap must be a non-negative int"),
        ("triattention", dict(stats="smollm2-135m", shared_layers="yes"), "shared_layers must be True or False"),
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
        randattn.EvictingCache(policy, budget=8, buffer=4, **options)


def test_pins_beyond_the_budget_are_a_clear_error(tiny):
    """SnapKV-LongBench's window (32, of which 28 are candidates beside the recent 4) plus the protected prompt
    cannot fit T - r = 20: said at the first round."""
    model = tiny("llama")
    with pytest.raises(ValueError, match=r"pairs are pinned .*the policy's own pins.* T - recent = 20"):
        randattn.replay(model, random_ids(1, 60), randattn.EvictingCache("snapkv-longbench", budget=24, buffer=4),
                        prompt_len=4)


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


@pytest.mark.parametrize("policy", POLICIES)
def test_uses_seed_is_declared_truthfully(tiny, policy):
    """Probes run a policy declaring ``uses_seed = False`` once per configuration: its keep-sets (and outputs) must
    then be the same for every seed, and a policy declaring True must really vary with it."""
    model = tiny("llama")
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    options = {"random-pcap": {"cap": 4}, "random-pmix": {"small": 4}}.get(policy, {})

    def kept(seed):
        cache = randattn.EvictingCache(policy, budget=48, buffer=8, seed=seed, **options)
        out = randattn.generate(model, ids, cache, max_new_tokens=60, do_sample=False, pad_token_id=0)
        assert cache.total_events > 0
        return out, [cache.positions(i) for i in range(len(cache.layers))]

    (out0, pos0), (out1, pos1) = kept(0), kept(1)
    same = torch.equal(out0, out1) and all(torch.equal(a, b) for a, b in zip(pos0, pos1))
    assert same is not randattn.make_policy(policy, **options).uses_seed
