"""Inputs the core used to run with a silently wrong result, or stop on with a traceback from deep inside torch or
transformers, now refused with an error naming the parameter (issue 29, items 2-7)."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch

import randattn
from randattn.testing import tiny_model

from conftest import random_ids


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _cache(policy="random", **kw):
    return randattn.EvictingCache(policy, budget=16, buffer=4, **kw)


# -- item 2: use_cache=False, and a second cache keyword ------------------------------------------------------------
def test_generate_refuses_use_cache_false(model):
    """Without the cache, generate re-feeds the whole sequence each step: no eviction ran, yet the result looked
    like an evicting run."""
    for call in (lambda c: randattn.generate(model, random_ids(1, 8), c, max_new_tokens=4, use_cache=False),
                 lambda c: model.generate(random_ids(1, 8), past_key_values=c, max_new_tokens=4, use_cache=False),
                 lambda c: model(random_ids(1, 8), past_key_values=c, use_cache=False)):
        cache = _cache()
        with pytest.raises(ValueError, match="use_cache=False"):
            call(cache)
        assert cache.get_seq_length() == 0


def test_a_second_cache_keyword_is_refused(model):
    with pytest.raises(ValueError, match="past_key_values= beside cache="):
        randattn.generate(model, random_ids(1, 8), _cache(), max_new_tokens=4, past_key_values=_cache())
    with pytest.raises(ValueError, match="past_key_values= beside cache="):
        model.generate(random_ids(1, 8), past_key_values=_cache(), cache=_cache(), max_new_tokens=4)


def test_a_cache_keyword_the_forward_lacks_is_refused(model):
    """The forward would take it into **kwargs, ignore it and decode through a cache of its own: no eviction."""
    name = randattn.cache_argument_name(model)
    other = "cache" if name == "past_key_values" else "past_key_values"
    if other in inspect.signature(model.forward).parameters:
        pytest.skip(f"this transformers version's forward takes both {name}= and {other}=")
    cache = _cache()
    with pytest.raises(ValueError, match=f"{other}=: this transformers version takes the cache as {name}="):
        model(random_ids(1, 8), **{other: cache})
    assert cache.get_seq_length() == 0


# -- item 3: keep-mask positions -------------------------------------------------------------------------------------
@pytest.mark.parametrize("positions, shown", [([1.7], "1.7"), ([3, True], "True"), (torch.tensor([2.5]), "float32"),
                                              (torch.tensor([True]), "bool"), ([float("nan")], "nan")])
def test_pin_refuses_non_integer_positions(positions, shown):
    cache = _cache()
    for register in (cache.pin, cache.force_evict):
        with pytest.raises(ValueError, match="positions must be integer token positions") as err:
            register(positions)
        assert shown in str(err.value)
    assert not cache._rules


def test_pin_still_takes_integers_of_every_kind():
    import numpy as np

    cache = _cache()
    cache.pin(range(2, 4))
    cache.pin(np.array([5, 6]))
    cache.pin(torch.tensor([7]))
    cache.pin([np.int64(8), torch.tensor(9)])
    assert torch.cat([r.positions for r in cache._rules]).tolist() == [2, 3, 5, 6, 7, 8, 9]


# -- item 4: scores float32 cannot hold, and infinities ---------------------------------------------------------------
def huge(view):
    return torch.rand(view.shape, dtype=torch.float64, generator=None) * 1e300


def minus_inf(view):
    s = torch.rand(view.shape, generator=view.generator)
    s[..., 2] = float("-inf")
    return s


def pins_all(view):
    return torch.full(view.shape, float("inf"))


@pytest.mark.parametrize("policy, message", [
    (huge, "policy 'huge' returned float64 scores at layer 0, round 0 that float32 cannot hold"),
    (minus_inf, "policy 'minus_inf' returned -inf scores at layer 0, round 0"),
    (pins_all, "16 pairs are pinned in one head at layer 0, round 0 by the policy's own pins alone (policy "
               "'pins_all' scored them +inf)"),
])
def test_scores_float32_cannot_rank_are_refused_naming_the_policy(model, policy, message):
    with pytest.raises(ValueError) as err:
        randattn.generate(model, random_ids(1, 8), _cache(policy), max_new_tokens=24, do_sample=False)
    assert message in str(err.value)


def test_a_policys_own_inf_pins_that_fit_still_work(model):
    """+inf is how a policy pins (StreamingLLM's sinks, VaSE's top set): kept, as documented."""
    def first_two(view):
        s = torch.rand(view.shape, generator=view.generator)
        return s.masked_fill(view.positions < 2, float("inf"))

    cache = _cache(first_two, protect_prompt=False, keep_log=True)
    randattn.generate(model, random_ids(1, 8), cache, max_new_tokens=40, do_sample=False)
    assert cache.total_events > 0 and (cache.positions(0)[..., :2] == torch.tensor([0, 1])).all()


# -- item 5: empty input_ids ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 0), (0, 5)])
def test_empty_input_ids_are_refused(model, shape):
    ids = torch.zeros(shape, dtype=torch.long)
    calls = {"randattn.generate": lambda: randattn.generate(model, ids, _cache(), max_new_tokens=3),
             "randattn.replay": lambda: randattn.replay(model, ids, _cache(), prompt_len=1),
             "randattn.decode_step": lambda: randattn.decode_step(model, ids, _cache())}
    for where, call in calls.items():
        with pytest.raises(ValueError, match=rf"{where}: input_ids must be \[batch, tokens\] with at least one row "
                                             rf"and one token, got shape \({shape[0]}, {shape[1]}\)"):
            call()


# -- item 6: copying a cache ------------------------------------------------------------------------------------------
class HoldsModel(randattn.Policy):
    """A policy that remembers the model it serves (as TriAttention does)."""

    name = "holds-model"

    def __init__(self):
        self.model = None

    def bind(self, model):
        self.model = model
        return self

    def score(self, view):
        return torch.rand(view.shape, generator=view.generator)


def _continue(model, cache, ids):
    logits = [randattn.decode_step(model, ids[:, i : i + 1], cache) for i in range(ids.shape[1])]
    return torch.cat(logits, dim=1), cache.positions(0).clone()


def test_deepcopy_and_pickle_copy_the_cache_not_the_model(model):
    cache = _cache(HoldsModel(), protect_prompt=False)
    randattn.decode_step(model, random_ids(1, 30), cache)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    clone = copy.deepcopy(cache)
    assert clone._bound_model is model and clone.policy.model is model
    data = pickle.dumps(cache)
    assert len(data) < weights / 4
    restored = pickle.loads(data)
    assert restored._bound_model is None and restored.policy.model is None  # bound again at its next forward
    more = random_ids(1, 12, seed=1)
    logits, positions = _continue(model, cache, more)
    for other in (clone, restored):
        got_logits, got_positions = _continue(model, other, more)
        assert torch.equal(got_positions, positions) and torch.allclose(got_logits, logits)
    assert restored.policy.model is model


# -- item 7: scores on the wrong device, a raising selector -----------------------------------------------------------
def on_meta(view):
    return torch.zeros(view.shape, device="meta")


def raises(view):
    raise KeyError("no such head")


def test_scores_on_another_device_are_refused(model):
    with pytest.raises(ValueError, match=r"policy 'on_meta' returned scores on device meta at layer 0, round 0; the "
                                         r"cache is on cpu"):
        randattn.generate(model, random_ids(1, 8), _cache(on_meta), max_new_tokens=24, do_sample=False)


def test_a_raising_selector_is_named_with_layer_and_round(model):
    with pytest.raises(RuntimeError, match=r"policy 'raises' failed at layer 0, round 0: KeyError: 'no such head'"):
        randattn.generate(model, random_ids(1, 8), _cache(raises), max_new_tokens=24, do_sample=False)
