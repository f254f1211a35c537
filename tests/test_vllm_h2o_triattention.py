"""H2O and TriAttention in the vLLM plugin (issue 39 item 1): the accumulated attention the plugin recomputes from a request's held
keys equals the HF layer's, so every keep record equals the HF engine's on the same keys and queries (main env: the
plugin's step plan and rounds driven by hand over a paged cache, no vLLM needed; the vllm tier runs it in vLLM)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from randattn.spec import EvictionSpec
from randattn.vllm import config as vcfg
from randattn.vllm import state
from randattn.vllm.flash_backend import FlashPagedKV


def _records(log):
    return [(l, r, s, k.tolist()) for l, r, s, k in zip(log.layers, log.rounds, log.seq_lens, log.kept)]


@pytest.mark.parametrize("chunked", [False, True], ids=["token-by-token", "recomputed-in-chunks"])
@pytest.mark.parametrize("protect,prompt,steps", [(True, 12, 60), (False, 45, 40), (True, 3, 70)])
def test_h2o_keep_records_equal_the_hf_engine(tmp_path, protect, prompt, steps, chunked):
    budget, buffer, hkv, hq, d, bs, nb = 32, 8, 2, 4, 8, 4, 32
    g = torch.Generator().manual_seed(prompt)
    total = prompt + steps
    keys = torch.randn(hkv, total, d, generator=g)
    values = torch.randn(hkv, total, d, generator=g)
    queries = torch.randn(hq, total, d, generator=g)
    scale = d ** -0.5

    hf = EvictionSpec("h2o", budget=budget, buffer=buffer, protect_prompt=protect).make_cache(
        keep_log=True, row_keys=["req"])
    cfg = vcfg.parse_config({"policy": "h2o", "budget": budget, "buffer": buffer, "protect_prompt": protect,
                             "keep_log_dir": str(tmp_path)})
    kv = torch.zeros(nb, hkv, bs, 2 * d)
    paged = FlashPagedKV(kv, d)
    blocks = np.random.default_rng(0).permutation(nb).astype(np.int32)
    try:
        for c in [0] + list(range(prompt, total)):  # the HF engine: the prompt, then one token per forward
            sl = slice(c, c + (prompt if c == 0 else 1))
            hf._observe_queries(0, queries[None, :, sl], scale)
            hf.update(keys[None, :, sl], values[None, :, sl], 0)
        # vLLM: the same, or (a request recomputed after a preemption) the prompt and generated tokens in chunks that
        # end at the rounds, as the plugin's scheduler cuts them
        chunks, c = [], 0
        while c < total:
            end = total if not chunked else min(total, vcfg.next_round_length(prompt, c, cfg))
            n_new = prompt if c == 0 and not chunked else (1 if not chunked else end - c)
            chunks.append(n_new)
            c += n_new
        c = 0
        for n_new in chunks:
            sl = slice(c, c + n_new)
            seq_lens = torch.zeros(1, dtype=torch.int32)
            slots = torch.zeros(n_new, dtype=torch.int64)
            plan = state.plan_step(cfg, req_ids=["r"], computed=np.array([c]), scheduled=[n_new],
                                   prompt_lens=[prompt], keys=["req"], max_lens=[None], query_start=np.array([0]),
                                   block_rows=blocks[None], block_size=bs, num_layers=1, seq_lens=seq_lens,
                                   slot_mapping=slots)
            for j, slot in enumerate(slots.tolist()):  # what vLLM's reshape_and_cache does before the attention
                kv[slot // bs, :, slot % bs] = torch.cat([keys[:, c + j], values[:, c + j]], dim=-1)
            state.after_attention(plan, 0, queries[:, sl].transpose(0, 1), scale, hkv, paged.read, paged.write)
            c += n_new
        vl = state.requests()["r"].cache.keep_log
        assert len(hf.keep_log) > 2
        assert _records(vl) == _records(hf.keep_log)
        # and the held pairs themselves: the paged cache holds what the HF layer holds, head by head
        layer = hf.layers[0]
        k_held, v_held = paged.read(blocks, layer.physical_length)
        assert torch.equal(k_held, layer.keys[0]) and torch.equal(v_held, layer.values[0])
        # the accumulated attention itself (keep-sets alone tolerate small errors in it): bit for bit token by token;
        # a chunk's probabilities come from one batched matmul, whose last bits differ from one query's, so a
        # recomputed request agrees to float32 rounding (added in the HF engine's order, token by token)
        lay = state.requests()["r"].layers[0]
        got, want = lay.attention[:, :, : layer.physical_length], layer.attention
        if chunked:
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6) and not torch.equal(got, torch.zeros_like(got))
        else:
            assert torch.equal(got, want)
    finally:
        state.finish(["r"])


def test_h2o_is_served():
    assert state.policy_problem(vcfg.parse_config({"policy": "h2o", "budget": 64, "buffer": 8})) is None


def test_triattention_shared_keep_set_equals_the_hf_engine(tmp_path):
    """TriAttention's keep-set shared by all layers, scored when the first layer reaches the round from every layer's
    candidates (the later layers not yet holding this step's pairs, as in vLLM's layer-by-layer forward): equal keep
    records to the HF cache's, with the embedded model's shipped statistics on its shapes (30 layers, 3 KV heads)."""
    layers, hkv, hq, d, bs, nb, budget, buffer, prompt, steps = 30, 3, 9, 64, 4, 40, 48, 8, 10, 60
    g = torch.Generator().manual_seed(7)
    total = prompt + steps
    keys = torch.randn(layers, hkv, total, d, generator=g)
    values = torch.randn(layers, hkv, total, d, generator=g)
    spec = dict(budget=budget, buffer=buffer, options={"stats": "smollm2-135m"})
    hf = EvictionSpec("triattention", **spec).make_cache(keep_log=True, row_keys=["req"])
    cfg = vcfg.parse_config({"policy": "triattention", **spec, "keep_log_dir": str(tmp_path)})
    assert state.policy_problem(cfg) is None
    kv = [torch.zeros(nb, hkv, bs, 2 * d) for _ in range(layers)]
    paged = [FlashPagedKV(t, d) for t in kv]
    blocks = np.random.default_rng(0).permutation(nb).astype(np.int32)
    try:
        c = 0
        for n_new in [prompt] + [1] * steps:
            sl = slice(c, c + n_new)
            for i in range(layers):
                hf.update(keys[None, i, :, sl], values[None, i, :, sl], i)
            slots = torch.zeros(n_new, dtype=torch.int64)
            plan = state.plan_step(cfg, req_ids=["r"], computed=np.array([c]), scheduled=[n_new],
                                   prompt_lens=[prompt], keys=["req"], max_lens=[None], query_start=np.array([0]),
                                   block_rows=blocks[None], block_size=bs, num_layers=layers,
                                   seq_lens=torch.zeros(1, dtype=torch.int32), slot_mapping=slots)
            for i in range(layers):  # layer by layer: layer i's pairs written just before its attention
                for j, slot in enumerate(slots.tolist()):
                    kv[i][slot // bs, :, slot % bs] = torch.cat([keys[i, :, c + j], values[i, :, c + j]], dim=-1)
                state.after_attention(plan, i, torch.zeros(n_new, hq, d), d ** -0.5, hkv, paged[i].read,
                                      paged[i].write, read_layer=lambda k: paged[k].read)
            c += n_new
        vl = state.requests()["r"].cache.keep_log
        assert len(hf.keep_log) == layers * 2  # rounds at lengths 56 and 64
        assert _records(vl) == _records(hf.keep_log)
        first = [k for l, r, s, k in _records(hf.keep_log) if r == 0]
        assert all(k == first[0] for k in first)  # one keep-set for every layer: the shared scope is in force
    finally:
        state.finish(["r"])


def test_triattention_without_statistics_is_refused_with_the_option_to_pass():
    problem = state.policy_problem(vcfg.parse_config({"policy": "triattention", "budget": 64, "buffer": 8}))
    assert problem and "'options': {'stats': 'smollm2-135m'}" in problem


def _engine_config(policy_options: dict, **hf):
    """A stand-in for vLLM's config with what the start-up checks read (no vLLM needed)."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, Qwen3Config

    arch = hf.pop("arch", "llama")
    shape = dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576, head_dim=64)
    shape.update(hf)
    model = SimpleNamespace(model="served-model", enforce_eager=True,
                            hf_config=(LlamaConfig if arch == "llama" else Qwen3Config)(**shape))
    return SimpleNamespace(additional_config={"randattn": {"policy": "triattention", "budget": 256, "buffer": 32,
                                                           "options": policy_options}},
                           model_config=model, cache_config=None, speculative_config=None, scheduler_config=None)


def test_triattention_statistics_for_another_model_are_refused_at_start_up():
    from randattn.vllm import checks

    matching = _engine_config({"stats": "smollm2-135m"})
    assert not [p for p in checks.engine_problems(matching, platform="cpu") if "statistics" in p]
    other_type = checks.engine_problems(_engine_config({"stats": "smollm2-135m"}, arch="qwen3"), platform="cpu")
    assert any("made for a llama model" in p and "served-model" in p and "qwen3" in p for p in other_type), other_type
    other_shape = checks.engine_problems(_engine_config({"stats": "smollm2-135m"}, num_hidden_layers=24),
                                         platform="cpu")
    assert any("num_layers 30 (model has 24)" in p for p in other_shape), other_shape
