import functools
import os

# Nothing in the suite may reach a model hub: CI has no network beyond package registries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The README runs the suite on two pytest-xdist workers (`-n 2`); each gets one torch thread, since two workers of two
# threads each on 2 cores slow each other (subprocesses the tests start inherit it).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from randattn.testing import tiny_model


@functools.lru_cache(maxsize=None)
def _tiny(arch: str):
    return tiny_model(arch, seed=0)


@pytest.fixture
def tiny():
    """tiny(arch) -> a cached tiny random-weight model of that architecture."""
    return _tiny


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct on CPU, loaded once per session."""
    import randattn

    model, tok = randattn.load_model(device="cpu")
    return model, tok


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, embedded):
    """A tiny 3-KV-head Llama saved with SmolLM2's tokenizer, loadable by path (``--model DIR``) like any HF
    model: the probes' command lines end to end in seconds."""
    tok = embedded[1]
    d = tmp_path_factory.mktemp("tiny3")
    model = tiny_model("llama", vocab_size=len(tok), num_attention_heads=6, num_key_value_heads=3, hidden_size=96,
                       num_hidden_layers=2, head_dim=16)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def random_ids(batch: int, length: int, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)


def logprobs_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(x_t | x_<t) for t >= 1 from full-sequence logits ``[B, T, V]``."""
    lp = torch.log_softmax(logits.float(), -1)
    return torch.gather(lp[:, :-1], -1, ids[:, 1:, None])[..., 0]


def assert_matches_masked_reference(model, ids, result, keep_log, atol: float = 1e-5) -> None:
    """The physical-eviction oracle: ``result`` (a ReplayResult of decoding ``ids`` through an
    evicting cache) equals one uncached forward with the positions the keep-log evicted masked
    per layer and KV head; and, so the check has teeth, differs from plain full attention."""
    from randattn.reference import masked_forward_logits

    ref = masked_forward_logits(model, ids, keep_log)
    torch.testing.assert_close(result.logprobs[:, 1:], logprobs_of(ref, ids), atol=atol, rtol=0)
    assert torch.equal(result.argmax[:, 1:], ref[:, :-1].argmax(-1))
    full = model(ids).logits
    assert (logprobs_of(full, ids) - result.logprobs[:, 1:]).abs().max() > 1e-2, "eviction changed nothing"
