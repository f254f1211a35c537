"""Architectures whose attention depends on the cache slot index (issue 29, section 4).

After per-head eviction a cache slot is no longer a token position. Models that build position biases from slot
indices or the cache length (ALiBi: Bloom, MPT, Falcon with ``alibi=True``; the learned relative biases of Inkling
and CPM-Ant) are refused by :func:`randattn.check_model` before anything is generated, wherever randattn sees the
model: ``load_model``, ``install_guards``, ``randattn.generate`` / ``replay`` / ``decode_step``. Falcon with rotary
positions takes its positions from ``get_seq_length()`` (true positions), so it is served; the masked reference
proves it (Falcon's attention does not go through transformers' attention interface, so the reference masks it
through the attention module's own ``attention_mask``, per layer and per head).
"""

from __future__ import annotations

import types

import pytest
import torch
import transformers as tf
from transformers import AutoModelForCausalLM

import randattn
from randattn.models import UnsupportedModelError, check_model

from conftest import logprobs_of, random_ids

COMMON = dict(vocab_size=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
REFUSED = {  # tiny configs of the checked architectures whose biases depend on the slot index
    "bloom": lambda: tf.BloomConfig(n_head=4, n_layer=2, hidden_size=64, **COMMON),
    "mpt": lambda: tf.MptConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=256),
    "falcon-alibi": lambda: tf.FalconConfig(alibi=True, num_attention_heads=4, hidden_size=64, num_hidden_layers=2,
                                            multi_query=False, new_decoder_architecture=False, **COMMON),
}
SERVED = {  # Falcon with rotary positions: multi-query (Falcon-7B), multi-head, grouped (Falcon-40B layout)
    "falcon-rotary-multi-query": dict(multi_query=True, new_decoder_architecture=False),
    "falcon-rotary-multi-head": dict(multi_query=False, new_decoder_architecture=False),
    "falcon-rotary-grouped": dict(new_decoder_architecture=True, num_kv_heads=2),
}


def _plain(config, **kw):
    """A model built without randattn: no guards installed."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kw).eval()


@pytest.mark.parametrize("arch", list(REFUSED))
def test_slot_dependent_biases_are_refused_before_generating(arch):
    model = _plain(REFUSED[arch]())
    with pytest.raises(UnsupportedModelError, match="ALiBi") as info:
        check_model(model)
    text = str(info.value)
    assert text.startswith(model.config.model_type) and "slot" in text and "rotary" in text  # reason + what works
    ids = random_ids(1, 40)
    for call in (lambda c: randattn.generate(model, ids, c, max_new_tokens=30, do_sample=False),
                 lambda c: randattn.replay(model, ids, c, prompt_len=8),
                 lambda c: randattn.decode_step(model, ids, c)):
        cache = randattn.EvictingCache("random", budget=16, buffer=4)
        with pytest.raises(UnsupportedModelError, match="ALiBi"):
            call(cache)
        assert cache.get_seq_length() == 0, "refused only after generating"
    with pytest.raises(UnsupportedModelError, match="ALiBi"):
        randattn.install_guards(model)


@pytest.mark.parametrize("model_type, reason", [("cpmant", "relative position bias"),
                                                ("inkling_text", "relative position bias|recurrent or shared state"),
                                                ("inkling2_text", "relative position bias|recurrent or shared state")])
def test_learned_relative_biases_over_slots_are_refused(model_type, reason):
    config = tf.AutoConfig.for_model(model_type)
    with pytest.raises(UnsupportedModelError, match=reason):
        check_model(types.SimpleNamespace(config=config))
    if model_type.startswith("inkling"):  # refused for its bias even with attention-only layers
        config.layer_types = ["full_attention"] * len(config.layer_types)
        with pytest.raises(UnsupportedModelError, match="relative position bias"):
            check_model(types.SimpleNamespace(config=config))


def _falcon_masked_reference(model, ids, keep_log) -> torch.Tensor:
    """Logits of one uncached forward where each layer's query heads see only what their cache head kept: the
    keep-log's ``[B, H, T, T]`` visibility, handed to every attention module as its additive mask."""
    b, t = ids.shape
    attn = [layer.self_attention for layer in model.transformer.h]
    heads = model.config.num_attention_heads
    handles = []
    for idx, module in enumerate(attn):
        stored = keep_log.for_layer(idx)[0][2].shape[1]  # heads the cache held at this layer
        vis = keep_log.visible_mask(idx, t, b, stored).repeat_interleave(heads // stored, dim=1)
        mask = torch.zeros(vis.shape).masked_fill(~vis, torch.finfo(torch.float32).min)

        def hook(mod, args, kwargs, mask=mask):
            return args, {**kwargs, "attention_mask": mask}

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", list(SERVED))
def test_falcon_with_rotary_positions_matches_the_masked_reference(arch, attn):
    config = tf.FalconConfig(alibi=False, num_attention_heads=4, hidden_size=64, num_hidden_layers=2,
                             **SERVED[arch], **COMMON)
    model = _plain(config, attn_implementation=attn)
    check_model(model)
    ids = random_ids(2, 96, seed=1)
    cache = randattn.EvictingCache("random", budget=20, buffer=6, keep_log=True, seed=3)
    got = randattn.replay(model, ids, cache, prompt_len=8)
    assert min(cache.events) >= 10, "the test must run many rounds"
    ref = _falcon_masked_reference(model, ids, cache.keep_log)
    torch.testing.assert_close(got.logprobs[:, 1:], logprobs_of(ref, ids), atol=1e-5, rtol=0)
    full = logprobs_of(model(ids).logits, ids)
    assert (full - got.logprobs[:, 1:]).abs().max() > 1e-2, "eviction changed nothing"
    kept = [cache.positions(0)[0, h] for h in range(cache.layers[0].keys.shape[1])]
    if len(kept) > 1:
        assert any(not torch.equal(kept[0], k) for k in kept[1:]), "heads kept the same pairs: no per-head check"
