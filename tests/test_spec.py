"""EvictionSpec (one eviction setting, checked once, the one prompt-fits rule) and randattn.attach (guards for a block).

A spec refuses what EvictingCache refuses, with the same words; its caches equal the caches built by hand; its full
attention is the never-evicting cache the accuracy probe always ran. attach installs the guards for a block and
leaves the model as it found it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

import randattn
from randattn import EvictionSpec
from randattn.spec import min_budget, prompt_fits_problem
from randattn.testing import tiny_config


def _error(make) -> str:
    with pytest.raises(ValueError) as info:
        make()
    return str(info.value)


# -- construction ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, field", [
    (dict(budget=0), "budget"),
    (dict(budget=None), "budget"),
    (dict(budget=True), "budget"),
    (dict(budget=128, buffer=0), "buffer"),
    (dict(budget=64), "budget T=64 must exceed the recent window"),
    (dict(budget=128, recent=128), "recent"),
    (dict(budget=128, recent=-1), "recent"),
    (dict(budget=128, seed=-1), "seed"),
    (dict(policy="attn", budget=128, protect_prompt=True), "protect_prompt"),
    (dict(policy="nope", budget=128), "unknown policy 'nope'"),
    (dict(budget=128, options={"n_sink": 4}), "does not take option(s) ['n_sink']"),
    (dict(policy="triattention", budget=128, recent=0), "recent >= 1"),
])
def test_bad_fields_are_refused_at_construction_with_the_caches_words(kw, field):
    spec_msg = _error(lambda: EvictionSpec(**kw))
    assert field in spec_msg
    cache_kw = dict(kw)
    policy = cache_kw.pop("policy", "random")
    options = cache_kw.pop("options", {})
    assert spec_msg == _error(lambda: randattn.EvictingCache(policy, **cache_kw, **options))


def test_options_must_be_a_mapping_of_names():
    assert "options must be a mapping" in _error(lambda: EvictionSpec("random", 128, options=[("n_sink", 4)]))


@pytest.mark.parametrize("policy, protect, expected", [
    ("random", None, True), ("random", False, False), ("attn", None, False), ("attn_pp", None, True),
    ("random_pcap", None, False), ("recency", True, True),
])
def test_protection_and_recent_resolve_as_the_cache_does(policy, protect, expected):
    spec = EvictionSpec(policy, 256, 32, protect_prompt=protect)
    cache = spec.make_cache()
    assert spec.protects_prompt is cache.protect_prompt is expected
    assert spec.recent_window == cache.recent == 32
    assert spec.policy_object.name == cache.policy.name
    assert spec.policy_object is not cache.policy  # each cache its own instance (policies may keep state)
    assert EvictionSpec(policy, 256, 32, recent=0, protect_prompt=protect).make_cache().recent == 0


def test_the_spec_is_frozen_and_replace_checks_again():
    spec = EvictionSpec("random", 256, options={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.budget = 512
    with pytest.raises(TypeError):
        spec.options["x"] = 1  # a read-only view: the spec cannot change under its caches
    assert dataclasses.replace(spec, budget=512).make_cache().budget == 512
    assert "budget" in _error(lambda: dataclasses.replace(spec, budget=0))
    assert spec == EvictionSpec("random", 256)


def test_stats_go_to_the_calibration_option_only():
    tri = EvictionSpec("triattention", 256, stats="stats.pt-placeholder", options={"stats": None})
    assert tri.cache_options == {"stats": None}  # an explicit option wins over the run's stats
    assert EvictionSpec("random", 256, stats="stats.pt").cache_options == {}  # random reads none
    assert EvictionSpec("triattention", 256).cache_options == {}
    with pytest.raises(FileNotFoundError):  # the file is read when the policy is resolved, at construction
        EvictionSpec("triattention", 256, stats="/nonexistent/stats.pt")


# -- the prompt-fits rule ---------------------------------------------------------------------------------------------
def test_validate_is_the_one_prompt_fits_rule():
    spec = EvictionSpec("random", 256, 64)
    assert min_budget(191, 64) == 256
    assert spec.validate(191) is None
    problem = spec.validate(192)
    assert "budget T=256" in problem and "protect_prompt=False" in problem and "budget >= 257" in problem
    assert EvictionSpec("random", 256, 64, protect_prompt=False).validate(10_000) is None
    assert EvictionSpec("random", 256, 64, recent=0).validate(255) is None
    assert EvictionSpec.full().validate(10_000) is None
    assert "prompt_len" in _error(lambda: spec.validate(-1))
    # the cache refuses a prompt with the very words validate returns
    assert _error(lambda: spec.make_cache(prompt_len=192)) == problem
    assert problem == prompt_fits_problem(192, budget=256, recent=64, protect=True)


def test_the_cache_refuses_at_the_prefill_with_the_same_rule(tiny):
    model = tiny("llama")
    spec = EvictionSpec("random", 24, 8)
    ids = torch.randint(3, 200, (1, 16))
    with pytest.raises(ValueError) as info:
        randattn.generate(model, ids, spec.make_cache(), max_new_tokens=2, do_sample=False)
    assert str(info.value) == spec.validate(16)
    assert spec.validate(15) is None


# -- caches ---------------------------------------------------------------------------------------------------------
def test_a_specs_cache_generates_what_a_hand_built_cache_does(tiny):
    model = tiny("llama")
    ids = torch.randint(3, 200, (2, 20), generator=torch.Generator().manual_seed(0))
    spec = EvictionSpec("random", 32, 8, seed=7)
    a = spec.make_cache(keep_log=True, row_keys=[1, 2])
    b = randattn.EvictingCache("random", budget=32, buffer=8, seed=7, keep_log=True, row_keys=[1, 2])
    out_a = randattn.generate(model, ids, a, max_new_tokens=40, do_sample=False, pad_token_id=0)
    out_b = randattn.generate(model, ids, b, max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert torch.equal(out_a, out_b) and min(a.events) >= 1
    assert len(a.keep_log) == len(b.keep_log) > 0
    assert all((x == y).all() for x, y in zip(a.keep_log.kept, b.keep_log.kept))


def test_full_is_a_cache_that_never_evicts(tiny):
    model = tiny("llama")
    ids = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(1))
    cache = EvictionSpec.full().make_cache(max_tokens=20 + 30)
    # the cache the accuracy probe has always built for its full arm, so its rows do not change
    assert (cache.budget, cache.buffer, cache.protect_prompt, cache.seed) == (51, 1, False, 0)
    out = randattn.generate(model, ids, cache, max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0)
    plain = model.generate(ids, max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0)
    assert sum(cache.events) == 0 and torch.equal(out, plain)
    assert "max_tokens" in _error(lambda: EvictionSpec.full().make_cache())
    assert EvictionSpec("full") == EvictionSpec.full() and EvictionSpec.full().is_full


@pytest.mark.parametrize("kw", [dict(budget=128), dict(recent=4), dict(protect_prompt=True), dict(options={"a": 1})])
def test_full_refuses_settings_it_would_ignore(kw):
    message = _error(lambda: EvictionSpec("full", **kw))
    assert "full attention" in message and next(iter(kw)) in message


def test_the_accuracy_probe_builds_its_caches_from_specs():
    from probes import accuracy as acc

    arm = acc.Arm("random", 300, True)
    cache = acc.make_cache(arm, prompt_len=100, max_new_tokens=50, buffer=16, seed=3, stats=None, options={})
    assert (cache.budget, cache.buffer, cache.seed, cache.protect_prompt) == (300, 16, 3, True)
    full = acc.make_cache(acc.Arm(acc.FULL, None, None), prompt_len=100, max_new_tokens=50, buffer=16, seed=3,
                          stats=None, options={}, row_keys=[1])
    assert (full.budget, full.buffer, full.row_keys) == (151, 1, None)


# -- attach ---------------------------------------------------------------------------------------------------------
def _plain_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa", dtype=torch.float32).eval()


def _padded(vocab: int):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in (30, 19)]
    ids = torch.zeros((2, 30), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, 30 - len(p):], mask[i, 30 - len(p):] = p, 1
    return prompts, ids, mask


def _state(model):
    hooks = {name: (list(m._forward_pre_hooks), list(m._forward_pre_hooks_with_kwargs)) for name, m in
             model.named_modules()}
    return hooks, set(model.__dict__), {name: set(m.__dict__) for name, m in model.named_modules()}


def _generate(model, ids, mask, cache):
    return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=40, min_new_tokens=40,
                          do_sample=False, pad_token_id=0)


def test_attach_guards_a_plain_model_for_the_block_and_leaves_it_as_it_was():
    model = _plain_model()
    prompts, ids, mask = _padded(model.config.vocab_size)
    before = _state(model)
    spec = EvictionSpec("snapkv", 40, 8)  # needs the query capture hooks too
    with randattn.attach(model) as attached:
        assert attached is model and model._randattn_guard_handle is not None
        batch = spec.make_cache()
        out = _generate(model, ids, mask, batch)
        assert min(batch.layers[0].row_rounds) >= 1  # each row evicted at its own pace
        alone = _generate(model, prompts[1][None], None, spec.make_cache())
    assert torch.equal(out[1, 30:], alone[0, 19:])  # the padded row is exact: as its prompt alone
    assert _state(model) == before
    assert "generate" not in model.__dict__ and not hasattr(model, "_randattn_guard_handle")
    with pytest.raises(ValueError, match="randattn does not guard"):
        _generate(model, ids, mask, spec.make_cache())


def test_attach_leaves_a_guarded_model_untouched_and_nests():
    model = _plain_model()
    prompts, ids, mask = _padded(model.config.vocab_size)
    before = _state(model)
    with randattn.attach(model):
        guarded = _state(model)
        handle = model._randattn_guard_handle
        with randattn.attach(model):
            assert model._randattn_guard_handle is handle
        assert _state(model) == guarded  # the inner block installed nothing, so removed nothing
        _generate(model, ids, mask, randattn.EvictingCache("recency", budget=40, buffer=8))
    assert _state(model) == before
    randattn.install_guards(model)  # the long-lived variant stays for good
    guarded = _state(model)
    with randattn.attach(model):
        pass
    assert _state(model) == guarded
    _generate(model, ids, mask, randattn.EvictingCache("recency", budget=40, buffer=8))


def test_attach_restores_someone_elses_generate_wrapper_and_cleans_up_on_error():
    model = _plain_model()
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return type(model).generate(model, *args, **kwargs)

    model.generate = wrapper
    before = _state(model)
    with pytest.raises(RuntimeError, match="inside"):
        with randattn.attach(model):
            model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
            raise RuntimeError("inside")
    assert calls == [1] and model.generate is wrapper and _state(model) == before


# -- refusals name their field; model identity ---------------------------------------------------------------------
@pytest.mark.parametrize("kw, field", [
    (dict(budget=0), "budget"), (dict(budget=128, buffer=0), "buffer"), (dict(budget=64), "budget"),
    (dict(budget=128, recent=128), "recent"), (dict(budget=128, seed=-1), "seed"),
    (dict(policy="attn", budget=128, protect_prompt=True), "protect_prompt"),
    (dict(policy="nope", budget=128), "policy"), (dict(budget=128, options={"n_sink": 4}), "options"),
    (dict(policy="triattention", budget=128, recent=0), "recent"),
    (dict(policy="full", budget=128), "budget"), (dict(budget=128, options=[("n_sink", 4)]), "options"),
])
def test_every_refusal_is_a_spec_error_naming_its_field(kw, field):
    with pytest.raises(randattn.SpecError) as info:
        EvictionSpec(**kw)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)  # what callers catch today still catches it


def test_bad_statistics_name_stats_not_options(tmp_path):
    garbage = tmp_path / "notes.txt"
    garbage.write_text("not statistics\n")
    with pytest.raises(randattn.SpecError) as info:
        EvictionSpec("triattention", 256, stats=str(garbage))
    assert info.value.field == "stats"


def test_a_prompt_that_does_not_fit_is_a_problem_naming_budget_and_the_smallest_fix():
    spec = EvictionSpec("random", 64, 8)
    problem = spec.validate(60)
    assert isinstance(problem, str) and problem.field == "budget" and problem.need == min_budget(60, 8) == 69
    with pytest.raises(randattn.SpecError) as info:
        spec.make_cache(prompt_len=60)
    assert info.value.field == "budget" and str(info.value) == problem


def test_model_ref_names_the_model_once():
    from randattn.models import embedded_name

    assert embedded_name(None) == embedded_name("SmolLM2-135M-Instruct") == embedded_name("smollm2") == "smollm2-135m"
    assert embedded_name("Qwen/Qwen3-4B") is None
    ref = randattn.ModelRef.of()
    assert (ref.name, ref.embedded, ref.path) == ("smollm2-135m", "smollm2-135m", None) and ref.revision
    hub = randattn.ModelRef.of("Qwen/Qwen3-4B")
    assert (hub.embedded, hub.path) == (None, None)


def test_load_model_gives_the_model_its_ref(tmp_path, tiny):
    model = tiny("llama")
    model.save_pretrained(tmp_path)
    # the tiny model has no tokenizer: pass the embedded one's
    loaded, _ = randattn.load_model(str(tmp_path), tokenizer=randattn.load_model()[1], device="cpu")
    ref = randattn.ModelRef.of_model(loaded)
    assert (ref.name, ref.path, ref.embedded) == (str(tmp_path), str(tmp_path), None)
    assert randattn.ModelRef.of_model(model).embedded is None  # a model loaded another way: its config's name


def test_a_spec_pickles_as_the_same_setting():
    """Units cross into worker processes (probes.unit_pool) with their spec: unpickled, it is checked and resolved
    again, equal field for field, with the same cache options."""
    import pickle

    from randattn.spec import EvictionSpec

    for spec in (EvictionSpec("random", budget=64, buffer=8, protect_prompt=False, seed=5), EvictionSpec.full(),
                 EvictionSpec("streamingllm", budget=64, buffer=8, options={"n_sink": 2}),
                 EvictionSpec("triattention", budget=64, buffer=8, stats="smollm2-135m")):
        back = pickle.loads(pickle.dumps(spec))
        assert back == spec and back.cache_options == spec.cache_options and back.recent_window == spec.recent_window
