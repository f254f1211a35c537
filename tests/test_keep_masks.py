"""The explicit keep-mask API: pins and forced evictions in chosen (layer, KV head) sets."""

import pytest
import torch

import randattn

from test_invariants import _feed


def _run(cache, layers=2, b=1, h=3, steps=120, prompt=4):
    for l in range(layers):
        _feed(cache, l, prompt, b, h)
    for _ in range(steps):
        for l in range(layers):
            _feed(cache, l, 1, b, h)
    return cache


def test_pin_in_one_head_of_one_layer_survives_only_there():
    cache = randattn.EvictingCache("random", budget=12, buffer=4, protect_prompt=False, seed=0)
    cache.pin([5, 6], layers=[1], heads=[2])
    _run(cache)
    for l in range(2):
        pos = cache.positions(l)[0]
        for hh in range(3):
            held = torch.isin(torch.tensor([5, 6]), pos[hh]).all().item()
            assert held == (l == 1 and hh == 2), (l, hh)


def test_force_evict_removes_positions_at_the_next_round_even_from_the_prompt():
    cache = randattn.EvictingCache("recency", budget=30, buffer=4, protect_prompt=True, seed=0)
    cache.force_evict([1, 2], heads=[0])
    _run(cache, prompt=6, steps=40)
    for l in range(2):
        pos = cache.positions(l)[0]
        assert not torch.isin(torch.tensor([1, 2]), pos[0]).any()
        assert torch.isin(torch.arange(6), pos[1]).all()  # other heads keep the protected prompt


def test_too_many_pins_is_a_clear_error():
    cache = randattn.EvictingCache("random", budget=8, buffer=4, protect_prompt=False)
    cache.pin(range(10))
    with pytest.raises(ValueError, match="pinned .* a round keeps only T - recent = 4"):
        _run(cache, steps=20)


def test_forcing_more_evictions_than_a_round_drops_is_a_clear_error():
    cache = randattn.EvictingCache("random", budget=8, buffer=2, protect_prompt=False)
    cache.force_evict(range(0, 6))
    with pytest.raises(ValueError, match="force-evicted positions exceed"):
        _run(cache, steps=20)


def test_bad_keep_mask_arguments():
    cache = randattn.EvictingCache("random", budget=8, buffer=2)
    with pytest.raises(ValueError, match="absolute token positions"):
        cache.pin([-1])
    with pytest.raises(ValueError, match="heads must be non-negative"):
        cache.pin([1], heads=[-2])
    cache.pin([1], heads=[7])
    with pytest.raises(ValueError, match="out of range: the model has 3 KV heads"):
        _run(cache, steps=20)
