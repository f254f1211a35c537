"""TriAttention: the vectorised score against a slow loop reference, its behaviour, calibration,
the physical-eviction oracle, prompt protection, errors, and the embedded model with shipped stats."""

import json
import math

import pytest
import torch

import randattn
import randattn.triattention  # noqa: F401  (registers "triattention" until randattn/__init__ imports it)
from randattn.calibrate import build_parser, calibrate, main as calibrate_main, rotary_parameters
from randattn.capture import attention_modules, recompute_queries
from randattn.policies import CacheView, make_policy
from randattn.triattention import (
    DEFAULT_OFFSETS,
    TriAttentionStats,
    check_stats,
    load_stats,
    shipped_stats,
    triattention_raw,
)

from conftest import assert_matches_masked_reference, random_ids


# -- helpers ---------------------------------------------------------------------------------------
def _view(keys, seq_len, layer_idx=0, positions=None, budget=4, buffer=2):
    b, h, s, _ = keys.shape
    if positions is None:
        positions = torch.arange(seq_len - s, seq_len).expand(b, h, s)
    return CacheView(
        keys=keys, values=torch.zeros_like(keys), positions=positions, layer_idx=layer_idx, round_idx=0,
        prompt_len=0, seq_len=seq_len, budget=budget, buffer=buffer, generator=torch.Generator().manual_seed(0),
    )


def _stats(qbar, mbar, inv_freq, scaling=1.0, **meta):
    """One-layer statistics from per-head tensors qbar [H_q, D], mbar [H_q, R/2]."""
    return TriAttentionStats(qbar=qbar[None].float(), mbar=mbar[None].float(), inv_freq=inv_freq.double(),
                             attention_scaling=scaling, meta=meta)


def _hf_rope(x, t, inv_freq, scaling):
    """Rotate ``x[D]`` to position ``t`` with HF's own apply_rotary_pos_emb (Phi-3's, which also handles partial rotary)."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    freqs = t * inv_freq.double()
    emb = torch.cat([freqs, freqs])
    cos, sin = (emb.cos() * scaling)[None, None], (emb.sin() * scaling)[None, None]
    x = x.double()[None, None, None]  # [B, H, T, D]; cos/sin are [B, T, R]
    out, _ = apply_rotary_pos_emb(x, x, cos, sin)
    return out[0, 0, 0]


def reference_scores(keys, seq_len, qbar, mbar, inv_freq, scaling, offsets, aggregate):
    """Slow, explicit TriAttention: Python loops over batch, query heads, slots, offsets and frequency
    pairs; RoPE as an explicit 2x2 rotation [[c, -s], [s, c]] of (q_f, q_{f+R/2}); float64 throughout."""
    b_, h_, s_, d_ = keys.shape
    hq = qbar.shape[0]
    nf = inv_freq.shape[0]
    r = 2 * nf
    g = hq // h_
    qb, mb, w = qbar.double().tolist(), mbar.double().tolist(), inv_freq.double().tolist()
    out = torch.empty(b_, h_, s_, dtype=torch.float64)
    for b in range(b_):
        z_heads = []
        for hh in range(hq):
            kvh = hh // g  # HF repeat_kv: query head hh reads KV head hh // g
            raw = []
            for j in range(s_):
                k = keys[b, kvh, j].double().tolist()
                trig = 0.0
                for delta in offsets:
                    t = seq_len + delta
                    dot = 0.0
                    for f in range(nf):
                        c, s = scaling * math.cos(t * w[f]), scaling * math.sin(t * w[f])
                        x, y = qb[hh][f], qb[hh][f + nf]
                        rx, ry = c * x - s * y, s * x + c * y
                        dot += rx * k[f] + ry * k[f + nf]
                    for p in range(r, d_):  # non-rotary dims: plain dot product
                        dot += qb[hh][p] * k[p]
                    trig += dot
                trig /= len(offsets)
                norm = 0.0
                for f in range(nf):
                    qmag = math.hypot(qb[hh][f], qb[hh][f + nf])
                    kmag = math.hypot(k[f], k[f + nf])
                    norm += (mb[hh][f] - qmag) * kmag
                raw.append(trig + norm)
            mean = sum(raw) / s_
            std = math.sqrt(sum((v - mean) ** 2 for v in raw) / s_)
            z_heads.append([(v - mean) / (std + 1e-6) for v in raw])
        for kvh in range(h_):
            group = z_heads[kvh * g : (kvh + 1) * g]
            for j in range(s_):
                vals = [zh[j] for zh in group]
                out[b, kvh, j] = max(vals) if aggregate == "max" else sum(vals) / len(vals)
    return out


# -- 1. vectorised score == slow reference --------------------------------------------------------
@pytest.mark.parametrize("aggregate", ["max", "mean"])
@pytest.mark.parametrize(
    "hq,hkv,d,rot,scaling,seq_len,offsets",
    [
        (4, 2, 8, 8, 1.0, 37, (1, 2, 4, 8, 16)),  # GQA: H_q = 2 H_kv, full rotary
        (2, 2, 10, 8, 1.25, 5003, (1, 3, 64, 1000)),  # partial rotary (2 pass dims), attention_scaling != 1
        (3, 1, 6, 6, 1.0, 200, (0, 1)),  # one KV head serving three query heads
    ],
)
def test_vectorised_score_matches_loop_reference(hq, hkv, d, rot, scaling, seq_len, offsets, aggregate):
    g = torch.Generator().manual_seed(hq * 100 + d)
    b, s, nf = 2, 11, rot // 2
    keys = torch.randn(b, hkv, s, d, generator=g)
    positions = torch.stack([torch.randperm(seq_len, generator=g)[:s].sort().values for _ in range(b * hkv)])
    positions = positions.reshape(b, hkv, s)  # random, chronological per head (the score reads only the keys)
    qbar = torch.randn(hq, d, generator=g)
    qmag = torch.sqrt(qbar[:, :nf] ** 2 + qbar[:, nf : 2 * nf] ** 2)
    mbar = qmag + torch.rand(hq, nf, generator=g) * 2
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    stats = _stats(qbar, mbar, inv_freq, scaling, num_kv_heads=hkv)
    policy = make_policy("triattention", stats=stats, offsets=offsets, aggregate=aggregate)
    got = policy.score(_view(keys, seq_len, positions=positions))
    want = reference_scores(keys, seq_len, qbar, mbar, inv_freq, scaling, offsets, aggregate)
    assert got.shape == (b, hkv, s)
    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-4)
    # The reference is not trivially constant: the scores spread over slots.
    assert want.std() > 0.3


def test_reference_rotation_is_hf_rope():
    """The reference's 2x2 rotation is HF's apply_rotary_pos_emb (rotate_half layout, cos/sin * scaling)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(10, generator=g, dtype=torch.float64)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    t, a = 123, 1.3
    hf = _hf_rope(q, t, inv_freq, a)
    ref = q.clone()
    for f in range(4):
        c, s = a * math.cos(t * inv_freq[f]), a * math.sin(t * inv_freq[f])
        ref[f], ref[f + 4] = c * q[f] - s * q[f + 4], s * q[f] + c * q[f + 4]
    torch.testing.assert_close(hf, ref)


# -- 2. behaviour ----------------------------------------------------------------------------------
def test_key_aligned_with_rotated_mean_query_ranks_first():
    g = torch.Generator().manual_seed(2)
    d, seq_len = 8, 300
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    qbar = torch.tensor([[2.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]])  # a chosen direction
    mbar = torch.sqrt(qbar[:, :4] ** 2 + qbar[:, 4:] ** 2)  # perfectly concentrated: norm term is 0
    stats = _stats(qbar, mbar, inv_freq)
    future = _hf_rope(qbar[0], seq_len + 1, inv_freq, 1.0).float()  # the mean query at position L + 1
    keys = torch.randn(1, 1, 20, d, generator=g)
    keys = keys / keys.norm(dim=-1, keepdim=True)
    keys[0, 0, 13] = future / future.norm()  # unit key aligned with the rotated mean query
    keys[0, 0, 14] = qbar[0] / qbar[0].norm()  # the mean query's direction, not rotated to t
    score = make_policy("triattention", stats=stats, offsets=(1,)).score(_view(keys, seq_len))[0, 0]
    assert int(score.argmax()) == 13
    assert score[13] > score[14] + 0.5


def test_trig_term_depends_on_key_position_as_the_formula_says():
    """Same key content at two positions p: the logit of RoPE(qbar, t) . RoPE(k0, p) is cos((t - p) w).
    w = pi / 8. At L = 32 (t = 33): p = 17 gives cos(2 pi) = 1, p = 25 gives cos(pi) = -1. At L = 40
    (t = 41) the order flips: p = 17 gives cos(3 pi) = -1, p = 25 gives cos(2 pi) = 1."""
    w = math.pi / 8
    inv_freq = torch.tensor([w], dtype=torch.float64)
    qbar = torch.tensor([[1.0, 0.0]])
    stats = _stats(qbar, torch.ones(1, 1), inv_freq)
    k0 = torch.tensor([1.0, 0.0])
    pos = [17, 25, 21]
    keys = torch.stack([_hf_rope(k0, p, inv_freq, 1.0).float() for p in pos])[None, None]  # [1, 1, 3, 2]
    positions = torch.tensor(pos)[None, None]
    pol = make_policy("triattention", stats=stats, offsets=(1,))
    early = pol.score(_view(keys, 32, positions=positions))[0, 0]
    late = pol.score(_view(keys, 40, positions=positions))[0, 0]
    assert early[0] > early[2] > early[1]  # cos(2pi) > cos(3pi/2) = 0 > cos(pi)
    assert late[1] > late[2] > late[0]
    # mbar = |qbar| here, so only the trig term acts; it is averaged over offsets: with offsets (1, 9)
    # the two future positions differ by 8 -> phase pi, and the two logits cancel for every key.
    raw = triattention_raw(keys, stats.qbar[0], stats.mbar[0], stats.inv_freq, 1.0, 32, (1, 9))
    assert raw.abs().max() < 1e-6
    one = triattention_raw(keys, stats.qbar[0], stats.mbar[0], stats.inv_freq, 1.0, 32, (1,))
    torch.testing.assert_close(one[0, 0, 0], torch.tensor([1.0, -1.0, 0.0]), atol=1e-6, rtol=0)


def test_norm_term_credits_magnitude_on_spread_frequencies():
    """qbar = 0 (no mean direction): only norm_j = sum_f mbar_f |k_{j,f}| acts."""
    inv_freq = torch.tensor([1.0, 0.1], dtype=torch.float64)
    stats = _stats(torch.zeros(1, 4), torch.tensor([[1.0, 0.0]]), inv_freq)
    # pairs: f = 0 is dims (0, 2), f = 1 is dims (1, 3); only f = 0 is weighted (mbar = [1, 0]).
    keys = torch.tensor([[0.0, 0.0, 2.0, 0.0], [0.0, 2.0, 0.0, 0.1], [2.0, 0.0, 0.0, 0.0]])[None, None]
    score = make_policy("triattention", stats=stats).score(_view(keys, 50))[0, 0]
    # keys 0 and 2 have magnitude 2 on pair 0 (different phase: the norm term ignores it); key 1's
    # larger magnitude sits on the unweighted pair.
    assert score[1] < score[0] - 1 and score[1] < score[2] - 1
    torch.testing.assert_close(score[0], score[2])


def test_gqa_aggregate_max_vs_mean():
    """Two query heads of one KV head each favour their own key; a third key is liked moderately
    by both. max keeps the specialists first, mean the compromise."""
    inv_freq = torch.tensor([0.0], dtype=torch.float64)  # no rotation: trig = qbar . k
    qbar = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    stats = _stats(qbar, torch.ones(2, 1), inv_freq)  # mbar = |qbar|: norm term 0
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.7, 0.7]])[None, None]
    mx = make_policy("triattention", stats=stats, aggregate="max").score(_view(keys, 10))[0, 0]
    mn = make_policy("triattention", stats=stats, aggregate="mean").score(_view(keys, 10))[0, 0]
    assert mx[0] > mx[2] and mx[1] > mx[2]
    assert mn[2] > mn[0] and mn[2] > mn[1]


def test_default_offsets_are_the_papers_powers_of_two_up_to_65536():
    inv_freq = torch.tensor([1.0], dtype=torch.float64)
    st = _stats(torch.ones(1, 2), torch.ones(1, 1), inv_freq)
    assert make_policy("triattention", stats=st).offsets == DEFAULT_OFFSETS == tuple(2**i for i in range(17))
    st.meta["max_position_embeddings"] = 100  # the paper's engine does not cap them
    assert make_policy("triattention", stats=st).offsets == DEFAULT_OFFSETS
    assert make_policy("triattention", stats=st, offsets=[1, 2]).offsets == (1, 2)


# -- calibration -----------------------------------------------------------------------------------
def _calib_ids(n=3, length=48, seed=7):
    return [random_ids(1, length, seed=seed + i)[0] for i in range(n)]


def test_calibrate_equals_direct_computation(tiny):
    """qbar/mbar from the hooks equal means of q_proj(input_layernorm(h_l)) computed from hidden states."""
    model = tiny("llama")
    seqs = _calib_ids()
    st = calibrate(model, seqs, progress=False)
    cfg = model.config
    qs = {l: [] for l in range(cfg.num_hidden_layers)}
    with torch.no_grad():
        for ids in seqs:
            hs = model(ids[None], output_hidden_states=True, use_cache=False).hidden_states
            for l, layer in enumerate(model.model.layers):
                q = layer.self_attn.q_proj(layer.input_layernorm(hs[l]))[0].view(ids.shape[0], cfg.num_attention_heads, -1)
                qs[l].append(q.double())
    half = st.inv_freq.shape[0]
    for l in range(cfg.num_hidden_layers):
        q = torch.cat(qs[l])  # [tokens, H_q, D]
        torch.testing.assert_close(st.qbar[l].double(), q.mean(0), atol=1e-5, rtol=1e-5)
        mag = torch.sqrt(q[..., :half] ** 2 + q[..., half:] ** 2).mean(0)
        torch.testing.assert_close(st.mbar[l].double(), mag, atol=1e-5, rtol=1e-5)
    assert st.meta["tokens"] == 3 * 48 and st.meta["sequences"] == 3
    assert (st.meta["num_layers"], st.meta["num_heads"], st.meta["num_kv_heads"], st.meta["head_dim"]) == (2, 4, 2, 16)
    assert bool((st.mbar > 0).all())


@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                          "original_max_position_embeddings": 1024}])
def test_stats_rotary_parameters_reproduce_the_models_queries(rope):
    """Rotating the captured pre-RoPE queries with the saved inv_freq and attention_scaling gives
    exactly the post-RoPE queries the model computes (so the score rotates qbar like the model)."""
    from randattn.testing import tiny_model

    overrides = {} if rope is None else {"rope_parameters": rope}
    model = tiny_model("qwen3", **overrides)
    inv_freq, scaling = rotary_parameters(model)
    if rope is not None:
        assert scaling != 1.0  # yarn scales cos/sin
    ids = random_ids(1, 30, seed=3)
    _, attn = attention_modules(model)[1]
    captured = {}

    def grab(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        captured["pre"] = recompute_queries(module, hidden, None, rotate=False)
        captured["post"] = recompute_queries(module, hidden, kwargs["position_embeddings"])

    h = attn.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        h.remove()
    pre, post = captured["pre"][0], captured["post"][0]  # [H_q, T, D]
    for t in (0, 7, 29):
        for head in range(pre.shape[0]):
            torch.testing.assert_close(_hf_rope(pre[head, t], t, inv_freq, scaling).float(), post[head, t], atol=1e-5, rtol=1e-5)


def test_calibrate_cli_text_and_traces(tmp_path, capsys):
    from randattn.testing import tiny_model, tiny_tokenizer

    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    tok = tiny_tokenizer(tmp_path / "tok")
    words = " ".join(f"w{(i * 37) % 250}" for i in range(300))
    (tmp_path / "corpus.txt").write_text(words)
    rows = [{"text": " ".join(f"w{(i * 11 + k) % 250}" for i in range(40)), "id": k} for k in range(3)]
    (tmp_path / "traces.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    out = tmp_path / "text.pt"
    st = calibrate_main(["--model", str(tmp_path / "model"), "--tokenizer", str(tmp_path / "tok"), "--out", str(out),
                         "--text", str(tmp_path / "corpus.txt"), "--tokens", "250", "--max-length", "100",
                         "--device", "cpu", "--quiet"])
    loaded = load_stats(out)
    assert loaded.meta["tokens"] == 250 and loaded.meta["sequences"] == 3  # 100 + 100 + 50
    torch.testing.assert_close(loaded.qbar, st.qbar)
    ids = torch.tensor(tok(words)["input_ids"])
    direct = calibrate(model, [ids[:100], ids[100:200], ids[200:250]], progress=False)
    torch.testing.assert_close(loaded.qbar, direct.qbar, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(loaded.mbar, direct.mbar, atol=1e-6, rtol=1e-5)
    assert "corpus.txt" in loaded.meta["source"]

    out2 = tmp_path / "traces.pt"
    calibrate_main(["--model", str(tmp_path / "model"), "--tokenizer", str(tmp_path / "tok"), "--out", str(out2),
                    "--traces", str(tmp_path / "traces.jsonl"), "--device", "cpu", "--quiet"])
    assert load_stats(out2).meta["tokens"] == 120 and load_stats(out2).meta["sequences"] == 3

    (tmp_path / "bad.jsonl").write_text('{"txt": "w1 w2"}\n')
    capsys.readouterr()
    with pytest.raises(SystemExit):  # a usage error, checked before the model loads
        calibrate_main(["--model", str(tmp_path / "model"), "--tokenizer", str(tmp_path / "tok"), "--out",
                        str(tmp_path / "x.pt"), "--traces", str(tmp_path / "bad.jsonl"), "--quiet"])
    assert 'has no string "text" field' in capsys.readouterr().err and not (tmp_path / "x.pt").exists()


def test_calibrate_help_documents_every_flag():
    text = build_parser().format_help()
    for flag in ("--model", "--tokenizer", "--out", "--text", "--traces", "--tokens", "--max-length", "--device",
                 "--seed", "--quiet"):
        assert flag in text
    action_help = {a.dest: a.help for a in build_parser()._actions}
    assert all(action_help.values()), action_help


# -- 3. physical-eviction oracle -------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("aggregate", ["max", "mean"])
def test_oracle_triattention(tiny, arch, aggregate):
    model = tiny(arch)
    stats = calibrate(model, _calib_ids(), progress=False)
    ids = random_ids(2, 160, seed=1)
    cache = randattn.EvictingCache("triattention", budget=24, buffer=8, keep_log=True, seed=5, stats=stats,
                                   aggregate=aggregate)
    got = randattn.replay_tokenwise(model, ids, cache, prompt_len=10)
    assert min(cache.events) >= 10, "the test must run many rounds"
    assert_matches_masked_reference(model, ids, got, cache.keep_log)
    # It is not recency in disguise: some head keeps an old non-prompt position a recency cache drops.
    kept = cache.positions(0)
    assert bool(((kept >= 10) & (kept < 160 - 24)).any())


def test_replay_equals_token_by_token_under_triattention(tiny):
    model = tiny("llama")
    stats = calibrate(model, _calib_ids(), progress=False)
    ids = random_ids(2, 150, seed=4)
    c1 = randattn.EvictingCache("triattention", budget=30, buffer=7, keep_log=True, stats=stats)
    c2 = randattn.EvictingCache("triattention", budget=30, buffer=7, keep_log=True, stats=stats)
    slow = randattn.replay_tokenwise(model, ids, c1, prompt_len=11)
    fast = randattn.replay(model, ids, c2, prompt_len=11)
    assert c1.events == c2.events and min(c1.events) > 5
    assert all((a == b).all() for a, b in zip(c1.keep_log.kept, c2.keep_log.kept))
    torch.testing.assert_close(fast.logprobs, slow.logprobs, atol=1e-5, rtol=0, equal_nan=True)


# -- 4. prompt protection --------------------------------------------------------------------------
def test_prompt_is_never_evicted_under_triattention(tiny):
    model = tiny("qwen3")
    stats = calibrate(model, _calib_ids(), progress=False)
    ids = random_ids(2, 200, seed=8)
    p = 14

    def run(protect):
        cache = randattn.EvictingCache("triattention", budget=24, buffer=8, keep_log=True, stats=stats,
                                       protect_prompt=protect)
        randattn.replay(model, ids, cache, prompt_len=p)
        assert min(cache.events) >= 10
        missing = 0
        for kept in cache.keep_log.kept:  # [B, H_kv, K] per (layer, round)
            for b in range(kept.shape[0]):
                for h in range(kept.shape[1]):
                    missing += len(set(range(p)) - set(kept[b, h].tolist()))
        return missing

    assert run(True) == 0
    assert run(False) > 0  # the check has teeth: unprotected, TriAttention does drop prompt positions


# -- 5. errors -------------------------------------------------------------------------------------
def test_without_stats_it_binds_to_the_shipped_ones_or_refuses_the_model_before_anything_is_stored(tiny):
    from types import SimpleNamespace

    from transformers import LlamaConfig

    policy = randattn.make_policy("triattention")  # building it needs nothing: bind() finds or refuses statistics
    with pytest.raises(ValueError) as err:
        policy.bind(tiny("llama"))
    msg = str(err.value)
    assert "needs TriAttention statistics" in msg and "python -m randattn.calibrate --model" in msg and "stats=" in msg
    with pytest.raises(ValueError, match="has no statistics"):  # scoring unbound says what to do, too
        policy.score(_view(torch.randn(1, 2, 6, 16), seq_len=6))
    cache = randattn.EvictingCache("triattention", budget=20, buffer=4)
    with pytest.raises(ValueError, match="needs TriAttention statistics"):  # the cache binds at its first forward
        randattn.replay(tiny("llama"), random_ids(1, 40), cache, prompt_len=4)
    assert cache.get_seq_length() == 0
    # a model randattn loaded from its embedded files (its ModelRef says so) gets the shipped statistics (a weightless
    # stand-in here, marked the way load_model marks the models it loads)
    smollm = randattn.ModelRef.of("smollm2-135m").attach(SimpleNamespace(config=LlamaConfig(
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)))
    assert randattn.ModelRef.of_model(smollm).embedded == "smollm2-135m"
    bound = randattn.make_policy("triattention").bind(smollm)
    assert bound.stats == "smollm2-135m" and bound._stats.num_layers == 30
    assert randattn.make_policy("triattention").calibration == "stats" and not bound.uses_seed


def test_missing_file_and_unknown_name(tmp_path):
    missing = tmp_path / "nope" / "stats.pt"
    with pytest.raises(FileNotFoundError, match="nope"):
        randattn.EvictingCache("triattention", budget=32, buffer=8, stats=str(missing))
    with pytest.raises(FileNotFoundError, match="shipped") as err:
        randattn.EvictingCache("triattention", budget=32, buffer=8, stats="no-such-model")
    assert "python -m randattn.calibrate" in str(err.value)
    torch.save([1, 2, 3], tmp_path / "junk.pt")
    with pytest.raises(ValueError, match="TriAttention statistics"):
        randattn.EvictingCache("triattention", budget=32, buffer=8, stats=str(tmp_path / "junk.pt"))


def test_bad_options():
    st = _stats(torch.ones(1, 2), torch.ones(1, 1), torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="aggregate"):
        randattn.EvictingCache("triattention", budget=8, buffer=4, stats=st, aggregate="median")
    with pytest.raises(ValueError, match="offsets"):
        randattn.EvictingCache("triattention", budget=8, buffer=4, stats=st, offsets=[])
    with pytest.raises(ValueError, match="offsets"):
        randattn.EvictingCache("triattention", budget=8, buffer=4, stats=st, offsets=[1, -2])


def test_wrong_shape_stats_are_named(tiny, tmp_path):
    from randattn.testing import tiny_model

    stats = calibrate(tiny("llama"), _calib_ids(n=1), progress=False)  # 2 layers, 4 q heads, 2 kv heads, dim 16
    stats.save(tmp_path / "s.pt")
    # statistics of another shape are refused when the cache binds to the model, before anything is stored
    other = tiny_model("llama", head_dim=8)
    cache = randattn.EvictingCache("triattention", budget=20, buffer=4, stats=str(tmp_path / "s.pt"))
    with pytest.raises(ValueError, match=r"head_dim 16 \(model has 8\)"):
        randattn.replay(other, random_ids(1, 40), cache, prompt_len=4)
    assert cache.get_seq_length() == 0
    deeper = tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"num_layers 2 \(model has 3\)"):
        randattn.EvictingCache("triattention", budget=20, buffer=4, stats=stats).bind(deeper)
    with pytest.raises(ValueError, match="num_kv_heads 2 \\(model has 4\\)"):
        randattn.replay(tiny_model("llama", num_key_value_heads=4), random_ids(1, 40),
                        randattn.EvictingCache("triattention", budget=20, buffer=4, stats=stats), prompt_len=4)
    # a view of another shape is refused at scoring too (a cache used without randattn's forward hook)
    policy = randattn.make_policy("triattention", stats=stats)
    with pytest.raises(ValueError, match="head_dim 8 but the statistics have head_dim 16"):
        policy.score(_view(torch.randn(1, 2, 6, 8), seq_len=6))
    with pytest.raises(ValueError, match="layer 2 but the statistics cover 2 layers"):
        policy.score(_view(torch.randn(1, 2, 6, 16), seq_len=6, layer_idx=2))
    # check_stats compares everything up front
    with pytest.raises(ValueError, match=r"num_layers 2 \(model has 3\)"):
        check_stats(stats, deeper)
    with pytest.raises(ValueError, match=r"head_dim 16 \(model has 8\)"):
        check_stats(str(tmp_path / "s.pt"), other)
    assert check_stats(stats, tiny("llama")) is stats


# -- shipped file ----------------------------------------------------------------------------------
def test_shipped_stats_resolve_by_name_and_are_small():
    shipped = shipped_stats()
    assert "smollm2-135m" in shipped
    assert shipped["smollm2-135m"].stat().st_size < 256 * 1024
    st = load_stats("smollm2-135m")
    assert load_stats("smollm2").qbar.equal(st.qbar)  # the embedded model's aliases resolve too
    assert (st.num_layers, st.num_heads, st.num_kv_heads, st.head_dim, st.rotary_dim) == (30, 9, 3, 64, 64)
    assert st.meta["model_type"] == "llama" and st.meta["tokens"] >= 1000
    assert bool(torch.isfinite(st.qbar).all()) and bool((st.mbar > 0).all())
    conc = st.concentration()
    assert bool((conc <= 1 + 1e-5).all())  # |mean| <= mean |.| (triangle inequality)


# -- 6. the embedded model -------------------------------------------------------------------------
@pytest.mark.slow
def test_embedded_model_generates_and_replays_with_shipped_stats(embedded):
    model, tok = embedded
    check_stats("smollm2-135m", model)
    msgs = [{"role": "user", "content": "What is 23 * 47? Think step by step."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    k, r, new = 64, 16, 100
    assert ids.shape[1] < k
    cache = randattn.EvictingCache("triattention", budget=k, buffer=r)  # binds to the shipped statistics by itself
    out = randattn.generate(model, ids, cache, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    assert out.shape[1] == ids.shape[1] + new and cache.policy.stats == "smollm2-135m"
    rounds = (ids.shape[1] + new - 1 - k) // r
    assert rounds >= 3 and cache.events == [rounds] * 30
    assert cache.physical_length(0) < k + r
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert len(set(out[0, ids.shape[1]:].tolist())) > 10, text  # not a degenerate repetition

    rep_cache = randattn.EvictingCache("triattention", budget=k, buffer=r, stats="smollm2-135m", keep_log=True)
    rep = randattn.replay(model, out, rep_cache, prompt_len=ids.shape[1])
    assert rep_cache.events == [(ids.shape[1] + new - k) // r] * 30  # replay also feeds the last token
    # Replay sees the cache greedy decoding saw: its greedy predictions reproduce the generated text.
    agree = (rep.argmax[0, ids.shape[1]:] == out[0, ids.shape[1]:]).float().mean().item()
    assert agree > 0.95, agree
    for kept in rep_cache.keep_log.kept:
        for h in range(kept.shape[1]):
            assert set(range(ids.shape[1])) <= set(kept[0, h].tolist())
