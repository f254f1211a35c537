"""Robustness of the core: bad input is refused with a message naming the parameter and the fix, and loses nothing.

1. a reused EvictingCache through plain ``model.generate``; 2. selector specs (code execution, once per process,
no ``sys.path`` change, failures as ValueErrors); 3. seeds, keep-mask ranges, max_position_embeddings; 4. devices,
model paths and hub ids, the converted-model cache of the embedded model.
"""

import copy
import json
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import transformers

import randattn
from randattn import models
from randattn.testing import tiny_model

from conftest import random_ids
from test_invariants import _feed


def _fresh_model(**overrides):
    """A tiny model of its own (tests here mutate per-model state: the warned-once flag, wrappers)."""
    return tiny_model("llama", **overrides)


def _snapshot(cache):
    return (cache.get_seq_length(), cache.prompt_len, cache.events,
            [None if l.positions is None else l.positions.clone() for l in cache.layers])


def _same(a, b):
    return a[:3] == b[:3] and len(a[3]) == len(b[3]) and all(
        (x is None and y is None) or torch.equal(x, y) for x, y in zip(a[3], b[3]))


# -- 1. a reused cache through plain model.generate ------------------------------------------------------------------

@pytest.mark.parametrize("keyword", ["past_key_values", "cache"])
@pytest.mark.parametrize("same_prompt", [False, True])
def test_plain_generate_refuses_a_used_cache(keyword, same_prompt):
    model = _fresh_model()
    a, b = random_ids(1, 10, seed=1), random_ids(1, 10, seed=2)
    cache = randattn.EvictingCache("random", budget=32, buffer=8)
    model.generate(a, past_key_values=cache, max_new_tokens=4, do_sample=False)
    before = _snapshot(cache)
    with pytest.raises(ValueError) as err:
        model.generate(a if same_prompt else b, **{keyword: cache}, max_new_tokens=4, do_sample=False)
    msg = str(err.value)
    assert f"model.generate({keyword}=...)" in msg and "already holds a sequence of 13 tokens" in msg
    assert "Create a fresh EvictingCache per call, or call cache.reset()" in msg
    assert _same(_snapshot(cache), before)  # nothing changed


def test_reset_makes_a_used_cache_serve_a_new_prompt_like_a_fresh_one():
    model = _fresh_model()
    a, b = random_ids(1, 10, seed=1), random_ids(1, 10, seed=2)
    cache = randattn.EvictingCache("random", budget=16, buffer=4, seed=3)
    model.generate(a, past_key_values=cache, max_new_tokens=20, do_sample=False)
    cache.reset()
    again = model.generate(b, past_key_values=cache, max_new_tokens=20, do_sample=False)
    fresh = randattn.EvictingCache("random", budget=16, buffer=4, seed=3)
    assert torch.equal(again, model.generate(b, past_key_values=fresh, max_new_tokens=20, do_sample=False))
    assert torch.equal(cache.positions(0), fresh.positions(0)) and cache.total_events > 0


def test_install_guards_wraps_generate_once_and_a_model_loaded_elsewhere_needs_it():
    config = randattn.testing.tiny_config("llama")
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    a, b = random_ids(1, 10, seed=1), random_ids(1, 10, seed=2)
    cache = randattn.EvictingCache("random", budget=32, buffer=8)
    plain.generate(a, past_key_values=cache, max_new_tokens=2, do_sample=False)
    plain.generate(b, past_key_values=cache, max_new_tokens=2, do_sample=False)  # unguarded: silently continues `a`
    randattn.install_guards(plain)
    randattn.install_guards(plain)  # idempotent: one wrapper, not a wrapper of a wrapper
    wrapped = plain.__dict__["generate"]
    assert wrapped.__func__ is models._guarded_generate and "_randattn_inner_generate" not in plain.__dict__
    with pytest.raises(ValueError, match="already holds a sequence"):
        plain.generate(b, past_key_values=cache, max_new_tokens=2)
    twin = copy.deepcopy(plain)  # the copy's guard calls the copy, not the original
    assert twin.generate.__self__ is twin
    ok = randattn.EvictingCache("random", budget=32, buffer=8)
    assert twin.generate(b, past_key_values=ok, max_new_tokens=2, do_sample=False).shape == (1, 12)
    assert "install_guards(model)" in models.install_guards.__doc__ and "not**" in models.install_guards.__doc__


def test_a_forward_that_failed_part_way_marks_the_cache_used():
    # Plain generate's prefill fixes prompt_len, then the budget check refuses it: that stale prompt length would
    # protect 20 positions of the next, shorter prompt, so the cache counts as used until reset.
    model = _fresh_model()
    cache = randattn.EvictingCache("random", budget=16, buffer=4)
    with pytest.raises(ValueError, match="cannot hold the protected prompt of 20 tokens"):
        model.generate(random_ids(1, 20), past_key_values=cache, max_new_tokens=2)
    with pytest.raises(ValueError, match="already used by a forward \\(it fixed prompt_len=20\\).*cache.reset"):
        randattn.generate(model, random_ids(1, 8), cache, max_new_tokens=2)
    cache.reset()
    randattn.generate(model, random_ids(1, 8), cache, max_new_tokens=2)
    assert cache.prompt_len == 8


def test_replay_refusing_a_prompt_leaves_the_cache_fresh():
    model = _fresh_model()
    cache = randattn.EvictingCache("random", budget=16, buffer=4)
    with pytest.raises(ValueError, match="cannot hold the protected prompt of 14 tokens"):
        randattn.replay(model, random_ids(1, 30), cache, prompt_len=14)
    assert cache.prompt_len is None and cache.get_seq_length() == 0
    assert torch.isfinite(randattn.replay(model, random_ids(1, 30), cache, prompt_len=8).logprobs[0, 1:]).all()
    with pytest.raises(ValueError, match="randattn.replay: this EvictingCache already holds a sequence of 30"):
        randattn.replay(model, random_ids(1, 30), cache, prompt_len=8)


# -- 2. selector specs ----------------------------------------------------------------------------------------------

COUNTED = textwrap.dedent('''
    import os
    with open(os.environ["RANDATTN_TEST_LOG"], "a") as f:
        f.write("ran\\n")
    state = []

    def newest(view):
        state.append(view.round_idx)
        return view.positions.float()
''')


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    """A working directory of selector files; modules it adds to sys.modules are removed afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANDATTN_TEST_LOG", str(tmp_path / "log.txt"))
    before = set(sys.modules)
    path_before = list(sys.path)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith(("h2sel", "h2pkg", "h2exit", "h2boom")):
            del sys.modules[name]
    assert sys.path == path_before, "loading a selector spec changed sys.path"


def _runs(tmp_path):
    log = tmp_path / "log.txt"
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.mark.parametrize("form", ["module", "file", "relative file", "both"])
def test_a_spec_runs_its_file_once_per_process(workdir, form):
    (workdir / "h2sel_counted.py").write_text(COUNTED)
    specs = {"module": ["h2sel_counted:newest"], "file": [f"{workdir}/h2sel_counted.py:newest"],
             "relative file": ["./h2sel_counted.py:newest"],
             "both": ["h2sel_counted:newest", f"{workdir}/h2sel_counted.py:newest"]}[form]
    model = _fresh_model()
    for i in range(5):
        cache = randattn.EvictingCache(specs[i % len(specs)], budget=12, buffer=4)
        randattn.generate(model, random_ids(1, 6, seed=i), cache, max_new_tokens=12, do_sample=False)
    assert _runs(workdir) == 1
    policy = randattn.make_policy(specs[0])
    assert len(policy.fn.__globals__["state"]) > 5  # module state kept across caches, not reset by a rerun


def test_a_module_next_to_the_working_directory_is_found_without_touching_sys_path(workdir):
    pkg = workdir / "h2pkg_sel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .inner import newest\n")
    (pkg / "inner.py").write_text("def newest(view):\n    return view.positions.float()\n")
    path_before = list(sys.path)
    assert randattn.make_policy("h2pkg_sel:newest").name == "h2pkg_sel:newest"
    assert randattn.make_policy("h2pkg_sel.inner:newest").fn is sys.modules["h2pkg_sel.inner"].newest
    assert sys.path == path_before and "" not in sys.path and "." not in sys.path
    # the module found in the working directory is the one `import` gives later: one module, not two copies
    import h2pkg_sel

    assert randattn.make_policy("h2pkg_sel:newest").fn is h2pkg_sel.newest


@pytest.mark.parametrize("where", ["module", "file"])
@pytest.mark.parametrize("body, message", [
    ("import sys\nsys.exit(3)\n", "called sys.exit()"),
    ("raise RuntimeError('no GPU for my selector')\n", "raised RuntimeError: no GPU for my selector"),
    ("raise ValueError('bad constant')\n", "raised ValueError: bad constant"),
])
def test_a_module_that_fails_or_exits_at_import_is_a_clear_error(workdir, where, body, message):
    (workdir / "h2exit_sel.py").write_text(body)
    spec = "h2exit_sel:score" if where == "module" else "h2exit_sel.py:score"
    with pytest.raises(ValueError) as err:
        randattn.EvictingCache(spec, budget=12, buffer=4)
    assert f"policy {spec!r}" in str(err.value) and message in str(err.value)
    assert "h2exit_sel" not in sys.modules  # a failed import is not kept half-made
    (workdir / "h2exit_sel.py").write_text("def score(view):\n    return view.positions.float()\n")
    assert randattn.make_policy(spec).name == spec  # fixed: it loads now, nothing stale was cached


@pytest.mark.parametrize("body, message", [
    ("raise RuntimeError('needs stats=')", "Boom\\(\\) raised RuntimeError: needs stats="),
    ("import sys; sys.exit(0)", "Boom\\(\\) called sys.exit\\(\\)"),
])
def test_a_selector_class_whose_constructor_fails_is_a_clear_error(workdir, body, message):
    (workdir / "h2boom_sel.py").write_text(textwrap.dedent(f'''
        import randattn
        class Boom(randattn.Policy):
            def __init__(self, stats=None):
                {body}
            def score(self, view):
                return view.positions.float()
    '''))
    with pytest.raises(ValueError, match=f"policy 'h2boom_sel:Boom': {message}.*takes \\['stats'\\]"):
        randattn.EvictingCache("h2boom_sel:Boom", budget=12, buffer=4)
    with pytest.raises(ValueError, match="Boom\\(sink=1\\) raised TypeError"):
        randattn.make_policy("h2boom_sel:Boom", sink=1)


def test_the_docstring_says_a_spec_is_code_execution():
    doc = randattn.load_policy.__doc__
    assert "code execution" in doc and "only load selectors you trust" in doc and "once per process" in doc


# -- 3. seeds, keep-mask ranges, max_position_embeddings ------------------------------------------------------------

@pytest.mark.parametrize("seed, message", [
    (1.7, "got 1.7 \\(float\\); pass a whole number"),
    (2.0, "got 2.0 \\(float\\)"),
    (True, "got True \\(bool\\)"),
    ("3", "got '3' \\(str\\)"),
    (-1, "got -1: seeds are mixed as 64 bits, so it would draw what 18446744073709551615 draws"),
    (2 ** 64, "got 18446744073709551616: seeds are mixed as 64 bits, so it would draw what 0 draws"),
])
def test_seeds_that_would_be_truncated_or_aliased_are_refused(seed, message):
    with pytest.raises(ValueError, match="seed must be an integer in \\[0, 2\\*\\*64\\), " + message):
        randattn.EvictingCache("random", budget=16, buffer=4, seed=seed)
    with pytest.raises(ValueError, match="seed must be an integer"):
        randattn.round_seed(seed, 0, 0)


def test_round_seed_refuses_fractional_indices_and_keeps_its_values():
    assert randattn.round_seed(0, 1, 2) == randattn.round_seed(0, 1, 2) and randattn.round_seed(2 ** 64 - 1, 0, 0) >= 0
    with pytest.raises(ValueError, match="round_seed: layer_idx must be a non-negative integer, got 1.5"):
        randattn.round_seed(0, 1.5, 0)
    with pytest.raises(ValueError, match="round_seed: round_idx must be a non-negative integer, got -2"):
        randattn.round_seed(0, 0, -2)


@pytest.mark.parametrize("driver", ["generate", "model.generate", "replay"])
@pytest.mark.parametrize("kind, kwargs, message", [
    ("layer", dict(layers=[99]), "pin\\(layers=\\[99\\]\\): layers \\[99\\] out of range: the model has 2 layers, "
                                 "valid indices 0..1"),
    ("head", dict(heads=[0, 5]), "pin\\(heads=\\[0, 5\\]\\): heads \\[5\\] out of range: the model has 2 KV heads, "
                                 "valid indices 0..1"),
])
def test_out_of_range_pins_are_refused_before_anything_is_stored(driver, kind, kwargs, message):
    model = _fresh_model()
    cache = randattn.EvictingCache("random", budget=16, buffer=4)
    cache.pin([1, 2], **kwargs)
    ids = random_ids(1, 8)
    with pytest.raises(ValueError, match=message):
        if driver == "generate":
            randattn.generate(model, ids, cache, max_new_tokens=20)
        elif driver == "model.generate":
            model.generate(ids, past_key_values=cache, max_new_tokens=20)
        else:
            randattn.replay(model, random_ids(1, 40), cache, prompt_len=8)
    assert cache.get_seq_length() == 0 and cache.prompt_len is None and all(not l.is_initialized for l in cache.layers)
    cache.clear_keep_masks()
    randattn.generate(model, ids, cache, max_new_tokens=2)  # the fix the message names works on the same cache


def test_once_the_shape_is_known_a_bad_pin_is_refused_at_once():
    model = _fresh_model()
    cache = randattn.EvictingCache("random", budget=16, buffer=4)
    randattn.generate(model, random_ids(1, 8), cache, max_new_tokens=2)
    with pytest.raises(ValueError, match="force_evict\\(layers=\\[2\\]\\): layers \\[2\\] out of range.*0..1"):
        cache.force_evict([3], layers=[2])
    with pytest.raises(ValueError, match="heads \\[2\\] out of range: the model has 2 KV heads"):
        cache.pin([3], heads=[2])
    assert cache._rules == []
    cache.pin([3], layers=[1], heads=[1])
    assert len(cache._rules) == 1


def test_without_the_hook_heads_are_checked_at_the_first_update_and_layers_at_the_second_forward():
    cache = randattn.EvictingCache("random", budget=12, buffer=4, protect_prompt=False)
    cache.pin([1], heads=[3])
    with pytest.raises(ValueError, match="heads \\[3\\] out of range: the model has 3 KV heads at layer 0"):
        _feed(cache, 0, 4, 1, 3)
    assert cache.get_seq_length() == 0 and cache.prompt_len is None  # refused before the layer stored anything
    cache = randattn.EvictingCache("random", budget=12, buffer=4, protect_prompt=False)
    cache.pin([1], layers=[5])
    for layer in range(2):
        _feed(cache, layer, 4, 1, 3)
    with pytest.raises(ValueError, match="layers \\[5\\] out of range: the model has 2 layers, valid indices 0..1"):
        _feed(cache, 0, 1, 1, 3)
    assert cache.get_seq_length() == 4


def test_keep_mask_indices_from_a_generator_are_all_checked():
    cache = randattn.EvictingCache("random", budget=12, buffer=4)
    cache.pin([1], heads=(h for h in [0, 1]))
    assert cache._rules[0].heads == frozenset({0, 1})
    with pytest.raises(ValueError, match="layers must be non-negative integer indices, got \\[True\\]"):
        cache.pin([1], layers=[True])


def _max_pos_warnings(record):
    return [str(w.message) for w in record if "max_position_embeddings" in str(w.message)]


@pytest.mark.parametrize("driver", ["generate", "replay", "decode_step"])
def test_a_sequence_past_max_position_embeddings_warns_once(driver):
    model = _fresh_model(max_position_embeddings=24)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            cache = randattn.EvictingCache("random", budget=12, buffer=4)
            if driver == "generate":
                randattn.generate(model, random_ids(1, 6), cache, max_new_tokens=30, do_sample=False)
            elif driver == "replay":
                randattn.replay(model, random_ids(1, 40), cache, prompt_len=6)
            else:
                logits = randattn.decode_step(model, random_ids(1, 6), cache)
                for _ in range(30):
                    logits = randattn.decode_step(model, logits[:, -1].argmax(-1, keepdim=True), cache)
    got = _max_pos_warnings(record)
    assert len(got) == 1, got
    assert "past this model's max_position_embeddings=24" in got[0] and "Keep prompt + new tokens <= 24" in got[0]


def test_no_warning_within_max_position_embeddings():
    model = _fresh_model(max_position_embeddings=24)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        randattn.generate(model, random_ids(1, 6), randattn.EvictingCache("random", budget=12, buffer=4),
                          max_new_tokens=18, do_sample=False)  # 24 tokens: the last one is at position 23
    assert _max_pos_warnings(record) == []


# -- 4. devices, paths, hub ids, the converted cache ------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_a_gpu_names_the_fix(monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="asked for CUDA, but this machine has no usable GPU.*--device cpu or "
                                         "--device auto"):
        randattn.resolve_device(device)
    monkeypatch.setattr(models, "converted_embedded", lambda name: pytest.fail("loaded before checking the device"))
    with pytest.raises(ValueError, match="no usable GPU"):
        randattn.load_model(device=device)


def test_a_cuda_index_this_machine_lacks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="'cuda:3': this machine has 1 CUDA device\\(s\\), cuda:0..cuda:0"):
        randattn.resolve_device("cuda:3")
    with pytest.raises(ValueError, match="holds no data"):
        randattn.resolve_device("meta")


def test_calibrate_turns_a_bad_device_into_a_message(monkeypatch, tmp_path):
    from randattn.calibrate import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as err:
        main(["--device", "cuda", "--out", str(tmp_path / "s.pt")])
    assert "randattn.calibrate: device 'cuda' asked for CUDA" in str(err.value.code)
    assert not (tmp_path / "s.pt").exists()


def test_a_missing_model_directory_is_named(tmp_path):
    missing = tmp_path / "models" / "nope"
    for name in (str(missing), "path/that/does/not/exist", "./nope"):
        with pytest.raises(FileNotFoundError, match=f"model directory '{name}' does not exist"):
            randattn.load_model(name)


def test_a_directory_without_config_is_named_and_left_alone(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="directory .* has no config.json \\(it holds model.safetensors\\)"):
        randattn.load_model(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    with pytest.raises(FileNotFoundError, match="is a file, not a directory"):
        randattn.load_model(str(tmp_path / "model.safetensors"))


def test_a_hub_id_that_cannot_be_reached_offline_is_told_apart_from_a_missing_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "someorg").mkdir()
    with pytest.raises(OSError) as err:
        randattn.load_model("someorg/no-such-model-h2")
    msg = str(err.value)
    assert "is no local directory" in msg and "a folder 'someorg' is there, but holds no 'no-such-model-h2'" in msg
    assert "hub downloads are off (HF_HUB_OFFLINE" in msg and "does not exist" not in msg

    def unreachable(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(models, "_hub_offline", lambda: False)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", unreachable)
    with pytest.raises(OSError, match="as a hub id it could not be fetched \\(no network, a misspelt id"):
        randattn.load_model("someorg/other")


SHA = models._EMBEDDED["smollm2-135m"][3]


def _fake_checkpoint(folder: Path, sha: str = SHA, manifest: bool = True) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.zeros(4)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "tokenizer_config.json").write_text("{}")
    if manifest:
        files = {p.name: p.stat().st_size for p in folder.iterdir()}
        (folder / models._MANIFEST).write_text(json.dumps({"source_sha256": sha, "files": files}))
    (folder / models._MARKER).write_text(sha + "\n")


@pytest.fixture()
def converted(tmp_path, monkeypatch):
    """(target folder, builds) with the conversion replaced by a fake one that records its calls."""
    monkeypatch.setenv("RANDATTN_CACHE", str(tmp_path))
    builds = []

    def fake_build(name, target):
        builds.append(target)
        import shutil

        if target.exists():
            shutil.rmtree(target)
        _fake_checkpoint(target)

    monkeypatch.setattr(models, "_build_embedded", fake_build)
    return tmp_path / "smollm2-135m", builds


@pytest.mark.parametrize("manifest", [True, False])
def test_a_sound_converted_cache_is_used_as_is(converted, manifest):
    target, builds = converted
    _fake_checkpoint(target, manifest=manifest)
    assert models.converted_embedded("smollm2-135m") == target and builds == []


@pytest.mark.parametrize("damage, reason", [
    (lambda t: (t / "model.safetensors").unlink(), "model.safetensors is missing"),
    (lambda t: (t / models._MARKER).write_text("0" * 64 + "\n"), "converted from a GGUF with sha256 0000"),
    (lambda t: (t / "model.safetensors").write_bytes((t / "model.safetensors").read_bytes()[:-4]),
     "model.safetensors has .* bytes, the manifest recorded"),
    (lambda t: (t / "config.json").write_text("{"), "config.json has 1 bytes|config.json is not valid JSON"),
    (lambda t: (t / models._MANIFEST).write_text("[]"), "MANIFEST.json is unreadable"),
    (lambda t: (t / models._MARKER).unlink(), "SOURCE_SHA256 is missing"),
])
def test_a_damaged_converted_cache_is_rebuilt_not_trusted(converted, damage, reason):
    target, builds = converted
    _fake_checkpoint(target)
    damage(target)
    with pytest.warns(UserWarning, match=f"converted smollm2-135m in .* is damaged \\(.*({reason})"):
        assert models.converted_embedded("smollm2-135m") == target
    assert builds == [target] and models._converted_problem(target, SHA) is None


def test_a_legacy_cache_with_a_truncated_weights_file_is_rebuilt(converted):
    target, builds = converted
    _fake_checkpoint(target, manifest=False)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])
    with pytest.warns(UserWarning, match="model.safetensors is truncated or padded"):
        models.converted_embedded("smollm2-135m")
    assert builds == [target]


def test_a_foreign_folder_in_place_of_the_converted_cache_is_refused_untouched(converted):
    target, builds = converted
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="was not made by randattn \\(no SOURCE_SHA256 marker\\).*RANDATTN_CACHE"):
        models.converted_embedded("smollm2-135m")
    assert builds == [] and [p.name for p in target.iterdir()] == ["notes.txt"]
