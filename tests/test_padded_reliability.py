"""Padded batches and the core's refusals (issue 38): each case used to crash, run silently wrong, or fail deep inside
torch; each is now exact per row, or refused with one line naming the fix.

- TriAttention (one keep-set per KV head shared by all layers) in a padded batch whose rows round at the same step,
  and in an unpadded batch with row keys: each row as its prompt alone. An unprotected prompt of T + r tokens or
  more is the refusal its message promises, before anything is stored.
- VaSE in a sampled padded batch with row keys: each row as its prompt alone given that row's own tokens.
- A plain model whose attention modules are wrapped deeper than the old stack walk saw: a padded batch is refused.
- A plain ALiBi model (Bloom) handed to its own ``model.generate`` with a cache: refused at the first update.
- A selector that calls ``sys.exit(0)`` or ``sys.exit(3)``: the failure of that policy, named; a probe exits 2 and
  keeps its rows.
- An absurd budget, float or out-of-range ``input_ids``, complex scores: one line naming the parameter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers as tf
from torch import nn
from transformers import AutoModelForCausalLM

import randattn
from randattn.models import UnsupportedModelError
from randattn.testing import tiny_config

from conftest import random_ids
from test_padded_batches import _left_pad, _prompts, _same_keep_sets, stats_for  # noqa: F401  (a fixture)

REPO = Path(__file__).resolve().parents[1]


def _alone(model, prompt, policy, key, kw, new):
    cache = randattn.EvictingCache(policy, row_keys=None if key is None else [key], **kw)
    out = randattn.generate(model, prompt[None], cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                            pad_token_id=0)
    return out[0, len(prompt):], cache


# -- TriAttention ---------------------------------------------------------------------------------------------------
# Six prompts whose paddings differ by multiples of r = 8 within rows 0-2 and within rows 3-5, so several rows are due
# at the same step in different states: the layer-shared score was memoised for one row group only, and the later
# layers rescored the others from the first layer already compacted (index -1 of a dead slot, or wrong keep-sets).
TRI_LENGTHS = (30, 22, 14, 27, 19, 11)


@pytest.mark.parametrize("row_keys", [None, [5, 6, 7, 8, 9, 10]])
def test_triattention_rows_that_round_together_run_as_their_prompts_alone(tiny, stats_for, row_keys):  # noqa: F811
    model = tiny("llama")
    prompts = _prompts(model.config.vocab_size, TRI_LENGTHS)
    ids, mask = _left_pad(prompts)
    kw = dict(budget=40, buffer=8, keep_log=True, stats=stats_for(model))
    new = 60
    cache = randattn.EvictingCache("triattention", row_keys=row_keys, **kw)
    out = randattn.generate(model, ids, cache, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, pad_token_id=0)
    assert min(cache.layers[0].row_rounds) >= 3
    for i, prompt in enumerate(prompts):
        tokens, alone = _alone(model, prompt, "triattention", None if row_keys is None else row_keys[i], kw, new)
        assert torch.equal(out[i, ids.shape[1]:], tokens), f"row {i}: tokens differ from alone"
        assert _same_keep_sets(cache.keep_log.row(i), alone.keep_log), f"row {i}: keep-sets differ from alone"


def test_triattention_rows_with_row_keys_in_an_unpadded_batch_run_as_alone(tiny, stats_for):  # noqa: F811
    """Every row rounds at the same step here, each its own group: the same memo bug, silently wrong keep-sets."""
    model = tiny("qwen3")
    prompts = _prompts(model.config.vocab_size, (24, 24, 24))
    kw = dict(budget=40, buffer=8, keep_log=True, stats=stats_for(model))
    cache = randattn.EvictingCache("triattention", row_keys=[1, 2, 3], **kw)
    out = randattn.generate(model, torch.stack(prompts), cache, max_new_tokens=50, min_new_tokens=50,
                            do_sample=False, pad_token_id=0)
    assert min(cache.events) >= 3
    for i, prompt in enumerate(prompts):
        tokens, alone = _alone(model, prompt, "triattention", i + 1, kw, 50)
        assert torch.equal(out[i, 24:], tokens), f"row {i}: tokens differ from alone"
        for got, want in zip(cache.keep_log.kept, alone.keep_log.kept):
            assert (got[i] == want[0]).all(), f"row {i}: keep-sets differ from alone"


def test_triattention_refuses_an_unprotected_prompt_of_t_plus_r_or_more(tiny, stats_for):  # noqa: F811
    model = tiny("llama")
    ids = random_ids(1, 60)
    kw = dict(budget=40, buffer=8, protect_prompt=False, stats=stats_for(model))
    for call in (lambda c: randattn.generate(model, ids, c, max_new_tokens=8, do_sample=False, pad_token_id=0),
                 lambda c: randattn.decode_step(model, ids, c)):
        cache = randattn.EvictingCache("triattention", **kw)
        with pytest.raises(ValueError, match=r"policy 'triattention' scores all layers at once .* an unprotected "
                                             r"prompt of 60 tokens .*per-layer variant \(shared_layers=False\)"):
            call(cache)
        assert cache.get_seq_length() == 0, "refused only after storing the prompt"
    # The per-layer variant takes the same prompt.
    per_layer = randattn.EvictingCache("triattention", shared_layers=False, **kw)
    randattn.generate(model, ids, per_layer, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert min(per_layer.events) >= 1


# -- VaSE in a sampled padded batch ------------------------------------------------------------------------------------
def _tokenwise_alone(model, prompt, tokens, policy, key, kw):
    """The prompt alone fed the row's own tokens one per forward, as generate fed them (all but the last)."""
    cache = randattn.EvictingCache(policy, row_keys=[key], **kw)
    randattn.decode_step(model, prompt[None], cache)
    for t in tokens[:-1]:
        randattn.decode_step(model, t.view(1, 1), cache)
    return cache


def test_vase_rows_of_a_sampled_padded_batch_keep_what_their_prompts_alone_keep(tiny):
    """Unprotected prompts, sampled: a prompt token generated again has at layer 0 the value of its copy up to one
    rounding (prefill matmul vs decode matmul, of other shapes in the batch than alone), and VaSE's value-range top
    set broke that tie by the batch (row 3 here, layer 0, round 5). Its draw was per row key all along."""
    model = tiny("qwen3")
    prompts = _prompts(model.config.vocab_size, (27, 30, 41, 51, 52, 3), seed=1)
    ids, mask = _left_pad(prompts)
    keys = [100, 101, 102, 103, 104, 105]
    for policy in ("vase", "random", "snapkv"):
        kw = dict(budget=24, buffer=4, keep_log=True, protect_prompt=False)
        cache = randattn.EvictingCache(policy, row_keys=keys, **kw)
        torch.manual_seed(1)
        out = randattn.generate(model, ids, cache, attention_mask=mask, max_new_tokens=95, min_new_tokens=95,
                                do_sample=True, pad_token_id=0)
        for i, prompt in enumerate(prompts):
            alone = _tokenwise_alone(model, prompt, out[i, ids.shape[1]:], policy, keys[i], kw)
            assert _same_keep_sets(cache.keep_log.row(i), alone.keep_log), f"{policy} row {i}: keep-sets differ"


# -- the padding guard on a deeply wrapped plain model ---------------------------------------------------------------
class _Wrap(nn.Module):
    """A pass-through wrapper: each level adds three frames between the attention and the model's forward."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def _plain_wrapped(depth: int):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa", dtype=torch.float32)
    for layer in model.model.layers:
        attn = layer.self_attn
        for _ in range(depth):
            attn = _Wrap(attn)
        layer.self_attn = attn
    return model.eval()


@pytest.mark.parametrize("depth", [8, 12])
def test_a_deeply_wrapped_plain_model_is_refused_a_padded_batch(depth):
    model = _plain_wrapped(depth)
    ids, mask = _left_pad(_prompts(model.config.vocab_size))
    cache = randattn.EvictingCache("recency", budget=40, buffer=8)
    with pytest.raises(ValueError, match=r"randattn does not guard.*randattn\.install_guards\(model\)"):
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8, do_sample=False,
                       pad_token_id=0)
    assert cache.get_seq_length() == 0
    # Unpadded it runs as before; guarded, the padded row equals its prompt alone.
    plain = randattn.EvictingCache("recency", budget=16, buffer=4, protect_prompt=False)
    model.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), past_key_values=plain, max_new_tokens=24,
                   do_sample=False, pad_token_id=0)
    assert min(plain.events) >= 1
    randattn.install_guards(model)
    guarded = randattn.EvictingCache("recency", budget=40, buffer=8)
    out = model.generate(ids, attention_mask=mask, past_key_values=guarded, max_new_tokens=56, min_new_tokens=56,
                         do_sample=False, pad_token_id=0)
    alone = model.generate(ids[1:2, 11:], past_key_values=randattn.EvictingCache("recency", budget=40, buffer=8),
                           max_new_tokens=56, min_new_tokens=56, do_sample=False, pad_token_id=0)
    assert min(guarded.events) >= 1 and torch.equal(out[1, ids.shape[1]:], alone[0, 19:])


def test_a_model_seen_without_its_mask_is_refused():
    """The model is on the stack only where its mask is out of sight (a module call frame holding the model but not
    the mask): refused with the fix, not trusted."""
    model = _plain_wrapped(0)
    keys = torch.zeros(1, model.config.num_key_value_heads, 4, model.config.head_dim)
    cache = randattn.EvictingCache("recency", budget=40, buffer=8)

    def _call_impl(self, *args, **kwargs):  # named as torch's module call, holding the model, no attention_mask
        return cache.update(keys, keys, 0)

    with pytest.raises(ValueError, match=r"cannot see the attention mask of the model it serves \(LlamaForCausalLM, "
                                         r"which randattn does not guard\).*randattn\.install_guards\(model\)"):
        _call_impl(model)
    assert cache.get_seq_length() == 0
    cache.update(keys, keys, 0)  # called from no model at all (a test, a custom driver): stored as before
    assert cache.get_seq_length() == 4


# -- ALiBi on a plain model --------------------------------------------------------------------------------------------
def test_a_plain_alibi_model_given_to_its_own_generate_is_refused_at_the_first_update():
    torch.manual_seed(0)
    config = tf.BloomConfig(n_head=4, n_layer=2, hidden_size=64, vocab_size=256, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()  # no randattn guards
    cache = randattn.EvictingCache("random", budget=16, buffer=4, protect_prompt=False)
    with pytest.raises(UnsupportedModelError, match=r"^bloom: its attention adds ALiBi"):
        model.generate(random_ids(1, 20), past_key_values=cache, max_new_tokens=10, do_sample=False)
    assert cache.get_seq_length() == 0
    # A rotary plain model still generates through its own generate.
    llama = _plain_wrapped(0)
    ok = randattn.EvictingCache("random", budget=16, buffer=4, protect_prompt=False)
    llama.generate(random_ids(1, 20), past_key_values=ok, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert min(ok.events) >= 1


# -- a selector that exits ---------------------------------------------------------------------------------------------
EXITING = textwrap.dedent('''
    import os
    import sys

    import torch

    CALLS = [0]


    def exits(view):
        CALLS[0] += 1
        if CALLS[0] > int(os.environ.get("SEL_AFTER", "0")):
            sys.exit(int(os.environ.get("SEL_CODE", "0")))
        return torch.rand(view.shape, generator=view.generator, device=view.keys.device)
''')


@pytest.mark.parametrize("code", [0, 3])
def test_a_selector_calling_sys_exit_is_a_named_failure_of_that_policy(tiny, code):
    model = tiny("llama")

    def exits(view):
        sys.exit(code)

    cache = randattn.EvictingCache(exits, budget=16, buffer=4)
    with pytest.raises(RuntimeError, match=rf"policy 'exits' failed at layer 0, round 0: it called sys\.exit\({code}\)"):
        randattn.generate(model, random_ids(1, 8), cache, max_new_tokens=24, do_sample=False)

    def interrupted(view):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # Ctrl-C stays Ctrl-C
        randattn.generate(model, random_ids(1, 8), randattn.EvictingCache(interrupted, budget=16, buffer=4),
                          max_new_tokens=24, do_sample=False)


@pytest.mark.parametrize("code", [0, 3])
def test_head_pooling_with_a_selector_calling_sys_exit_exits_2_keeping_rows(tiny_dir, tmp_path, code):
    (tmp_path / "exiting.py").write_text(EXITING)
    out = tmp_path / "hp"
    argv = [sys.executable, "-m", "probes.head_pooling", "--model", tiny_dir, "--out", str(out), "--budget", "64",
            "--buffer", "12", "--distance", "90", "--batch", "1", "--parity", "0", "--instances", "2", "--no-figure",
            "--policy", f"{tmp_path / 'exiting.py'}:exits"]
    env = {**os.environ, "SEL_AFTER": "40", "SEL_CODE": str(code), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    last = proc.stderr.rstrip().splitlines()[-1]
    assert ": error: --policy: " in last and "exiting.py:exits' failed at layer " in last, last
    assert f"sys.exit({code})" in last and "rerun the same command" in last, last
    rows = [json.loads(line) for p in out.glob("*.jsonl") for line in p.read_text().splitlines()]
    assert rows, "the rows computed before the exit were lost"


# -- absurd budgets, bad input_ids, complex scores ---------------------------------------------------------------------
def test_a_budget_no_device_can_preallocate_is_refused_naming_it(tiny):
    model = tiny("llama")
    cache = randattn.EvictingCache("random", budget=10**12, buffer=64)
    with pytest.raises(randattn.SpecError, match=r"^budget T=1000000000000 is too large: each layer preallocates room "
                                                 r"for T \+ r = 1,000,000,000,064 pairs per KV head") as err:
        randattn.generate(model, random_ids(1, 8), cache, max_new_tokens=3, do_sample=False)
    assert err.value.field == "budget" and "\n" not in str(err.value)
    assert cache.get_seq_length() == 0
    big = randattn.EvictingCache("random", budget=10**5, buffer=64)  # large but allocatable: runs, never evicts
    randattn.generate(model, random_ids(1, 8), big, max_new_tokens=3, do_sample=False)
    assert big.total_events == 0


@pytest.mark.parametrize("where", ["randattn.generate", "randattn.replay", "randattn.decode_step"])
def test_bad_input_ids_are_refused_naming_the_parameter(tiny, where):
    model = tiny("llama")
    vocab = model.get_input_embeddings().num_embeddings
    calls = {"randattn.generate": lambda ids, c: randattn.generate(model, ids, c, max_new_tokens=3),
             "randattn.replay": lambda ids, c: randattn.replay(model, ids, c, prompt_len=2),
             "randattn.decode_step": lambda ids, c: randattn.decode_step(model, ids, c)}
    ids = random_ids(1, 6)
    for bad, message in ((ids.float(), r"input_ids must hold integer token ids \(torch\.long\), got a torch\.float32"),
                         (ids.bool(), r"input_ids must hold integer token ids \(torch\.long\), got a torch\.bool"),
                         (ids.clone().index_fill_(1, torch.tensor([3]), vocab),
                          rf"input_ids holds token id {vocab}, outside the model's vocabulary \(ids 0\.\.{vocab - 1}\)"),
                         (ids.clone().index_fill_(1, torch.tensor([0]), -1), r"input_ids holds token id -1, outside")):
        cache = randattn.EvictingCache("random", budget=16, buffer=4)
        with pytest.raises(ValueError, match=rf"^{where}: {message}"):
            calls[where](bad, cache)
        assert cache.get_seq_length() == 0


def test_complex_scores_are_refused_naming_the_policy(tiny):
    def complex_scores(view):
        return torch.rand(view.shape, generator=view.generator).to(torch.complex64)

    with pytest.raises(ValueError, match=r"policy 'complex_scores' returned complex scores \(torch\.complex64\) at "
                                         r"layer 0, round 0"):
        randattn.generate(tiny("llama"), random_ids(1, 8), randattn.EvictingCache(complex_scores, budget=16, buffer=4),
                          max_new_tokens=24, do_sample=False)
