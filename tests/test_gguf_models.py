"""A local GGUF file as the model (``randattn.load_model("x.gguf")``, ``--model x.gguf``): dequantised and converted
once, the way the embedded default is, into ``cache_root()/gguf/<sha256 of the file>``; refusals of files that are no
GGUF. The GGUF is written here from a tiny random Llama (llama.cpp's tensor names and q/k layout, fp32), so the
loaded model must give the tiny model's own logits."""

import os
import shutil

import numpy as np
import pytest
import torch

import randattn
from randattn import models
from randattn.testing import tiny_model

gguf = pytest.importorskip("gguf")

VOCAB = 256
MERGES = ["h e", "l l"]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py's permute), which transformers undoes on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model) -> None:
    """``model`` (a tiny Llama) as an fp32 GGUF file with a byte-level BPE tokenizer of ``VOCAB`` tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    specials = ["<pad>", "<s>", "</s>"]
    tokens = specials + list(bytes_to_unicode().values())[:VOCAB - 3 - len(MERGES)] + [m.replace(" ", "")
                                                                                         for m in MERGES]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))  # 3: control
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


IDS = torch.tensor([[5, 9, 33, 70, 100, 200, 17, 3]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def tiny_pair():
    """Two tiny random Llamas with different weights (seeds 0 and 1), the same shapes."""
    return tiny_model("llama", seed=0), tiny_model("llama", seed=1)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RANDATTN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_local_gguf_loads_as_the_model_it_holds(tmp_path, cache, tiny_pair):
    src = tmp_path / "models" / "tiny-llama.gguf"
    src.parent.mkdir()
    (src.parent / "config.json").write_text("{not read: the GGUF's own metadata is the config}")
    write_gguf(src, tiny_pair[0])
    model, tok = randattn.load_model(str(src), device="cpu")
    torch.testing.assert_close(_logits(model), _logits(tiny_pair[0]), rtol=0, atol=1e-5)
    sha = models._sha256(src)
    folder = cache / "gguf" / sha
    assert (folder / models._MARKER).read_text().strip() == sha and models._converted_problem(folder, sha) is None
    assert model.config.num_key_value_heads == 2 and model.dtype == torch.float32
    assert tok.decode(tok("hello")["input_ids"]) == "hello" and tok.eos_token == "</s>"
    ref = randattn.ModelRef.of_model(model)
    assert ref == randattn.ModelRef(str(src), str(src), f"sha256:{sha}", None)
    # A cached evicting run works on it like on any model.
    evicting = randattn.EvictingCache("random", budget=6, buffer=2, protect_prompt=False)
    out = randattn.generate(model, IDS, evicting, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (1, IDS.shape[1] + 8) and sum(evicting.events) > 0


def test_the_conversion_is_cached_by_content(tmp_path, cache, tiny_pair, monkeypatch):
    """Converted once per file content: a reload and a copy elsewhere reuse the folder (no conversion); the file
    replaced in place by other weights of the same size with its old mtime is converted afresh, never served the
    old weights (what a path + size + mtime key would do)."""
    src = tmp_path / "a.gguf"
    write_gguf(src, tiny_pair[0])
    randattn.load_model(str(src), device="cpu")
    reads = []
    real = models._read_gguf
    monkeypatch.setattr(models, "_read_gguf", lambda *a: reads.append(a) or real(*a))
    copy = tmp_path / "elsewhere" / "b.gguf"
    copy.parent.mkdir()
    shutil.copy(src, copy)
    for path in (src, copy):
        again, _ = randattn.load_model(str(path), device="cpu")
        torch.testing.assert_close(_logits(again), _logits(tiny_pair[0]), rtol=0, atol=1e-5)
    assert reads == [] and len(list((cache / "gguf").iterdir())) == 1

    stat = src.stat()
    write_gguf(src, tiny_pair[1])
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert src.stat().st_size == stat.st_size and src.stat().st_mtime_ns == stat.st_mtime_ns
    other, _ = randattn.load_model(str(src), device="cpu")
    torch.testing.assert_close(_logits(other), _logits(tiny_pair[1]), rtol=0, atol=1e-5)
    assert len(reads) == 1 and len(list((cache / "gguf").iterdir())) == 2


def test_a_damaged_conversion_is_rebuilt(tmp_path, cache, tiny_pair):
    src = tmp_path / "a.gguf"
    write_gguf(src, tiny_pair[0])
    folder = models.converted_gguf(src)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])
    with pytest.warns(UserWarning, match=r"converted a.gguf in .* is damaged \(model.safetensors has"):
        assert models.converted_gguf(src) == folder
    model, _ = randattn.load_model(str(src), device="cpu")
    torch.testing.assert_close(_logits(model), _logits(tiny_pair[0]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("content,error,needle", [
    (b"", ValueError, "is no GGUF file: it is empty"),
    (b"<html>404 Not Found</html>", ValueError, "is no GGUF file: it is starting with b'<htm'"),
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 12\n", ValueError, "a Git LFS pointer"),
])
def test_a_gguf_named_file_that_is_no_gguf_is_refused(tmp_path, cache, content, error, needle):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(content)
    with pytest.raises(error, match=needle):
        randattn.load_model(str(bad), device="cpu")
    assert not cache.exists()  # refused before anything was converted


def test_a_truncated_gguf_is_refused_naming_the_file(tmp_path, cache, tiny_pair):
    src = tmp_path / "whole.gguf"
    write_gguf(src, tiny_pair[0])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"could not read the GGUF file '.*cut.gguf' as a causal LM"):
        randattn.load_model(str(cut), device="cpu")
    assert not any((cache / "gguf").glob("[0-9a-f]*"))  # nothing half-converted is left to be trusted


def test_a_missing_gguf_path_and_other_files(tmp_path, cache):
    with pytest.raises(FileNotFoundError, match="GGUF file 'nowhere.gguf' does not exist"):
        randattn.load_model("nowhere.gguf", device="cpu")
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(FileNotFoundError, match="is a file, not a directory nor a GGUF file"):
        randattn.load_model(str(notes), device="cpu")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_gguf_is_refused_naming_it(tmp_path, cache):
    bad = tmp_path / "locked.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    bad.chmod(0)
    with pytest.raises(PermissionError, match="cannot read the model file .*locked.gguf"):
        randattn.load_model(str(bad), device="cpu")


def test_an_unreadable_gguf_is_refused_naming_it_even_as_root(tmp_path, cache, monkeypatch):
    """The same refusal where the mode cannot make a file unreadable (root): the read itself fails."""
    import builtins

    bad = tmp_path / "locked.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    real_open = builtins.open

    def deny(file, *args, **kwargs):
        if str(file) == str(bad):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", deny)
    with pytest.raises(PermissionError, match=r"cannot read the model file .*locked.gguf' \(Permission denied\)"):
        randattn.load_model(str(bad), device="cpu")


# -- figure titles name a local model by its base name, not its whole path ----------------------------------------
@pytest.mark.parametrize("given,label", [
    ("/home/me/checkpoints/tiny-llama", "tiny-llama"),
    ("./checkpoints/tiny-llama/", "tiny-llama"),
    ("/data/models/tiny.gguf", "tiny.gguf"),
    ("smollm2-135m", "smollm2-135m"),  # the shipped rows' name: their titles are what they were
    ("Qwen/Qwen3-4B", "Qwen3-4B"),  # as the accuracy figure always showed a hub id
])
def test_figure_titles_show_a_short_model_name(tmp_path, monkeypatch, given, label):
    pytest.importorskip("matplotlib")
    from figures import prompt_protection, style

    titles = []
    monkeypatch.setattr(style, "save", lambda fig, name, out_dir=None: titles.append(fig._suptitle.get_text()))
    row = {"model": given, "budget": 64, "buffer": 8, "n": 4, "digit_acc_score_only": 0.5,
           "digit_acc_protected": 0.75, "gain_lo": 0.0, "gain_hi": 0.5}
    prompt_protection.plot([{**row, "policy": "random"}, {**row, "policy": "recency"}], out_dir=tmp_path)
    assert titles == [f"Prompt protection: {label}, K=64, r=8; n=4; numbers: paired gain with 95% CI"]
    config = {"model": given, "budget": 64, "buffer": 8, "policy": "random", "protect_prompt": True}
    assert style.geometry(config) == f"{label}, K=64, r=8, background: random + prompt"


def test_a_grid_plans_a_local_gguf_and_names_a_bad_one(tmp_path, cache, tiny_pair):
    """probes.grid's model check reads a local GGUF the way load_model does (converted once), and a GGUF-named file
    that is no GGUF is a SpecError naming the key."""
    from probes.grid_spec import SpecError, check_model

    src = tmp_path / "tiny-llama.gguf"
    write_gguf(src, tiny_pair[0])
    info = check_model(str(src))
    assert info.config.num_key_value_heads == 2 and info.tokenizer.eos_token == "</s>"
    bad = tmp_path / "broken.gguf"
    bad.write_text("<html>not found</html>")
    with pytest.raises(SpecError, match=r"^models: .*broken\.gguf"):
        check_model(str(bad))
