"""Padded batches (issue 27): each row of a left-padded batch runs exactly as its prompt alone.

For every policy on tiny Llama, Qwen3 and Phi-3: the same generated tokens (deterministic policies; seeded ones with
row keys too) and the same keep-sets per layer, head and round as the prompt alone; the physical-eviction oracle
per row; pad ids that change nothing; row keys that make a draw independent of the batch; a plain HF model that
randattn does not guard refused before it generates; and every bad mask refused by name.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import randattn
from randattn.calibrate import calibrate
from randattn.reference import masked_forward_logits
from randattn.testing import tiny_config

from conftest import logprobs_of

ARCHS = ("llama", "qwen3", "phi3")
DETERMINISTIC = ("recency", "streamingllm", "h2o", "snapkv", "rkv", "rkv-official", "vase", "triattention")
LENGTHS = (30, 19, 25)  # row 0 unpadded, rows 1 and 2 padded by 11 and 5
NEW = 56


def _policies():
    return [p for p in randattn.known_policies()]


def _budget(policy: str) -> int:
    return 64 if policy in ("h2o", "snapkv-longbench") else 40  # these pin a recent window of their own too


def _kw(policy: str, model, stats_for) -> dict:
    kw = dict(budget=_budget(policy), buffer=8, keep_log=True)
    if policy == "triattention":
        kw["stats"] = stats_for(model)
    return kw


@pytest.fixture(scope="module")
def stats_for():
    made = {}

    def get(model):
        if id(model) not in made:
            g = torch.Generator().manual_seed(1)
            seqs = [torch.randint(3, model.config.vocab_size, (48,), generator=g) for _ in range(2)]
            made[id(model)] = calibrate(model, seqs, progress=False)
        return made[id(model)]

    return get


def _prompts(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def _left_pad(prompts, pad_id: int = 0):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    return ids, mask


def _same_keep_sets(a: randattn.KeepLog, b: randattn.KeepLog) -> bool:
    return (len(a) == len(b) and a.layers == b.layers and a.rounds == b.rounds and a.seq_lens == b.seq_lens
            and all(x.shape == y.shape and (x == y).all() for x, y in zip(a.kept, b.kept)))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy", _policies())
def test_each_row_of_a_padded_batch_runs_as_its_prompt_alone(tiny, stats_for, arch, policy):
    model = tiny(arch)
    prompts = _prompts(model.config.vocab_size)
    ids, mask = _left_pad(prompts)
    keys = [101, 202, 303]
    kw = _kw(policy, model, stats_for)
    cache = randattn.EvictingCache(policy, row_keys=keys, **kw)
    out = randattn.generate(model, ids, cache, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                            do_sample=False, pad_token_id=0)
    assert cache.pads == [0, 11, 5] and cache.prompt_lens == list(LENGTHS)
    rounds = [layer.row_rounds for layer in cache.layers]
    assert all(r == rounds[0] for r in rounds) and min(rounds[0]) >= 1, rounds  # every row evicted, at its own pace
    assert len(set(rounds[0])) > 1  # ... and the rows' rounds did not line up (shorter prompts start later)
    for i, prompt in enumerate(prompts):
        alone = randattn.EvictingCache(policy, row_keys=[keys[i]], **kw)
        ref = randattn.generate(model, prompt[None], alone, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                min_new_tokens=NEW)
        assert torch.equal(out[i, ids.shape[1]:], ref[0, len(prompt):]), f"row {i}: tokens differ from alone"
        assert _same_keep_sets(cache.keep_log.row(i), alone.keep_log), f"row {i}: keep-sets differ from alone"
        for record in cache.keep_log.row(i).kept:
            assert record.min() >= 0  # no padding kept, positions in the row's own coordinates


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy", ["recency", "streamingllm", "snapkv", "random"])
def test_the_pad_token_id_changes_nothing(tiny, arch, policy):
    """The sweep's finding: changing only the pad id changed tokens from about the 31st on."""
    model = tiny(arch)
    ids, mask = _left_pad(_prompts(model.config.vocab_size))
    outs = []
    for pad_id in (0, 7, 99):
        padded = torch.where(mask.bool(), ids, torch.full_like(ids, pad_id))
        cache = randattn.EvictingCache(policy, budget=40, buffer=8)
        outs.append(randattn.generate(model, padded, cache, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                      pad_token_id=0, min_new_tokens=NEW)[:, ids.shape[1]:])
        assert min(cache.events) >= 3
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy", ["random", "snapkv", "streamingllm"])
def test_padded_batch_matches_the_masked_reference_per_row(tiny, arch, policy):
    """The physical-eviction oracle, per row: teacher-forcing a padded batch through the cache (a manual loop with
    the prompt's mask) gives each row the logits of one uncached forward of that row alone with the positions its
    keep-log evicted masked, within the oracle's usual 1e-5; and eviction changed them."""
    model = tiny(arch)
    prompts = _prompts(model.config.vocab_size)
    ids, mask = _left_pad(prompts)
    g = torch.Generator().manual_seed(5)
    cont = torch.randint(3, model.config.vocab_size, (len(prompts), 40), generator=g)
    cache = randattn.EvictingCache(policy, budget=40, buffer=8, keep_log=True, row_keys=[1, 2, 3])
    steps = [randattn.decode_step(model, ids, cache, attention_mask=mask)[:, -1:]]
    for t in range(cont.shape[1] - 1):
        steps.append(randattn.decode_step(model, cont[:, t : t + 1], cache))
    logits = torch.cat(steps, dim=1)  # predictions for cont[:, 0..]
    assert min(cache.events) >= 3
    for i, prompt in enumerate(prompts):
        seq = torch.cat([prompt, cont[i]])[None]
        ref = masked_forward_logits(model, seq, cache.keep_log.row(i))
        lp = logprobs_of(logits[i : i + 1], cont[i : i + 1])  # log p(cont[t] | ...), t >= 1
        want = logprobs_of(ref[:, len(prompt) - 1 :], cont[i : i + 1])
        torch.testing.assert_close(lp, want, atol=1e-5, rtol=0)
        full = logprobs_of(model(seq).logits[:, len(prompt) - 1 :], cont[i : i + 1])
        assert (full - lp).abs().max() > 1e-2, "eviction changed nothing"


def test_row_keys_make_a_draw_independent_of_the_batch(tiny):
    model = tiny("llama")
    a, b, c = _prompts(model.config.vocab_size, (24, 24, 24))
    kw = dict(budget=32, buffer=8, keep_log=True, protect_prompt=False)

    def run(rows, keys):
        cache = randattn.EvictingCache("random", row_keys=keys, **kw)
        randattn.generate(model, torch.stack(rows), cache, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                          pad_token_id=0)
        return cache.keep_log

    one = run([a, b, c], [7, 8, 9])
    moved = run([c, a, b], [9, 7, 8])  # the same prompts and keys in other rows
    alone = run([a], [7])
    for k_one, k_moved, k_alone in zip(one.kept, moved.kept, alone.kept):
        assert (k_one[0] == k_moved[1]).all() and (k_one[0] == k_alone[0]).all()
        assert (k_one[2] == k_moved[0]).all()
    # The same prompt under two keys, and the legacy whole-batch draw (no keys), differ: the check has teeth.
    twice = run([a, a], [7, 70])
    assert any((k[0] != k[1]).any() for k in twice.kept)
    legacy = randattn.EvictingCache("random", **kw)
    randattn.generate(model, torch.stack([b, a]), legacy, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                      pad_token_id=0)
    assert any((k_l[1] != k_alone[0]).any() for k_l, k_alone in zip(legacy.keep_log.kept, alone.kept))
    # String keys (request ids) work the same way.
    s1, s2 = run([a, b], ["req-a", "req-b"]), run([b, a], ["req-b", "req-a"])
    assert all((x[0] == y[1]).all() for x, y in zip(s1.kept, s2.kept))


def test_the_whole_batch_draw_without_row_keys_is_what_it_was(tiny):
    """No row keys, no padding: the draw is the one every shipped result ran (one generator per (seed, layer,
    round) for the whole batch), so shipped rows do not move."""
    model = tiny("llama")
    ids = torch.stack(_prompts(model.config.vocab_size, (24, 24)))
    cache = randattn.EvictingCache("random", budget=32, buffer=8, keep_log=True, protect_prompt=False)
    randattn.generate(model, ids, cache, max_new_tokens=24, do_sample=False, pad_token_id=0, min_new_tokens=24)
    layer, round_idx, kept = cache.keep_log.layers[0], cache.keep_log.rounds[0], cache.keep_log.kept[0]
    g = torch.Generator().manual_seed(randattn.round_seed(0, layer, round_idx))
    u = torch.rand((2, kept.shape[1], 32 + 8 - 8), generator=g)
    want = u.topk(32 - 8, dim=-1).indices.sort(-1).values
    assert (torch.from_numpy(kept[:, :, : 32 - 8]).long() == want).all()


def test_a_plain_hf_model_is_refused_a_padded_batch_before_it_generates():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa", dtype=torch.float32)
    model.eval()  # no randattn guards on it
    ids, mask = _left_pad(_prompts(model.config.vocab_size))
    cache = randattn.EvictingCache("random", budget=40, buffer=8)
    with pytest.raises(ValueError, match="randattn does not guard.*install_guards"):
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8, do_sample=False,
                       pad_token_id=0)
    assert cache.get_seq_length() == 0  # refused before anything was stored
    four_d = torch.ones(ids.shape[0], 1, ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="4D attention mask"):
        model(input_ids=ids, attention_mask=four_d, past_key_values=randattn.EvictingCache("random", budget=40, buffer=8))
    # Unpadded batches keep working on it, and the guard makes padded ones exact.
    plain = randattn.EvictingCache("random", budget=16, buffer=4, protect_prompt=False)
    model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=plain, max_new_tokens=24, do_sample=False,
                   pad_token_id=0)
    assert min(plain.events) >= 1
    randattn.install_guards(model)
    guarded = randattn.EvictingCache("recency", budget=40, buffer=8)
    out = model.generate(ids, attention_mask=mask, past_key_values=guarded, max_new_tokens=NEW, do_sample=False,
                         pad_token_id=0)
    alone = model.generate(ids[1:2, 11:], past_key_values=randattn.EvictingCache("recency", budget=40, buffer=8),
                           max_new_tokens=NEW, do_sample=False, pad_token_id=0, min_new_tokens=NEW)
    assert torch.equal(out[1, ids.shape[1]:], alone[0, 19:])


def test_a_manual_decode_loop_with_the_mask_equals_generate(tiny):
    model = tiny("qwen3")
    ids, mask = _left_pad(_prompts(model.config.vocab_size))
    cache = randattn.EvictingCache("snapkv", budget=40, buffer=8)
    out = randattn.generate(model, ids, cache, attention_mask=mask, max_new_tokens=40, min_new_tokens=40,
                            do_sample=False, pad_token_id=0)
    loop = randattn.EvictingCache("snapkv", budget=40, buffer=8)
    logits = randattn.decode_step(model, ids, loop, attention_mask=mask)
    got = []
    for _ in range(40):
        logits[..., model.generation_config.eos_token_id] = float("-inf")  # as min_new_tokens does in generate
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        got.append(nxt)
        logits = randattn.decode_step(model, nxt, loop)
    assert torch.equal(torch.cat(got, 1), out[:, ids.shape[1]:])
    assert loop.events == cache.events


def _mask(rows):
    return torch.tensor(rows)


@pytest.mark.parametrize("mask, message", [
    (_mask([[1, 1, 1, 0], [1, 1, 1, 1]]), r"rows \[0\] are not left-padded"),
    (_mask([[0, 1, 0, 1], [1, 1, 1, 1]]), r"rows \[0\] are not left-padded"),
    (_mask([[0, 0, 0, 0], [1, 1, 1, 1]]), r"rows \[0\] are all padding"),
    (_mask([[1, 1, 1], [1, 1, 1]]), r"attention_mask must match input_ids \(2, 4\)"),
    (_mask([[0.5, 1, 1, 1], [1, 1, 1, 1]]), "only 0 .pad. and 1"),
])
def test_a_bad_padding_mask_is_refused_by_name_before_generating(tiny, mask, message):
    model = tiny("llama")
    ids = torch.randint(3, 100, (2, 4))
    cache = randattn.EvictingCache("random", budget=16, buffer=4)
    with pytest.raises(ValueError, match=message):
        randattn.generate(model, ids, cache, attention_mask=mask, max_new_tokens=4, pad_token_id=0)
    assert cache.get_seq_length() == 0


def test_padded_batch_bad_inputs(tiny):
    model = tiny("llama")
    ids, mask = _left_pad(_prompts(model.config.vocab_size))
    with pytest.raises(ValueError, match="cannot hold the protected prompt of 30 tokens"):  # the longest row decides
        randattn.generate(model, ids, randattn.EvictingCache("random", budget=30, buffer=4), attention_mask=mask)
    with pytest.raises(ValueError, match="row_keys has 2 keys but the batch has 3 rows"):
        randattn.generate(model, ids, randattn.EvictingCache("random", budget=40, buffer=8, row_keys=[1, 2]),
                          attention_mask=mask)
    with pytest.raises(ValueError, match="prompt_len=30 with a padded batch"):
        randattn.generate(model, ids, randattn.EvictingCache("random", budget=40, buffer=8, prompt_len=30),
                          attention_mask=mask)
    for bad in (-1, 1.5, True, None, [1]):
        with pytest.raises(ValueError, match=r"row_keys\[0\] must be a string .a request id. or an integer"):
            randattn.EvictingCache("random", budget=40, buffer=8, row_keys=[bad])
    with pytest.raises(ValueError, match="row_keys must be a sequence"):
        randattn.EvictingCache("random", budget=40, buffer=8, row_keys="abc")
    cache = randattn.EvictingCache("random", budget=40, buffer=8)
    randattn.decode_step(model, ids, cache, attention_mask=mask)
    with pytest.raises(ValueError, match="attention_mask has padding after the prompt"):
        step_mask = torch.cat([mask, torch.zeros(3, 1, dtype=torch.long)], 1)
        randattn.decode_step(model, ids[:, :1], cache, attention_mask=step_mask)
    with pytest.raises(ValueError, match=r"attention_mask is shaped \(3, 5\)"):
        randattn.decode_step(model, ids[:, :1], cache, attention_mask=torch.ones(3, 5, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="beam search"):
        randattn.generate(model, ids, randattn.EvictingCache("random", budget=40, buffer=8), attention_mask=mask,
                          num_beams=2, max_new_tokens=NEW, pad_token_id=0)
