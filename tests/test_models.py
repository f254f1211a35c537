"""Loading any HF causal LM from a local directory, and generate paths beyond greedy."""

import pytest
import torch

import randattn
from randattn.testing import TINY_ARCHS, tiny_model, tiny_tokenizer

from conftest import random_ids


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_load_model_from_a_local_directory(tmp_path, arch):
    src = tiny_model(arch)
    src.save_pretrained(tmp_path / "model")
    tiny_tokenizer(tmp_path / "tok")
    model, tok = randattn.load_model(str(tmp_path / "model"), device="cpu", tokenizer=str(tmp_path / "tok"))
    assert type(model).__name__ == type(src).__name__ and model.device.type == "cpu"
    assert getattr(model, "_randattn_guard_handle", None) is not None
    ids = tok("w1 w2 w3 w4 w5 w6", return_tensors="pt")["input_ids"]
    cache = randattn.EvictingCache("random", budget=12, buffer=4)
    out = randattn.generate(model, ids, cache, max_new_tokens=30, min_new_tokens=30, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 30 and min(cache.events) >= 4
    torch.testing.assert_close(model(ids).logits, src(ids).logits)


def test_missing_directory_says_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory .*nowhere' does not exist; give a directory with config.json"):
        randattn.load_model(str(tmp_path / "nowhere"), device="cpu")


def test_beam_search_without_eviction_matches_hf_and_runs_with_it(tiny):
    model = tiny("llama")
    ids = random_ids(1, 10, seed=12)
    kw = dict(max_new_tokens=30, num_beams=3, do_sample=False, early_stopping=False)
    big = randattn.EvictingCache("random", budget=400)
    assert torch.equal(randattn.generate(model, ids, big, **kw), model.generate(ids, **kw))
    small = randattn.EvictingCache("random", budget=16, buffer=4)
    out = randattn.generate(model, ids, small, min_new_tokens=30, **kw)
    assert out.shape == (1, 40) and min(small.events) >= 4
    assert small.layers[0].positions.shape[0] == 3  # one row per beam, positions moved with them


def test_sampling_is_reproducible_with_a_seed(tiny):
    model = tiny("qwen3")
    ids = random_ids(2, 10, seed=13)
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        cache = randattn.EvictingCache("random", budget=16, buffer=4, seed=1)
        outs.append(randattn.generate(model, ids, cache, max_new_tokens=40, do_sample=True, top_k=0))
        assert min(cache.events) >= 5
    assert torch.equal(outs[0], outs[1])


def test_a_long_unprotected_prefill_is_attended_in_full_then_cut_to_k(tiny):
    model = tiny("llama")
    ids = random_ids(1, 50, seed=14)
    cache = randattn.EvictingCache("random", budget=10, buffer=4, protect_prompt=False)
    logits = randattn.decode_step(model, ids, cache)
    torch.testing.assert_close(logits, model(ids).logits, atol=1e-5, rtol=0)  # nothing evicted mid-forward
    assert cache.physical_length(0) == 10 and cache.events == [1, 1]
