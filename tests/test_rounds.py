"""The round engine (randattn.rounds): its schedule is where an EvictingCache's rounds really fire, and its public
``RoundEngine.select`` called on a layer's own tensors keeps exactly what the cache's round keeps."""

import pytest
import torch

from randattn import EvictingCache
from randattn import rounds
from randattn.rounds import Held


def _step(cache, g, n, h=2, hq=4, d=8):
    keys, values = torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g)
    if cache.needs_queries:
        cache._observe_queries(0, torch.randn(1, hq, n, d, generator=g), d ** -0.5)
    cache.update(keys, values, 0)


@pytest.mark.parametrize("budget,buffer,prompt_len,protect", [
    (32, 8, 5, True), (32, 8, 23, True), (32, 8, 39, False), (32, 8, 40, False), (32, 8, 57, False),
    (20, 6, 13, True), (20, 6, 1, False), (24, 5, 29, False), (24, 5, 30, False), (17, 3, 2, True)])
def test_the_schedule_is_where_the_cache_rounds(budget, buffer, prompt_len, protect):
    cache = EvictingCache("random", budget=budget, buffer=buffer, protect_prompt=protect)
    g = torch.Generator().manual_seed(0)
    _step(cache, g, prompt_len)
    layer = cache.layers[0]
    most, upto = prompt_len, prompt_len + 7 * buffer + 3
    for n in range(prompt_len, upto):
        assert layer.physical_length == rounds.held_pairs(prompt_len, n, budget, buffer), n
        assert cache.engine.due(layer.physical_length + 1) == (n + 1 in rounds.round_lengths(prompt_len, budget,
                                                                                               buffer, upto)), n
        most = max(most, layer.physical_length + 1)
        _step(cache, g, 1)
    assert layer.round_lengths == rounds.round_lengths(prompt_len, budget, buffer, upto)
    assert layer.round_lengths[0] == rounds.first_round(prompt_len, budget, buffer)
    assert most == rounds.max_held_pairs(prompt_len, budget, buffer)
    for c in range(upto):
        later = [x for x in rounds.round_lengths(prompt_len, budget, buffer, upto + 2 * buffer) if x > c]
        assert rounds.next_round_length(prompt_len, c, budget, buffer) == later[0]


def test_the_vllm_arithmetic_is_the_engines():
    vcfg = pytest.importorskip("randattn.vllm.config")
    cfg = vcfg.EngineConfig(spec=__import__("randattn").EvictionSpec("random", budget=32, buffer=8))
    for p in (3, 31, 40, 41, 77):
        assert vcfg.round_lengths(p, cfg, 200) == rounds.round_lengths(p, 32, 8, 200)
        assert vcfg.max_held_pairs(p, cfg) == rounds.max_held_pairs(p, 32, 8)
        for c in range(0, 120, 7):
            assert vcfg.held_pairs(p, c, cfg) == rounds.held_pairs(p, c, 32, 8)
            assert vcfg.next_round_length(p, c, cfg) == rounds.next_round_length(p, c, 32, 8)


def _rounds_with_direct_calls(policy, *, row_keys=None, protect=None, pins=False, steps=40, **kw):
    """Drive a cache and, at every round, call the engine directly on the layer's tensors (a Held built by hand,
    as the vLLM plugin builds one); return (what the cache kept, what the direct call kept) per round."""
    cache = EvictingCache(policy, budget=16, buffer=4, seed=5, row_keys=row_keys, protect_prompt=protect, **kw)
    if pins:
        cache.pin([9, 10], heads=[1])
        cache.force_evict([14])
    layer_seen = []
    orig_keep_slots = None

    def capture(kept):
        lay = cache.layers[0]
        held = Held(layer_idx=0, keys=lay.keys.clone(), values=lay.values.clone(), positions=lay.positions.clone(),
                    seq_len=lay.seq_len, round_idx=lay.rounds, prompt_len=cache.prompt_len,
                    row_key=None if row_keys is None else cache.row_keys[0],
                    queries=None if lay.recent_queries is None else lay.recent_queries.clone(),
                    query_positions=None if lay.recent_query_positions is None else lay.recent_query_positions.clone(),
                    scaling=lay.scaling, attention=None if lay.attention is None else lay.attention.clone())
        layer_seen.append((kept.clone(), held))
        orig_keep_slots(kept)

    g = torch.Generator().manual_seed(1)
    _step(cache, g, 6)
    orig_keep_slots = cache.layers[0].keep_slots
    cache.layers[0].keep_slots = capture
    for _ in range(steps):
        _step(cache, g, 1)
    assert len(layer_seen) == cache.layers[0].rounds >= 5
    return cache, [(kept, cache.engine.select(held, cache._rules), held) for kept, held in layer_seen]


@pytest.mark.parametrize("policy,kw", [("random", {}), ("random", {"row_keys": ["req-1"]}), ("snapkv", {}),
                                       ("h2o", {}), ("random", {"pins": True}), ("recency", {"protect": False}),
                                       ("rkv", {"row_keys": [11]})])
def test_the_public_round_keeps_what_the_cache_keeps(policy, kw):
    cache, seen = _rounds_with_direct_calls(policy, **kw)
    for kept, direct, _ in seen:
        assert torch.equal(kept, direct)
        assert kept.shape[-1] == cache.budget


def test_the_round_index_and_row_key_change_a_random_draw():
    # The comparison above must be able to fail: the same held slots at another round or under another key differ.
    cache, seen = _rounds_with_direct_calls("random", protect=False)
    kept, _, held = seen[-1]
    other = Held(**{**held.__dict__, "round_idx": held.round_idx + 1})
    keyed = Held(**{**held.__dict__, "row_key": 12345})
    assert not torch.equal(cache.engine.select(other), kept)
    assert not torch.equal(cache.engine.select(keyed), kept)


def test_a_cross_layer_policy_needs_every_layers_view():
    engine = rounds.RoundEngine(type("P", (), {"name": "shared", "scope": "model", "needs": ()})(), budget=8,
                                buffer=2, recent=2, protect_prompt=False, seed=0)
    held = Held(layer_idx=0, keys=torch.zeros(1, 1, 10, 2), values=torch.zeros(1, 1, 10, 2),
                positions=torch.arange(10).view(1, 1, 10), seq_len=10, round_idx=0, prompt_len=0)
    with pytest.raises(ValueError, match="scores all layers at once"):
        engine.select(held)


def test_the_vllm_plugin_calls_the_public_engine():
    import inspect

    import randattn.vllm.state as state

    src = inspect.getsource(state)
    assert "engine.select(" in src and "_select_view" not in src and "_RoundLayer" not in src
