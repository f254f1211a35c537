"""Replay that stops, forks and goes on; scoring only from a position on."""

import pytest
import torch

import randattn
from conftest import random_ids


def _cache(**kw):
    return randattn.EvictingCache("random", budget=12, buffer=4, protect_prompt=False, seed=3, keep_log=True, **kw)


def test_score_from_skips_the_head_but_changes_nothing_after(tiny):
    model = tiny("llama")
    ids = random_ids(2, 60, seed=1)
    full = randattn.replay(model, ids, _cache(), prompt_len=5)
    part = randattn.replay(model, ids, _cache(), prompt_len=5, score_from=41)
    assert torch.isnan(part.logprobs[:, :41]).all()
    torch.testing.assert_close(part.logprobs[:, 41:], full.logprobs[:, 41:], atol=1e-6, rtol=0)
    assert torch.equal(part.argmax[:, 41:], full.argmax[:, 41:])
    torch.testing.assert_close(part.last_logits, full.last_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("until", [5, 17, 30, 60])
def test_stop_fork_and_continue_equals_one_straight_run(tiny, until):
    model = tiny("qwen3")
    ids = random_ids(2, 60, seed=2)
    straight_cache = _cache()
    straight = randattn.replay(model, ids, straight_cache, prompt_len=5)
    base = randattn.Replay(model, ids, _cache(), prompt_len=5).run(until=until)
    branch = base.fork()
    a, b = branch.run().result(), base.run().result()
    for res in (a, b):
        torch.testing.assert_close(res.logprobs[:, 1:], straight.logprobs[:, 1:], atol=1e-6, rtol=0)
    assert branch.cache.events == straight_cache.events


def test_keep_masks_on_a_fork_stay_on_that_fork(tiny):
    model = tiny("llama")
    ids = random_ids(1, 70, seed=4)
    base = randattn.Replay(model, ids, _cache(), prompt_len=5).run(until=20)
    pinned = base.fork()
    pinned.cache.pin(range(20, 24), heads=[1])
    plain = base.fork()
    pinned.run(), plain.run()
    for layer in range(len(pinned.cache.layers)):
        assert torch.isin(torch.arange(20, 24), pinned.cache.positions(layer)[0, 1]).all()
    kept_plain = [torch.isin(torch.arange(20, 24), plain.cache.positions(l)[0, 1]).all() for l in range(2)]
    assert not all(kept_plain), "the pin leaked into the other fork"
    assert pinned.cache.keep_log is not plain.cache.keep_log


def test_run_until_outside_the_sequence_is_refused(tiny):
    model = tiny("llama")
    r = randattn.Replay(model, random_ids(1, 30), _cache(), prompt_len=5).run(until=10)
    with pytest.raises(ValueError, match="until"):
        r.run(until=8)
    with pytest.raises(ValueError, match="until"):
        r.run(until=31)


def test_a_fork_shares_the_model_instead_of_copying_it(tiny):
    model = tiny("llama")
    base = randattn.Replay(model, random_ids(1, 30), _cache(), prompt_len=5).run(until=20)
    branch = base.fork()
    assert branch.model is model and branch.cache._bound_model is model
    assert branch.cache is not base.cache and branch.cache.layers[0].keys is not base.cache.layers[0].keys
