"""EvictingCache inside nnsight's generate and a TransformerLens TransformerBridge decode loop.

The cache is passed under ``randattn.cache_argument_name(model)``: ``past_key_values`` up to
transformers 5.23, ``cache`` from 5.24 on.
"""

import importlib.metadata
import warnings

import pytest
import torch

import randattn
from randattn.integrations import CacheNotUsedError, _known_broken_pair, bridge_decode, nnsight_model, transformer_lens_bridge
from randattn.testing import tiny_model, tiny_tokenizer

from conftest import random_ids


def test_nnsight_generate_with_evicting_cache_and_interventions(tmp_path):
    nnsight = pytest.importorskip("nnsight")
    hf = tiny_model("llama")
    hf.generation_config.eos_token_id = None
    tok = tiny_tokenizer(tmp_path / "tok")
    ids = random_ids(1, 12, seed=7)
    n = 40
    ref_cache = randattn.EvictingCache("random", budget=20, buffer=4, seed=3)
    arg = randattn.cache_argument_name(hf)
    ref = hf.generate(ids, max_new_tokens=n, do_sample=False, **{arg: ref_cache})

    lm = nnsight_model(hf, tok)
    cache = randattn.EvictingCache("random", budget=20, buffer=4, seed=3)
    with lm.generate(ids, max_new_tokens=n, do_sample=False, **{arg: cache}) as tracer:
        seen = nnsight.save([])
        for _ in tracer.iter[0:n]:
            seen.append(lm.model.layers[0].self_attn.inputs[1][arg] is cache)
        out = tracer.result.save()
    assert torch.equal(out, ref)
    assert all(seen) and len(seen) == n
    assert cache.events == ref_cache.events and min(cache.events) >= 5
    for a, b in zip(cache.layers, ref_cache.layers):
        assert torch.equal(a.positions, b.positions)

    # An intervention inside generate changes the tokens and still runs through the evicting cache.
    forced = randattn.EvictingCache("random", budget=20, buffer=4, seed=3)
    with lm.generate(ids, max_new_tokens=n, do_sample=False, **{arg: forced}) as tracer:
        for _ in tracer.iter[1:n]:
            lm.lm_head.output[:, -1, 7] = 1e4
        out2 = tracer.result.save()
    assert out2[0, ids.shape[1] + 1 :].tolist() == [7] * (n - 1)
    assert min(forced.events) >= 5


def _tl_works_here() -> None:
    pytest.importorskip("transformer_lens")
    if _known_broken_pair():
        pytest.skip(f"transformer-lens {importlib.metadata.version('transformer-lens')} ignores the cache on "
                    f"transformers {importlib.metadata.version('transformers')} (test_bridge_on_a_broken_pair_refuses_to_decode)")


def test_transformer_lens_bridge_decode_loop_matches_hf(tmp_path):
    _tl_works_here()
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


class _CacheIgnoringBridge:
    """A bridge stand-in that takes the cache argument and ignores it, as transformer-lens 4.3's does on
    transformers 5.24: logits come back, the cache stays empty."""

    def __init__(self, model):
        self.model = model

    def forward(self, input, return_type="logits", past_key_values=None, **kwargs):
        return self.model(input_ids=input).logits  # no cache: uncached, as the broken bridge is

    __call__ = forward


def test_bridge_decode_refuses_a_cache_the_forward_ignores():
    cache = randattn.EvictingCache("random", budget=16, buffer=4, seed=4)
    with pytest.raises(CacheNotUsedError) as exc:
        bridge_decode(_CacheIgnoringBridge(tiny_model("llama")), random_ids(1, 10, seed=8), cache, 5)
    msg = str(exc.value)
    assert "step 0" in msg and "fed 10 token(s)" in msg and "0 -> 0 (expected 10)" in msg
    # Names both versions and the fix.
    assert f"transformers {importlib.metadata.version('transformers')}" in msg
    assert "transformer-lens" in msg and "transformers>=5.9,<5.24" in msg and "randattn[transformer-lens]" in msg


def test_bridge_decode_refuses_a_cache_that_stops_growing():
    """The check runs at every step, not only the prompt: a forward that writes the prompt but not a later token."""
    model = tiny_model("llama")
    arg = randattn.cache_argument_name(model)

    class Bridge:
        calls = 0

        def __call__(self, input, return_type="logits", past_key_values=None, **kwargs):
            Bridge.calls += 1
            if Bridge.calls == 1:
                return model(input_ids=input, use_cache=True, **{arg: past_key_values}).logits
            return model(input_ids=input).logits

    cache = randattn.EvictingCache("random", budget=16, buffer=4, seed=4)
    with pytest.raises(CacheNotUsedError, match=r"step 1: .* 10 -> 10 \(expected 11\)"):
        bridge_decode(Bridge(), random_ids(1, 10, seed=8), cache, 5)


def test_bridge_on_a_broken_pair_refuses_to_decode(tmp_path):
    """Where transformers >= 5.24 meets transformer-lens <= 4.3 the real bridge ignores the cache: booting it warns
    and decoding raises instead of silently running uncached."""
    pytest.importorskip("transformer_lens")
    if not _known_broken_pair():
        pytest.skip("this transformers / transformer-lens pair passes the cache through")
    with pytest.warns(RuntimeWarning, match="cached decoding through this bridge will not work"):
        bridge = transformer_lens_bridge(tiny_model("llama"), tiny_tokenizer(tmp_path / "tok"))
    cache = randattn.EvictingCache("random", budget=16, buffer=4, seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the bridge passes the deprecated name
        with pytest.raises(CacheNotUsedError, match="This is the transformers 5.24 rename"):
            bridge_decode(bridge, random_ids(1, 10, seed=8), cache, 3)


def test_missing_front_end_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "nnsight", None)  # import nnsight -> ImportError
    monkeypatch.setitem(sys.modules, "transformer_lens", None)
    monkeypatch.setitem(sys.modules, "transformer_lens.model_bridge", None)
    with pytest.raises(ImportError, match=r'pip install "randattn\[nnsight\]"'):
        nnsight_model(None, None)
    with pytest.raises(ImportError, match=r'pip install "randattn\[transformer-lens\]".*transformers < 5.24'):
        transformer_lens_bridge(None, None)
