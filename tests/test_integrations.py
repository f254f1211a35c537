"""EvictingCache inside nnsight's generate and a TransformerLens TransformerBridge decode loop."""

import nnsight
import torch

import randattn
from randattn.integrations import bridge_decode, nnsight_model, transformer_lens_bridge
from randattn.testing import tiny_model, tiny_tokenizer

from conftest import random_ids


def test_nnsight_generate_with_evicting_cache_and_interventions(tmp_path):
    hf = tiny_model("llama")
    hf.generation_config.eos_token_id = None
    tok = tiny_tokenizer(tmp_path / "tok")
    ids = random_ids(1, 12, seed=7)
    n = 40
    ref_cache = randattn.EvictingCache("random", budget=20, buffer=4, seed=3)
    ref = hf.generate(ids, max_new_tokens=n, do_sample=False, past_key_values=ref_cache)

    lm = nnsight_model(hf, tok)
    cache = randattn.EvictingCache("random", budget=20, buffer=4, seed=3)
    with lm.generate(ids, max_new_tokens=n, do_sample=False, past_key_values=cache) as tracer:
        seen = nnsight.save([])
        for _ in tracer.iter[0:n]:
            seen.append(lm.model.layers[0].self_attn.inputs[1]["past_key_values"] is cache)
        out = tracer.result.save()
    assert torch.equal(out, ref)
    assert all(seen) and len(seen) == n
    assert cache.events == ref_cache.events and min(cache.events) >= 5
    for a, b in zip(cache.layers, ref_cache.layers):
        assert torch.equal(a.positions, b.positions)

    # An intervention inside generate changes the tokens and still runs through the evicting cache.
    forced = randattn.EvictingCache("random", budget=20, buffer=4, seed=3)
    with lm.generate(ids, max_new_tokens=n, do_sample=False, past_key_values=forced) as tracer:
        for _ in tracer.iter[1:n]:
            lm.lm_head.output[:, -1, 7] = 1e4
        out2 = tracer.result.save()
    assert out2[0, ids.shape[1] + 1 :].tolist() == [7] * (n - 1)
    assert min(forced.events) >= 5


def test_transformer_lens_bridge_decode_loop_matches_hf(tmp_path):
    tok = tiny_tokenizer(tmp_path / "tok")
    hf_ref = tiny_model("llama", attn_implementation="eager")
    bridged = tiny_model("llama")  # same seed, same weights; the bridge rewires it in place
    bridge = transformer_lens_bridge(bridged, tok)
    ids = random_ids(1, 10, seed=8)
    n = 45

    cache_ref = randattn.EvictingCache("random", budget=16, buffer=4, seed=4)
    logits = randattn.decode_step(hf_ref, ids, cache_ref)
    ref_ids, ref_steps = ids, []
    for _ in range(n):
        ref_steps.append(logits[:, -1])
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        ref_ids = torch.cat([ref_ids, nxt], 1)
        logits = randattn.decode_step(hf_ref, nxt, cache_ref)

    cache = randattn.EvictingCache("random", budget=16, buffer=4, seed=4)
    patterns, rot_k = [], []
    hooks = [
        ("blocks.1.attn.hook_pattern", lambda t, hook: patterns.append(t.shape)),
        ("blocks.0.attn.hook_rot_k", lambda t, hook: rot_k.append(t.detach().clone())),
    ]
    with bridge.hooks(fwd_hooks=hooks):
        out, steps = bridge_decode(bridge, ids, cache, n)
    assert torch.equal(out, ref_ids)
    for a, b in zip(steps, ref_steps):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert min(cache.events) >= 8
    assert cache.get_seq_length() == ids.shape[1] + n - 1
    # Hooks fired at every step; patterns span physical slots (<= K + r), never the absolute length.
    assert len(patterns) == n and max(s[-1] for s in patterns) <= 16 + 4
    # The newest key in the cache is exactly the post-RoPE key the hook saw (the cache stores post-RoPE keys).
    newest = cache.layers[0].keys[:, :, -1]
    torch.testing.assert_close(newest, rot_k[-1][:, -1], atol=1e-6, rtol=0)  # hook_rot_k is [B, pos, H_kv, D]
