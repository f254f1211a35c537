"""Bad input gets a clear error naming the parameter and the fix."""

import types

import pytest
import torch
import transformers

import randattn
from randattn.models import UnsupportedModelError, check_model
from randattn.testing import tiny_model

from conftest import random_ids
from test_invariants import _feed


@pytest.mark.parametrize("budget", [0, -3, 2.5, True, "8"])
def test_bad_budget(budget):
    with pytest.raises(ValueError, match="budget must be a positive integer"):
        randattn.EvictingCache("random", budget=budget)


@pytest.mark.parametrize("buffer", [0, -1, None])
def test_bad_buffer(buffer):
    with pytest.raises(ValueError, match="buffer must be a positive integer"):
        randattn.EvictingCache("random", budget=8, buffer=buffer)


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ValueError) as err:
        randattn.EvictingCache("h2oo", budget=8, buffer=4)
    for name in ["random", "random-shared", "recency", "streamingllm"]:
        assert name in str(err.value)


def test_unknown_policy_option():
    with pytest.raises(ValueError, match="does not take option.*'sinks'.*n_sink"):
        randattn.EvictingCache("streamingllm", budget=8, buffer=4, sinks=2)


def test_prompt_too_long_for_budget_names_both_numbers(tiny):
    model = tiny("llama")
    with pytest.raises(ValueError, match="budget T=16 cannot hold the protected prompt of 20 tokens"):
        randattn.generate(model, random_ids(1, 20), randattn.EvictingCache("random", budget=16, buffer=4),
                          max_new_tokens=2)
    # the recent window (default r) is no place for the prompt: T - r - 1 prompt tokens fit, no more
    with pytest.raises(ValueError, match="budget T=16 cannot hold the protected prompt of 12 tokens"):
        randattn.EvictingCache("random", budget=16, buffer=4, prompt_len=12)
    randattn.EvictingCache("random", budget=16, buffer=4, prompt_len=11)
    randattn.EvictingCache("random", budget=16, buffer=4, recent=0, prompt_len=15)
    # raw HF generate hits the same check at prefill
    with pytest.raises(ValueError, match="use budget >= 25 or protect_prompt=False"):
        model.generate(random_ids(1, 20), past_key_values=randattn.EvictingCache("random", budget=16, buffer=4),
                       max_new_tokens=2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=32), "must exceed the recent window, which is the buffer r=64"),
    (dict(budget=32, buffer=8, recent=32), "recent must be an integer in \\[0, budget\\)"),
    (dict(budget=32, buffer=8, recent=-1), "recent must be an integer"),
    (dict(budget=32, buffer=8, seed=1.5), "seed must be an integer"),
])
def test_bad_recent_window_or_seed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        randattn.EvictingCache("random", **kwargs)


def test_a_paper_mode_name_carries_its_protection():
    assert randattn.EvictingCache("attn", budget=32, buffer=8).protect_prompt is False
    assert randattn.EvictingCache("attn_pp", budget=32, buffer=8).protect_prompt is True
    with pytest.raises(ValueError, match="'attn' runs with the prompt unprotected by definition.*attn_pp"):
        randattn.EvictingCache("attn", budget=32, buffer=8, protect_prompt=True)


def test_right_padded_batch_is_refused_in_hf_generate(tiny):
    """Left padding is exact (tests/test_padded_batches.py); right padding would put pads among the real pairs."""
    model = tiny("llama")
    ids = random_ids(2, 12)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    with pytest.raises(ValueError, match=r"rows \[0\] are not left-padded"):
        model.generate(ids, attention_mask=mask, past_key_values=randattn.EvictingCache("random", budget=32, buffer=8), max_new_tokens=3)
    with pytest.raises(ValueError, match=r"rows \[0\] are not left-padded"):
        randattn.generate(model, ids, randattn.EvictingCache("random", budget=32, buffer=8), attention_mask=mask, max_new_tokens=3)


def test_assisted_decoding_is_refused(tiny):
    model = tiny("llama")
    with pytest.raises(ValueError, match="assisted"):
        randattn.generate(model, random_ids(1, 8), randattn.EvictingCache("random", budget=32, buffer=8), assistant_model=model)
    cache = randattn.EvictingCache("random", budget=4, buffer=2, protect_prompt=False)
    _feed(cache, 0, 10, 1, 2)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(-2)


def test_reusing_a_cache_is_refused(tiny):
    model = tiny("llama")
    cache = randattn.EvictingCache("random", budget=32, buffer=8)
    randattn.generate(model, random_ids(1, 8), cache, max_new_tokens=2)
    with pytest.raises(ValueError, match="randattn.replay: this EvictingCache already holds a sequence of 9 tokens"
                                         ".*Create a fresh EvictingCache per call, or call cache.reset"):
        randattn.replay(model, random_ids(1, 8), cache, prompt_len=4)
    with pytest.raises(ValueError, match="model.generate\\(past_key_values=...\\): this EvictingCache already holds"):
        model.generate(random_ids(1, 8), past_key_values=cache, max_new_tokens=2)


def test_sliding_window_model_is_refused_past_its_window():
    model = tiny_model("mistral", sliding_window=24)
    cache = randattn.EvictingCache("random", budget=14, buffer=4)
    with pytest.raises(UnsupportedModelError, match="sliding-window attention \\(window 24\\)"):
        randattn.generate(model, random_ids(1, 8), cache, max_new_tokens=40, do_sample=False)


@pytest.mark.parametrize(
    "config, reason",
    [
        (transformers.T5Config(d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=32, vocab_size=32), "encoder-decoder"),
        (transformers.DeepseekV3Config(), "latent KV"),
        (transformers.Qwen3NextConfig(), "recurrent or shared state"),
    ],
)
def test_architectures_the_cache_cannot_serve(config, reason):
    fake = types.SimpleNamespace(config=config)
    with pytest.raises(UnsupportedModelError, match=reason):
        check_model(fake)


def test_policy_returning_wrong_shape_or_nan_is_named():
    bad_shape = randattn.EvictingCache(lambda view: torch.zeros(3), budget=4, buffer=2, protect_prompt=False)
    with pytest.raises(ValueError, match="<lambda>.*returned scores shaped \\(3,\\); expected"):
        _feed(bad_shape, 0, 10, 1, 2)

    def nan_scores(view):
        return torch.full(view.shape, float("nan"))

    nan = randattn.EvictingCache(nan_scores, budget=4, buffer=2, protect_prompt=False)
    with pytest.raises(ValueError, match="'nan_scores' returned NaN scores at layer 0, round 0"):
        _feed(nan, 0, 10, 1, 2)


def test_bad_device_and_dtype_names():
    with pytest.raises(ValueError, match="device 'gpu0' is not a torch device"):
        randattn.resolve_device("gpu0")
    with pytest.raises(ValueError, match="dtype 'half-ish' not understood"):
        randattn.models._resolve_dtype("half-ish", torch.device("cpu"))


def test_cache_keyword_follows_the_installed_transformers():
    class OldStyle(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    class NewStyle(torch.nn.Module):
        def forward(self, input_ids, cache=None, past_key_values=None):
            return input_ids

    assert randattn.cache_argument_name(OldStyle()) == "past_key_values"
    assert randattn.cache_argument_name(NewStyle()) == "cache"
