"""Request keys of the vLLM plugin (issue 39): a request sent without ``randattn_key`` is keyed by
``randattn.vllm.default_key(prompt token ids, SamplingParams.seed)``, the same from run to run, never by vLLM's
random request id; the HF engine given that key as its row key keeps the same pairs; keep-logs are named after the
key, a second request of the same key ``<key>+1.npz``; a bad key is refused for its request alone.

The key function and the file names run anywhere; the engine runs (``vllm``: two processes of
tests/vllm_engine_driver.py, one engine each) need the .venv-vllm environment and skip without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from randattn.seeding import check_row_key
from randattn.vllm import default_key, log_file_name
from randattn.vllm.keys import RequestNames, request_key
from tests.test_vllm_engine import VENV_PY, _assert_conforms, _drive, embedded  # noqa: F401  (the fixture)


# -- the key, anywhere ---------------------------------------------------------------------------------------------
def test_default_key_is_pinned_and_documented():
    """The documented formula, and its value pinned: a change would silently change every unkeyed request's draws."""
    import hashlib

    ids = [1, 2, 3]
    assert default_key(ids) == "ids-9db5f4d410570c374b9d541f81304c82"  # the value docs/vllm.md quotes
    assert default_key(ids) == "ids-" + hashlib.blake2b(b"1,2,3", digest_size=16).hexdigest()
    assert default_key(ids, 7) == default_key(ids) + "-seed-7"
    assert default_key(ids, 0) != default_key(ids)  # seed 0 is a seed, not "no seed"
    # the same ids however they are held
    assert default_key(tuple(ids)) == default_key(np.array(ids)) == default_key(torch.tensor(ids)) == default_key(ids)
    assert default_key([1, 2, 3, 4]) != default_key(ids) != default_key([3, 2, 1]) and default_key([12, 3]) != \
        default_key([1, 23])
    check_row_key(default_key(ids))  # a valid HF row key


@pytest.mark.parametrize("ids,seed,words", [
    ([], None, "is empty"), ("hello", None, "sequence of token ids"), ([[1, 2], [3, 4]], None, "one key per row"),
    ([1, -2], None, "non-negative ints"), ([1.0, 2.0], None, "non-negative ints"), ([1, 2], 1.5, "seed must be"),
    ([True], None, "non-negative ints")])
def test_default_key_refusals(ids, seed, words):
    with pytest.raises(ValueError, match=words):
        default_key(ids, seed)


def test_request_key_prefers_the_given_key_and_refuses_what_it_cannot_use():
    assert request_key({"randattn_key": "req-0"}, [5, 6], 3) == "req-0"
    assert request_key({"randattn_key": 7}, None, None) == 7  # a given key needs no token ids
    assert request_key(None, [5, 6], 3) == request_key({"randattn_key": None}, [5, 6], 3) == default_key([5, 6], 3)
    for bad in (1.5, -1, True, [1]):
        with pytest.raises(ValueError, match="randattn_key"):
            request_key({"randattn_key": bad}, [5, 6], None)
    with pytest.raises(ValueError, match="no prompt token ids.*randattn_key"):
        request_key({}, None, None)
    with pytest.raises(ValueError, match="multimodal inputs.*randattn_key"):
        request_key({}, [5, 6], None, other_inputs="multimodal inputs")


def test_log_names_follow_the_key_and_never_collide():
    assert log_file_name("req-0") == "req-0.npz" and log_file_name("req-0", 2) == "req-0+2.npz"
    assert log_file_name("a/b c") == "a_b_c.npz" and log_file_name(12) == "12.npz"
    names = RequestNames()
    got = [names.get(rid, extra, [1, 2, 3], None, log=True)
           for rid, extra in [("x-1", None), ("x-2", None), ("y", {"randattn_key": "a/b"}),
                              ("z", {"randattn_key": "a_b"})]]
    k = default_key([1, 2, 3])
    assert got == [(k, f"{k}.npz"), (k, f"{k}+1.npz"), ("a/b", "a_b.npz"), ("a_b", "a_b+1.npz")]
    assert names.get("x-1", None, [9], None, log=True) == got[0]  # fixed at first sight (a preempted request)
    names.forget(["x-1", "x-2"])
    assert names.get("x-3", None, [1, 2, 3], None, log=True) == (k, f"{k}+2.npz")  # the engine's third of the key
    assert RequestNames().get("q", None, [1, 2, 3], None, log=False) == (k, None)


# -- in vLLM (the vllm tier) ---------------------------------------------------------------------------------------
ENGINE = {"policy": "random", "budget": 80, "buffer": 16, "seed": 5}
NEW = 96  # T=80, r=16: rounds from length 96, 1-4 per layer


def _requests(prompts):
    """No request carries a key: prompt 0 twice (the same request twice in one batch), prompt 1 with a sampling
    seed (greedy: the seed only changes the key), prompt 3 plain."""
    return [{"prompt_ids": prompts[0], "max_tokens": NEW}, {"prompt_ids": prompts[0], "max_tokens": NEW},
            {"prompt_ids": prompts[1], "seed": 11, "max_tokens": NEW}, {"prompt_ids": prompts[3], "max_tokens": NEW}]


@pytest.fixture(scope="module")
def two_runs(embedded, tmp_path_factory):  # noqa: F811
    folder, prompts = embedded
    case = {"model": folder, "engine": ENGINE, "requests": _requests(prompts), "block_size": 32}
    first = _drive(tmp_path_factory.mktemp("keys_a"), {**case, "bad_keys": True})
    second = _drive(tmp_path_factory.mktemp("keys_b"), {**case, "hf": False})
    return prompts, first, second


@pytest.mark.vllm
def test_unkeyed_requests_get_the_default_key_and_equal_hf_with_it(two_runs):
    """The keep-logs are named by default_key (so vLLM drew with it) and the HF engine with
    ``row_keys=[default_key(ids, seed)]`` gives the same tokens and every keep record."""
    prompts, first, _ = two_runs
    keys = [row["key"] for row in first["requests"]]
    assert keys == [default_key(prompts[0]), default_key(prompts[0]), default_key(prompts[1], 11),
                    default_key(prompts[3])]
    _assert_conforms(first, NEW)


@pytest.mark.vllm
def test_the_same_requests_in_another_run_draw_the_same(two_runs):
    _, first, second = two_runs
    assert first["log_files"] == second["log_files"]  # no random request id in any file name
    for a, b in zip(first["requests"], second["requests"]):
        assert a["key"] == b["key"] and a["log_file"] == b["log_file"]
        assert a["vllm_keep_records"] > 0 and a["vllm_keep_digest"] == b["vllm_keep_digest"], a["key"]
        assert a["vllm_tokens"] == b["vllm_tokens"]


@pytest.mark.vllm
def test_identical_requests_in_one_batch_keep_both_logs(two_runs):
    _, first, _ = two_runs
    a, b = first["requests"][:2]
    assert a["key"] == b["key"] and (a["log_file"], b["log_file"]) == (log_file_name(a["key"]),
                                                                       log_file_name(a["key"], 1))
    assert set(first["log_files"]) == {row["log_file"] for row in first["requests"]}
    assert a["vllm_keep_digest"] == b["vllm_keep_digest"] and a["vllm_tokens"] == b["vllm_tokens"]


@pytest.mark.vllm
def test_a_bad_key_is_refused_for_its_request(two_runs):
    """A float key is refused before it reaches the engine core, naming randattn_key; ``LLM.generate`` over a list
    holding one bad request fails as a whole (vLLM's semantics); the engine serves the next call."""
    bad = two_runs[1]["bad_keys"]
    assert bad["float_key"] and "VLLMValidationError" in bad["float_key"] and "randattn_key" in bad["float_key"]
    assert isinstance(bad["batch_with_bad_key"], str) and "randattn_key" in bad["batch_with_bad_key"]
    assert bad["after"] == 4
