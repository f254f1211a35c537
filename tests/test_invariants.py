"""Cache invariants under randomised shapes, budgets, seeds and chunkings, driven without a model."""

import math
import random

import pytest
import torch

import randattn
import randattn.keepstats


def _feed(cache, layer, n, b, h, d=3):
    """Append n tokens whose keys/values encode their absolute position (to check gathers)."""
    start = cache.get_seq_length(layer) if layer < len(cache.layers) else 0
    pos = torch.arange(start, start + n, dtype=torch.float32)
    k = pos.view(1, 1, n, 1).expand(b, h, n, d).clone()
    v = -k
    return cache.update(k, v, layer)


@pytest.mark.parametrize("trial", range(25))
def test_invariants_hold_for_random_configurations(trial):
    rng = random.Random(trial)
    b, h, layers = rng.randint(1, 3), rng.randint(1, 5), rng.randint(1, 3)
    budget, buffer = rng.randint(2, 40), rng.randint(1, 12)
    recent = rng.choice([0, min(buffer, budget // 2), rng.randint(0, budget // 2)])
    protect = rng.random() < 0.6 and budget - recent >= 6
    prompt = rng.randint(1, budget - recent - 1) if protect else rng.randint(1, 3 * budget)
    policy = rng.choice(["random", "random-shared", "recency", "streamingllm", "random-block"])
    cache = randattn.EvictingCache(policy, budget=budget, buffer=buffer, recent=recent, protect_prompt=protect,
                                   seed=trial)
    chunks = [prompt] + [rng.choice([1, 1, 1, rng.randint(1, buffer)]) for _ in range(rng.randint(20, 80))]
    previous = [None] * layers
    for n in chunks:
        before = [cache.events[l] if l < len(cache.layers) else 0 for l in range(layers)]
        for l in range(layers):
            full_k, _ = _feed(cache, l, n, b, h)
            assert full_k.shape[-2] <= max(budget + buffer, prompt) + (n - 1 if n > 1 else 0)
            layer = cache.layers[l]
            pos, keys, vals = layer.positions, layer.keys, layer.values
            ran_round = cache.events[l] > before[l]
            # physical bound and exactly K after a round
            assert pos.shape[-1] <= budget + buffer - 1
            if ran_round:
                assert pos.shape[-1] == budget
                assert layer.round_lengths[-1] == layer.seq_len  # the round's sequence length is recorded
                # the recent window: every head still holds the newest `recent` positions of the round
                newest = torch.arange(layer.seq_len - recent, layer.seq_len)
                assert bool((pos[..., budget - recent:] == newest).all())
            assert len(layer.round_lengths) == layer.rounds
            # chronological, no duplicates
            assert bool((pos[..., 1:] > pos[..., :-1]).all())
            # keys and values moved with their positions
            assert torch.equal(keys[..., 0], pos.float()) and torch.equal(vals[..., 0], -pos.float())
            # monotonic: nothing evicted ever comes back
            if previous[l] is not None:
                old_max = previous[l].max().item() if previous[l].numel() else -1
                for bi in range(b):
                    for hi in range(h):
                        old = set(previous[l][bi, hi].tolist())
                        now = set(pos[bi, hi].tolist())
                        assert {p for p in now if p <= old_max} <= old
            previous[l] = pos.clone()
            # protected prompt never evicted
            if protect:
                assert bool((pos[..., :prompt] == torch.arange(prompt)).all())
    assert cache.get_seq_length() == sum(chunks)


@pytest.mark.parametrize("protect", [False, True])
@pytest.mark.parametrize("recent", [0, 16, 5])
def test_random_survival_matches_analytic_curve(protect, recent):
    """Per-head survival of a pair after competing in n rounds is q^n with
    q = (T - recent - lp) / (T + r - recent - lp) (lp = 0 unprotected): the paper's (T - r - lp) / (T - lp)
    at recent = r, the all-compete (T - lp) / (T + r - lp) at recent = 0. Tolerance: 4 binomial standard
    errors + 0.01 at every n."""
    b, h, budget, buffer, prompt = 4, 8, 48, 16, 8
    cache = randattn.EvictingCache("random", budget=budget, buffer=buffer, recent=recent, protect_prompt=protect,
                                   seed=123)
    _feed(cache, 0, prompt, b, h)
    n_rounds = 14
    while cache.events[0] < n_rounds:
        _feed(cache, 0, 1, b, h)
    pos = cache.layers[0].positions
    pinned = prompt if protect else 0
    p = (budget - recent - pinned) / (budget + buffer - recent - pinned)
    assert p == pytest.approx(randattn.keepstats.random_round_survival(budget, buffer, prompt, protect, recent=recent))
    # Positions written between round j-1 and round j compete first at round j, unless still among the newest
    # `recent` then (recent >= r here means a whole cohort sits out round j).
    round_ends = [budget + buffer + j * buffer for j in range(n_rounds)]  # seq_len at each round
    checked = 0
    for j in range(3, n_rounds - 1):  # the first rounds mix in prompt/early-prefill cohorts
        lo, hi = round_ends[j - 1], round_ends[j]
        # split the cohort by whether it competed at round j (older than the newest `recent` of that round)
        for cohort, n in ((torch.arange(lo, min(hi, hi - recent)), n_rounds - j),
                          (torch.arange(max(lo, hi - recent), hi), n_rounds - j - 1)):
            if cohort.numel() == 0:
                continue
            survived = torch.isin(pos, cohort).sum().item()
            total = b * h * len(cohort)
            expected = p**n
            se = math.sqrt(expected * (1 - expected) / total)
            assert abs(survived / total - expected) <= 4 * se + 0.01, (n, survived / total, expected)
            checked += 1
    assert checked >= 10


def test_recency_is_not_random_the_survival_test_can_fail():
    b, h, budget, buffer = 2, 4, 48, 16
    cache = randattn.EvictingCache("recency", budget=budget, buffer=buffer, protect_prompt=False)
    _feed(cache, 0, 8, b, h)
    while cache.events[0] < 6:
        _feed(cache, 0, 1, b, h)
    pos = cache.layers[0].positions
    # A recency window keeps exactly the last K positions: survival is 1 then 0, not geometric.
    newest = cache.get_seq_length()
    assert torch.equal(pos[0, 0], torch.arange(newest - budget, newest))


def _keep_sets(seed, policy="random"):
    cache = randattn.EvictingCache(policy, budget=16, buffer=4, seed=seed, keep_log=True)
    for l in range(2):
        _feed(cache, l, 5, 2, 3)
    for _ in range(40):
        for l in range(2):
            _feed(cache, l, 1, 2, 3)
    return cache


def test_determinism_same_seed_same_keep_sets_and_draws_differ_across_layers_rounds_seeds():
    a, b, c = _keep_sets(0), _keep_sets(0), _keep_sets(1)
    assert len(a.keep_log) == len(b.keep_log) > 10
    assert all((x == y).all() for x, y in zip(a.keep_log.kept, b.keep_log.kept))
    assert any((x != y).any() for x, y in zip(a.keep_log.kept, c.keep_log.kept))
    l0, l1 = a.keep_log.for_layer(0), a.keep_log.for_layer(1)
    assert any((x[2] != y[2]).any() for x, y in zip(l0, l1)), "layers must draw differently"
    seeds = {randattn.round_seed(0, l, r) for l in range(4) for r in range(50)}
    assert len(seeds) == 200
    # the same round index in different layers, and consecutive rounds, use different draws
    assert (a.layers[0].positions != a.layers[1].positions).any()


def test_random_shared_keeps_the_same_set_in_every_head():
    cache = _keep_sets(0, "random-shared")
    pos = cache.layers[0].positions
    assert all(torch.equal(pos[:, 0], pos[:, hh]) for hh in range(pos.shape[1]))
    per_head = _keep_sets(0, "random").layers[0].positions
    assert not all(torch.equal(per_head[:, 0], per_head[:, hh]) for hh in range(per_head.shape[1]))


def test_keep_log_round_trips_through_npz(tmp_path):
    cache = _keep_sets(3)
    path = tmp_path / "keep.npz"
    cache.keep_log.save(path)
    back = randattn.KeepLog.load(path)
    assert back.layers == cache.keep_log.layers and back.seq_lens == cache.keep_log.seq_lens
    assert all((x == y).all() for x, y in zip(back.kept, cache.keep_log.kept))


@pytest.mark.parametrize("block", [1, 3, 8, 32])
def test_random_block_by_position_keeps_contiguous_suffixes_of_blocks(block):
    budget, buffer, b, h = 32, 8, 2, 3
    cache = randattn.EvictingCache("random-block", budget=budget, buffer=buffer, protect_prompt=False, seed=block,
                                   block=block, align="position")
    blocks_seen = set()
    for step in range(300):
        _feed(cache, 0, 1, b, h)
        seq = cache.get_seq_length(0)
        pos = cache.positions(0)
        for row in range(b):
            for head in range(h):
                kept = pos[row, head].tolist()
                by_block = {}
                for p in kept:
                    by_block.setdefault(p // block, []).append(p)
                blocks_seen.add(len(by_block))
                for j, ps in by_block.items():
                    end = min((j + 1) * block, seq) - 1  # what survives of a block is its newest part
                    assert ps == list(range(end - len(ps) + 1, end + 1)), (block, j, ps)
    assert cache.events[0] > 20
    if block >= 8:  # a head holds about K / block blocks (plus at most a few partial ones)
        assert min(blocks_seen) <= budget // block + 2


def test_select_keep_is_top_keep_per_head_pins_first_then_the_recent_window():
    from randattn.cache import select_keep
    scores = torch.tensor([[[5.0, 1.0, 4.0, 3.0, 2.0, 0.0]]])
    pinned = torch.tensor([[[False, True, False, False, False, False]]])
    evicted = torch.tensor([[[True, False, False, False, False, False]]])
    kept = select_keep(scores, keep=3, recent=2, pinned=pinned, evicted=evicted)
    assert kept.tolist() == [[[1, 2, 3, 6, 7]]]  # pinned 1, best unpinned 2 and 3 (0 force-evicted), slots 6-7
    with pytest.raises(ValueError, match="2 pairs are pinned .* keeps only T - recent = 1"):
        select_keep(scores, keep=1, recent=0, pinned=pinned | evicted)


def test_restore_layer_then_run_round_keeps_budget_and_counts_the_round():
    cache = randattn.EvictingCache("random", budget=8, buffer=4, seed=0)
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 12, 4, generator=g), torch.randn(1, 2, 12, 4, generator=g)
    layer = cache.restore_layer(1, keys=keys, values=values, positions=torch.arange(12).expand(1, 2, 12), seq_len=12)
    assert len(cache.layers) == 2 and cache.layers[1] is layer and not cache.layers[0].is_initialized
    cache.run_round(layer)
    assert layer.physical_length == 8 and layer.rounds == 1 and cache.events == [0, 1]
    assert layer.positions[0, :, -cache.recent:].tolist() == [list(range(12 - cache.recent, 12))] * 2


@pytest.mark.parametrize("grad", [False, True])
def test_a_round_keeps_exactly_the_selected_pairs_with_room_for_the_next_buffer(grad):
    """keep_slots gathers into fresh K + r buffers (no-grad path) or through autograd (keys that require grad): both
    hold the gathered pairs, and the next r writes need no allocation; with grad, gradients reach the kept slots only."""
    cache = randattn.EvictingCache("random", budget=8, buffer=4, seed=3)
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 2, 12, 4, generator=g).requires_grad_(grad)
    values = torch.randn(2, 2, 12, 4, generator=g)
    layer = cache.restore_layer(0, keys=keys, values=values, positions=torch.arange(12).expand(2, 2, 12), seq_len=12)
    kept = cache.select(layer)
    old_buffer = layer._buf["keys"]
    layer.keep_slots(kept)
    idx = kept[..., None].expand(-1, -1, -1, 4)
    assert torch.equal(layer.keys, torch.gather(keys, 2, idx)) and torch.equal(layer.values, torch.gather(values, 2, idx))
    assert torch.equal(layer.positions, kept) and layer._buf["keys"] is not old_buffer
    assert layer._buf["keys"].shape[2] == 12 and layer.keys.requires_grad == grad
    if grad:
        layer.keys.sum().backward()
        expect = torch.zeros_like(keys).scatter_(2, idx, 1.0)
        assert torch.equal(keys.grad, expect)
