"""Physical eviction must equal full attention with the evicted positions masked, per layer and head."""

import pytest
import torch

import randattn
from randattn.reference import masked_forward_logits

from conftest import assert_matches_masked_reference, logprobs_of, random_ids

ARCHS = ["llama", "qwen3", "phi3", "mistral", "qwen2"]



@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy", ["random", "recency", "streamingllm", "random-block"])
def test_physical_eviction_equals_masked_full_attention(tiny, arch, policy):
    model = tiny(arch)
    ids = random_ids(2, 160, seed=1)
    cache = randattn.EvictingCache(policy, budget=24, buffer=8, keep_log=True, seed=5)
    got = randattn.replay_tokenwise(model, ids, cache, prompt_len=10)
    assert min(cache.events) >= 10, "the test must run many rounds"
    assert_matches_masked_reference(model, ids, got, cache.keep_log)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_oracle_with_keep_masks_and_unprotected_prompt(tiny, arch):
    model = tiny(arch)
    ids = random_ids(1, 120, seed=2)
    cache = randattn.EvictingCache("random", budget=20, buffer=6, protect_prompt=False, keep_log=True, seed=1)
    cache.pin([12, 13, 14], layers=[0], heads=[1])
    cache.force_evict([30, 31], heads=[0])
    got = randattn.replay(model, ids, cache, prompt_len=8)
    ref = masked_forward_logits(model, ids, cache.keep_log)
    torch.testing.assert_close(got.logprobs[:, 1:], logprobs_of(ref, ids), atol=1e-5, rtol=0)


def test_budget_larger_than_sequence_matches_hf_default_cache(tiny):
    model = tiny("llama")
    ids = random_ids(2, 12, seed=3)
    cache = randattn.EvictingCache("random", budget=500, buffer=64)
    ours = randattn.generate(model, ids, cache, max_new_tokens=30, do_sample=False, output_scores=True, return_dict_in_generate=True)
    theirs = model.generate(ids, max_new_tokens=30, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert cache.events == [0, 0]
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.scores, theirs.scores):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
@pytest.mark.parametrize("policy", ["random", "random-shared", "recency", "random-block"])
def test_replay_equals_token_by_token(tiny, arch, policy):
    model = tiny(arch)
    ids = random_ids(2, 150, seed=4)
    c1 = randattn.EvictingCache(policy, budget=30, buffer=7, keep_log=True, seed=9)
    c2 = randattn.EvictingCache(policy, budget=30, buffer=7, keep_log=True, seed=9)
    slow = randattn.replay_tokenwise(model, ids, c1, prompt_len=11)
    fast = randattn.replay(model, ids, c2, prompt_len=11)
    assert fast.forwards < slow.forwards / 4
    assert c1.events == c2.events and min(c1.events) > 5
    for l1, l2 in zip(c1.layers, c2.layers):
        assert torch.equal(l1.positions, l2.positions)
    assert all((a == b).all() for a, b in zip(c1.keep_log.kept, c2.keep_log.kept))
    torch.testing.assert_close(fast.logprobs, slow.logprobs, atol=1e-5, rtol=0, equal_nan=True)
    assert torch.equal(fast.argmax, slow.argmax)


def test_hf_generate_sees_the_same_cache_as_replay(tiny):
    """Greedy HF generate's scores equal replay's log-probs of the generated text (same rounds)."""
    model = tiny("qwen3")
    ids = random_ids(2, 20, seed=5)
    c1 = randattn.EvictingCache("random", budget=32, buffer=4, seed=2)
    out = randattn.generate(model, ids, c1, max_new_tokens=60, do_sample=False, output_scores=True, return_dict_in_generate=True)
    c2 = randattn.EvictingCache("random", budget=32, buffer=4, seed=2)
    rep = randattn.replay(model, out.sequences, c2, prompt_len=20)
    gen_lp = torch.gather(torch.log_softmax(torch.stack(out.scores, 1).float(), -1), -1, out.sequences[:, 20:, None])[..., 0]
    assert min(c1.events) >= 8
    torch.testing.assert_close(gen_lp, rep.logprobs[:, 20:], atol=1e-5, rtol=0)


def test_manual_decode_loop_keeps_true_positions(tiny):
    model = tiny("llama")
    ids = random_ids(1, 10, seed=6)
    cache = randattn.EvictingCache("random", budget=16, buffer=4)
    logits = randattn.decode_step(model, ids, cache)
    for _ in range(50):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        logits = randattn.decode_step(model, nxt, cache)
    assert cache.get_seq_length() == 60
    assert cache.physical_length(0) < 20
    assert int(cache.positions(0).max()) == 59  # the newest token sits at its absolute position


def test_eager_attention_uses_the_cache_mask_sizes(tiny):
    """Eager attention materialises every mask from get_mask_sizes, so a wrong kv_offset or
    physical length would show here even for single-token steps."""
    from randattn.testing import tiny_model

    model = tiny_model("llama", attn_implementation="eager")
    ids = random_ids(2, 120, seed=11)
    c1 = randattn.EvictingCache("random", budget=20, buffer=6, keep_log=True, seed=2)
    c2 = randattn.EvictingCache("random", budget=20, buffer=6, keep_log=True, seed=2)
    slow = randattn.replay_tokenwise(model, ids, c1, prompt_len=9)
    fast = randattn.replay(model, ids, c2, prompt_len=9)
    ref = masked_forward_logits(model, ids, c1.keep_log)
    torch.testing.assert_close(slow.logprobs[:, 1:], logprobs_of(ref, ids), atol=1e-5, rtol=0)
    torch.testing.assert_close(fast.logprobs[:, 1:], logprobs_of(ref, ids), atol=1e-5, rtol=0)
